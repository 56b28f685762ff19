"""``NativeSparseAttention``: the paper's attention layer as a ``torch.nn.Module``.

x -> q, k, v projections (independent K/V per branch, or one shared K/V) -> rotary embeddings
(the library's nsa::rotary) -> NSA (compression with a learned phi, top-n selection, sliding
window) gated by sigmoid(Linear(x)) -> output projection. Packed variable-length input with
``cu_seqlens`` or a padded-free ``[B, S, hidden]`` batch; decoding through a paged KV cache,
``NSACache``.

Rotary embeddings (which keys get them, and why): q and the raw keys of *every* branch are
rotated by their position within their own sequence, values never. One q serves all three
branches (the library computes them from the same q), so every key that q meets must carry its
own position for q.k to depend on relative position: the selection and window keys are plain
tokens; the compression keys are rotated before phi, so each compressed key is a learned
summary of keys that carry their positions (with phi = mean it behaves like a key at its
block's positions), and phi's intra-block position embedding adds the position inside the block.
"""
from __future__ import annotations

import dataclasses
import math
import weakref
from typing import List, Optional

import torch
from torch import Tensor, nn

from ._arrays import arrays_for
from ._core import Config, Phi, check_int, error
from . import torch_ops

_PHI_KINDS = ("mean", "linear", "mlp")
# The largest hidden size, head count or head dim the layer accepts: the library's kMaxLength.
_MAX_SIZE = 2 ** 31 - 1


def _check_offsets(cu: List[int], T: int) -> None:
    """Host cu_seqlens of T packed tokens: [0, ..., T], non-decreasing (named errors)."""
    if len(cu) < 1 or cu[0] != 0:
        raise error("cu_seqlens[0]", cu[0] if cu else "absent", "must be 0")
    for b in range(1, len(cu)):
        if cu[b] < cu[b - 1]:
            raise error(f"cu_seqlens[{b}]", cu[b], f"must be >= cu_seqlens[{b - 1}] = {cu[b - 1]}")
    if cu[-1] != T:
        raise error(f"cu_seqlens[{len(cu) - 1}]", cu[-1], f"must equal the number of packed tokens T = {T}")


class NSACache:
    """A paged KV cache of one ``NativeSparseAttention`` layer (spec §10, include/nsa/cache.h):
    tensors you own, in the layout inference engines use.

    ``NSACache()`` is sized by the layer on its first use and grown when a sequence outgrows it
    (eager mode; the layer keeps the lengths on the host too). ``NSACache.allocate(layer,
    batch_size, max_seqlen)`` has a fixed capacity and needs no host work per call: a decode step
    with it runs under ``torch.compile`` and can be captured in a CUDA graph (feed ``[B, S,
    hidden]`` inputs, S new tokens per sequence; lengths advance on the device).

    The layer's first call with a cache is the prefill of every sequence (the prefill kernels,
    then one append); later calls append each sequence's new tokens, which computes every
    compressed block once, when its last token arrives, and attend them with the library's
    decode: the rows of the prefill of the whole sequences. Decoding is not differentiable.

    Tensors (on the layer's device): ``pools`` (k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, kc, vc;
    None where shared K/V has none), raw ones [B * max_pages, page_size, Hkv, D], compressed
    [B * max_pages, page_size / d, Hkv, D]; ``block_table`` [B, max_pages] int32 (sequence b owns
    pages b * max_pages ...); ``seq_lens`` [B] int32; ``status`` [B] int32, the bits the GPU
    kernels set for bad metadata (``check()`` raises on them).
    """

    def __init__(self):
        self.pools: Optional[tuple] = None
        self.block_table: Optional[Tensor] = None
        self.seq_lens: Optional[Tensor] = None
        self.status: Optional[Tensor] = None
        self.page_size = 0
        self.fixed = False  # allocate(): capacity fixed, no host bookkeeping
        self.filled = False  # a first call (the prefill) has happened
        self.lengths: List[int] = []  # host copy of seq_lens (growable caches only)
        self._layer = None  # weak reference to the layer whose keys and values it holds

    def bind(self, layer: "NativeSparseAttention") -> None:
        """Ties the cache to `layer` (its first call, or allocate(), does it); another layer's call
        with this cache is an nsa.Error: a cache holds one layer's projected keys and values, and
        a model needs one cache per layer. reset() unties it."""
        owner = self._layer() if self._layer is not None else None
        if owner is None:
            self._layer = weakref.ref(layer)
        elif owner is not layer:
            raise error("cache", "an NSACache that another layer filled",
                        "one NSACache per layer (it holds that layer's keys and values)")

    @classmethod
    def allocate(cls, layer: "NativeSparseAttention", batch_size: int, max_seqlen: int,
                 page_size: Optional[int] = None, device=None, dtype=None) -> "NSACache":
        """A cache for `batch_size` sequences of up to `max_seqlen` tokens each."""
        if batch_size < 1:
            raise error("batch_size", batch_size, "must be >= 1")
        if max_seqlen < 1:
            raise error("max_seqlen", max_seqlen, "must be >= 1")
        c = cls()
        ref = layer.q_proj.weight
        c._make(layer, batch_size, max_seqlen, page_size, device or ref.device, dtype or ref.dtype)
        c.fixed = True
        c.bind(layer)
        return c

    # ---- shape and state --------------------------------------------------------------------

    def __len__(self) -> int:
        return 0 if self.block_table is None else int(self.block_table.shape[0])

    @property
    def capacity(self) -> int:
        """Tokens each sequence can hold."""
        return 0 if self.block_table is None else int(self.block_table.shape[1]) * self.page_size

    def seq_len(self, b: int) -> int:
        if b >= len(self):
            return 0
        return self.lengths[b] if not self.fixed else int(self.seq_lens[b])

    def arrays(self):
        from ._core import CacheArrays

        return CacheArrays(self.pools, self.block_table, self.seq_lens, self.status, 0)

    def check(self) -> None:
        """Raises nsa.Error if a kernel reported bad metadata for some sequence (reads status: a sync)."""
        bad = [(b, int(s)) for b, s in enumerate(self.status.tolist()) if s]
        if bad:
            raise error("cache.status", bad, "must be all 0 (bits: 1 length out of range, 2 page id out of range, "
                                             "4 bad rows)")

    def reset(self) -> None:
        """Empties every sequence (keeps the memory)."""
        if self.seq_lens is not None:
            self.seq_lens.zero_()
            self.status.zero_()
        self.lengths = [0] * len(self)
        self.filled = False
        self._layer = None

    # ---- allocation -------------------------------------------------------------------------

    @staticmethod
    def _default_page_size(layer) -> int:
        lp = layer.config.slc_block_len
        return lp * max(1, -(-64 // lp))  # the smallest multiple of l' that is >= 64

    def _make(self, layer, batch_size: int, max_seqlen: int, page_size, device, dtype) -> None:
        ps = page_size or (self.page_size or self._default_page_size(layer))
        if ps % layer.config.slc_block_len:
            raise error("page_size", ps, f"must be a multiple of slc_block_len = {layer.config.slc_block_len}")
        max_pages = max(1, -(-max_seqlen // ps))
        P, Hkv, d = batch_size * max_pages, layer.num_kv_heads, layer.config.cmp_stride
        raw = []
        for s in range(3):
            have = s < layer.num_kv_sets
            raw += [torch.zeros((P, ps, Hkv, layer.head_dim), device=device, dtype=dtype) if have else None,
                    torch.zeros((P, ps, Hkv, layer.v_head_dim), device=device, dtype=dtype) if have else None]
        kc = torch.zeros((P, ps // d, Hkv, layer.head_dim), device=device, dtype=dtype)
        vc = torch.zeros((P, ps // d, Hkv, layer.v_head_dim), device=device, dtype=dtype)
        old = self.pools
        self.pools = tuple(raw) + (kc, vc)
        table = torch.arange(P, dtype=torch.int32, device=device).view(batch_size, max_pages)
        if old is not None:  # growing: each sequence's pages move to the front of its new range
            old_pages = self.block_table.shape[1]
            for new, prev in zip(self.pools, old):
                if new is not None:
                    new.view(batch_size, max_pages, *new.shape[1:])[:, :old_pages] = prev.view(
                        batch_size, old_pages, *prev.shape[1:])
        self.block_table = table
        if self.seq_lens is None:
            self.seq_lens = torch.zeros(batch_size, dtype=torch.int32, device=device)
            self.status = torch.zeros(batch_size, dtype=torch.int32, device=device)
            self.lengths = [0] * batch_size
        self.page_size = ps


# _SplitRotate hands each K and V set over as a compact [T, Hkv, D] array (the rotated keys written
# set by set into one [S, T, Hkv, D] array, the values copied so), not as views into the rows of y
# or of one rotated [T, S Hkv, D] array; False: views (the A/B of bench/layer_bench.py --kv-sets).
_COMPACT_KV_SETS = True


class _SplitRotate(torch.autograd.Function):
    """The fused projection's output y [T, q | k | v | gate | padding] taken apart: q [T, Hq, Dqk] and
    each K set [T, Hkv, Dqk] rotated (nsa::rotary, by positions [T] int32 or the places in the
    sequences of cu_seqlens; inv_freq None: no rotary, q a view of y), each V set [T, Hkv, Dv]
    (the K and V sets compact: _COMPACT_KV_SETS) and the gate's part [T, width] as a view of y.
    parts: (Hq, K/V sets S, Hkv, Dqk, Dv, the gate's width). Returns q, the S K sets, the S V sets,
    the gate's part.

    The backward writes y's gradient once, [T, N], each part into its own columns: q's and the K
    sets' rotated back straight there (nsa::rotary_into), the V sets' and the gate's copied. Without
    it autograd would stack the sets' gradients, rotate into new arrays and concatenate the parts (at
    64K, Hq 64, hidden 8192: ~3 GB more memory traffic a step)."""

    @staticmethod
    def forward(ctx, y, parts, inv_freq, positions, cu_seqlens, backend, num_threads):
        hq, sets, hkv, dqk, dv, gw = parts
        T = y.shape[0]
        nq, nk = hq * dqk, sets * hkv * dqk
        q = y[:, :nq].view(T, hq, dqk)
        k = y[:, nq:nq + nk].view(T, sets, hkv, dqk)
        v = y[:, nq + nk:nq + nk + sets * hkv * dv].view(T, sets, hkv, dv)
        if inv_freq is not None:
            q = torch.ops.nsa.rotary(q, inv_freq, cu_seqlens, positions, False, backend, num_threads)
        if not _COMPACT_KV_SETS:
            if inv_freq is not None:
                k = torch.ops.nsa.rotary(k.reshape(T, sets * hkv, dqk), inv_freq, cu_seqlens, positions, False,
                                         backend, num_threads).view(T, sets, hkv, dqk)
            ks, vs = k.unbind(1), v.unbind(1)
        else:
            if inv_freq is not None:
                kc = y.new_empty((sets, T, hkv, dqk))
                for s in range(sets):
                    torch.ops.nsa.rotary_into(k[:, s], inv_freq, cu_seqlens, positions, False, backend, num_threads,
                                              kc[s])
                ks = kc.unbind(0)
            else:
                ks = k.transpose(0, 1).contiguous().unbind(0)
            vs = v.transpose(0, 1).contiguous().unbind(0)
        g = y[:, nq + nk + sets * hkv * dv:nq + nk + sets * hkv * dv + gw]
        ctx.parts, ctx.statics, ctx.width = parts, (backend, num_threads), y.shape[1]
        ctx.save_for_backward(inv_freq, positions, cu_seqlens)
        return (q, *ks, *vs, g)

    @staticmethod
    def backward(ctx, dq, *rest):
        hq, sets, hkv, dqk, dv, gw = ctx.parts
        backend, num_threads = ctx.statics
        inv_freq, positions, cu_seqlens = ctx.saved_tensors
        T = dq.shape[0]
        dy = dq.new_empty((T, ctx.width))
        col = 0

        def put(grad, heads, dim, rotate):
            nonlocal col
            dst = dy[:, col:col + heads * dim].view(T, heads, dim)
            if rotate:  # the rotation's transpose: rotate back
                torch.ops.nsa.rotary_into(grad, inv_freq, cu_seqlens, positions, True, backend, num_threads, dst)
            else:
                dst.copy_(grad)
            col += heads * dim

        put(dq, hq, dqk, inv_freq is not None)
        for dk in rest[:sets]:
            put(dk, hkv, dqk, inv_freq is not None)
        for dvs in rest[sets:2 * sets]:
            put(dvs, hkv, dv, False)
        dy[:, col:col + gw].copy_(rest[2 * sets])
        dy[:, col + gw:].zero_()  # the padding's columns
        return dy, None, None, None, None, None, None


class NativeSparseAttention(nn.Module):
    """Native Sparse Attention layer (Yuan et al., arXiv 2502.11089).

    Args:
        hidden_size: width of the input and output.
        num_heads: query heads Hq.
        num_kv_heads: KV heads Hkv (GQA; divides num_heads). Default: num_heads.
        head_dim: Dqk (even when rotary is on). Default: hidden_size // num_heads.
        v_head_dim: Dv. Default: head_dim.
        config: nsa.Config (block sizes l, d, l', n, n_init, n_local, w, scale); paper defaults.
        phi: compression function, 'mlp' (the paper's), 'linear' or 'mean'.
        phi_hidden: hidden width F of the mlp phi. Default: 4 * head dim (of keys resp. values).
        shared_kv: one K/V projection for all three branches instead of one per branch.
        gate_hidden: 0 (the default): the gates are sigmoid(Linear(x)), one product of 3 Hq columns
            fused into the layer's projection, as the public NSA layers have them. N > 0: an MLP gate,
            sigmoid(Linear -> SiLU -> Linear) with N hidden units, whose first layer adds N columns
            to the projection.
        rotary: apply rotary position embeddings to q and keys; rope_theta: their base.
        bias: biases in the q/k/v/output projections.
        backend, num_threads: where the library runs ('auto', 'reference', 'cpu', 'cuda').
        save_branch_outputs: keep each branch's output for the backward when training (3x the
            attention output's memory per layer; the CUDA backward is then ~13% faster at 64K).
        save_cmp_output: keep the compressed branch's output for the backward when training on
            CUDA (on by default; the attention output's memory per layer; the CUDA backward then
            takes that branch's dg from it instead of recomputing the branch). Not needed with
            save_branch_outputs, which keeps it among the three.
        save_win_output: the same for the window branch (on by default). With both the CUDA
            backward recomputes no branch output (it keeps o, the layer's output, anyway).
        backbone: the reach backbone (spec §11): the layer forces the offsets that
            nsa.backbone_schedule(layer_idx, max_seqlen, l', backbone_per_layer) gives it (they take
            places of n; off by default: plain NSA). layer_idx (0-based) and max_seqlen (the longest
            sequence the model sees) are then required.

        process_group: a torch.distributed process group: context parallelism (nsa.distributed). x is
            then this rank's rows of the packed batch in the zig-zag layout
            (nsa.distributed.zigzag_split), cu_seqlens the GLOBAL offsets (host, the same on every
            rank), and the result this rank's rows of the layer's output. Every parameter's
            gradient (phi's too) is this rank's share: their sum over the group is the single-process
            gradient (DistributedDataParallel's all-reduce gives the mean, 1/P of it). No cache, no
            [B, S, hidden] input.

    capture (attribute, False by default): while True, each prefill forward keeps, detached, what
        the library returns besides the output in `layer.aux`: {"indices": [T, Hkv, n] selected
        blocks (-1 padded), "lse": [T, Hq, 3] per-branch log-sum-exps, "gates": [T, Hq, 3]}, for
        statistics of what the layer selects (train/evaluate.py).

    forward(x, cu_seqlens=None, max_seqlen=None, cache=None):
        x [T, hidden] (packed sequences, cu_seqlens [B+1]) or [B, S, hidden] (B sequences of S).
        With a cache (NSACache), x holds the new tokens of each of the cache's sequences
        (cu_seqlens over the new tokens, a 0-length entry for an idle one; or [B, S, hidden], S
        new tokens each) and the result holds their rows.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, v_head_dim: Optional[int] = None,
                 config: Optional[Config] = None, phi: str = "mlp", phi_hidden: Optional[int] = None,
                 shared_kv: bool = False, gate_hidden: int = 0, rotary: bool = True,
                 rope_theta: float = 10000.0, bias: bool = False, backend: str = "auto", num_threads: int = 0,
                 save_branch_outputs: bool = False, save_cmp_output: bool = True, save_win_output: bool = True,
                 backbone: bool = False,
                 layer_idx: Optional[int] = None,
                 max_seqlen: Optional[int] = None, backbone_per_layer: int = 1, process_group=None, device=None,
                 dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        # Sizes first (head_dim's default divides by num_heads), each an integer of a sane range.
        hidden_size = check_int(hidden_size, "hidden_size", 1, _MAX_SIZE, f"must be in [1, {_MAX_SIZE}]")
        num_heads = check_int(num_heads, "num_heads", 1, _MAX_SIZE, f"must be in [1, {_MAX_SIZE}]")
        num_kv_heads = num_heads if num_kv_heads is None else check_int(num_kv_heads, "num_kv_heads")
        if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise error("num_heads", num_heads, f"must be a positive multiple of num_kv_heads = {num_kv_heads}")
        head_dim = hidden_size // num_heads if head_dim is None else check_int(head_dim, "head_dim")
        v_head_dim = head_dim if v_head_dim is None else check_int(v_head_dim, "v_head_dim")
        for name, value in (("head_dim", head_dim), ("v_head_dim", v_head_dim)):
            if value > _MAX_SIZE:
                raise error(name, value, f"must be in [1, {_MAX_SIZE}]")
        if head_dim < 1 or v_head_dim < 1:
            raise error("head_dim", head_dim, "must be >= 1 (and v_head_dim too)")
        if rotary and head_dim % 2:
            raise error("head_dim", head_dim, "must be even with rotary embeddings (pairs of channels rotate)")
        if phi not in _PHI_KINDS:
            raise error("phi", repr(phi), "must be one of 'mean', 'linear', 'mlp'")
        self.config = config if config is not None else Config()
        if backbone:
            if layer_idx is None or max_seqlen is None:
                raise error("layer_idx" if layer_idx is None else "max_seqlen", "None",
                            "must be given with backbone=True (the schedule depends on them)")
            from ._nsa import backbone_schedule

            offsets = backbone_schedule(check_int(layer_idx, "layer_idx"), check_int(max_seqlen, "max_seqlen"),
                                        self.config.checked().slc_block_len, check_int(backbone_per_layer, "per_layer"))
            self.config = dataclasses.replace(self.config, backbone_offsets=tuple(offsets))
        self.config.native(phi, shared_kv).validate()
        self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_kv_heads
        self.head_dim, self.v_head_dim = head_dim, v_head_dim
        self.phi, self.shared_kv, self.rotary, self.rope_theta = phi, shared_kv, rotary, rope_theta
        self.backend, self.num_threads = backend, num_threads
        self.save_branch_outputs, self.save_cmp_output = save_branch_outputs, save_cmp_output
        self.save_win_output = save_win_output
        self.process_group = process_group
        self.capture, self.aux = False, None
        self.num_kv_sets = 1 if shared_kv else 3  # K/V sets: one shared, or (cmp, slc, win)

        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(hidden_size, self.num_kv_sets * num_kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(hidden_size, self.num_kv_sets * num_kv_heads * v_head_dim, bias=bias, **factory)
        gate_hidden = check_int(gate_hidden, "gate_hidden", 0, _MAX_SIZE,
                                f"must be in [0, {_MAX_SIZE}] (0: a linear gate; N > 0: an MLP gate N wide)")
        if gate_hidden:
            self.gate = nn.Sequential(nn.Linear(hidden_size, gate_hidden, **factory), nn.SiLU(),
                                      nn.Linear(gate_hidden, num_heads * 3, **factory))
        else:
            self.gate = nn.Sequential(nn.Linear(hidden_size, num_heads * 3, **factory))
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=bias, **factory)

        l = self.config.cmp_block_len
        self.phi_k = self._phi_parameters(phi, head_dim, l, phi_hidden, factory)
        self.phi_v = self._phi_parameters(phi, v_head_dim, l, phi_hidden, factory)
        self._reset_phi()

        if rotary:
            inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
            self.register_buffer("inv_freq", inv_freq, persistent=False)

    @staticmethod
    def _phi_parameters(kind: str, D: int, l: int, hidden: Optional[int], factory) -> nn.ParameterDict:
        # Shapes of include/nsa/api.h PhiParams; the same parameters serve every KV head.
        shapes = {}
        if kind == "linear":
            shapes = {"w1": (D, l * D), "pe": (l, D)}
        elif kind == "mlp":
            F = 4 * D if hidden is None else hidden
            shapes = {"w1": (F, l * D), "b1": (F,), "w2": (D, F), "b2": (D,), "pe": (l, D)}
        return nn.ParameterDict({name: nn.Parameter(torch.empty(shape, **factory)) for name, shape in shapes.items()})

    def _reset_phi(self) -> None:
        l = self.config.cmp_block_len
        with torch.no_grad():
            for params in (self.phi_k, self.phi_v):
                if self.phi == "linear":
                    # Start as mean pooling: W = [I/l, ..., I/l], pe = 0.
                    D = params["pe"].shape[1]
                    eye = torch.eye(D, dtype=params["w1"].dtype, device=params["w1"].device) / l
                    params["w1"].copy_(eye.repeat(1, l))
                    params["pe"].zero_()
                elif self.phi == "mlp":
                    # Like nn.Linear (uniform in +-1/sqrt(fan_in)); pe small, as position embeddings are.
                    for w, b in (("w1", "b1"), ("w2", "b2")):
                        bound = 1.0 / math.sqrt(params[w].shape[1])
                        nn.init.uniform_(params[w], -bound, bound)
                        nn.init.uniform_(params[b], -bound, bound)
                    nn.init.normal_(params["pe"], std=0.02)

    def reset_parameters(self) -> None:
        linears = [m for m in self.gate if isinstance(m, nn.Linear)]
        for module in (self.q_proj, self.k_proj, self.v_proj, *linears, self.o_proj):
            module.reset_parameters()
        self._reset_phi()

    def extra_repr(self) -> str:
        c = self.config
        return (f"hidden_size={self.hidden_size}, heads={self.num_heads}/{self.num_kv_heads}, "
                f"head_dim={self.head_dim}/{self.v_head_dim}, phi={self.phi}, shared_kv={self.shared_kv}, "
                f"l={c.cmp_block_len}, d={c.cmp_stride}, l'={c.slc_block_len}, n={c.n_selected}, w={c.window}, "
                f"gate_hidden={self.gate[0].out_features if len(self.gate) > 1 else 0}, rotary={self.rotary}"
                + (f", backbone={tuple(c.backbone_offsets)}" if c.backbone_offsets else ""))

    # ---- pieces ----------------------------------------------------------------------------

    def _phi(self, params: nn.ParameterDict, dtype: torch.dtype) -> Optional[Phi]:
        """phi's parameters in the call's dtype: under autocast the projections give bf16/f16 while
        the parameters stay fp32, and the library takes one dtype per call (the cast is part of the
        graph, so the fp32 parameters get their gradients, as autocast's own casts do)."""
        if self.phi == "mean":
            return None
        return Phi(**{name: p if p.dtype == dtype else p.to(dtype) for name, p in params.items()})

    def _rotary_args(self, x: Tensor, positions: Optional[Tensor]):
        """inv_freq as float32 and positions as int32 on x's device, as nsa::rotary takes them."""
        # The buffer follows module.to(dtype); its values are float32 ones (the library takes f32).
        inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float32 else self.inv_freq.float()
        if positions is not None:  # positions within sequences: they fit int32 (lengths do)
            positions = positions.to(device=x.device, dtype=torch.int32)
        return inv_freq, positions

    def _rotate(self, x: Tensor, positions: Optional[Tensor] = None, cu_seqlens=None) -> Tensor:
        """x [T, H, D] rotated (pairs (i, i + D/2), GPT-NeoX layout) by each token's position:
        positions [T] (integers), or without them the token's place in its sequence of cu_seqlens
        (None: one sequence). One library call, nsa::rotary, forward and backward: angles
        float(pos) * inv_freq and the rotation in float32 (float64 for float64 tensors; bf16/fp16
        angles would be far off at long positions), rounded once to x's dtype."""
        if not self.rotary:
            return x
        inv_freq, positions = self._rotary_args(x, positions)
        return torch_ops.rotary(x, inv_freq, positions, cu_seqlens, False, self.backend, self.num_threads)

    def _project(self, x: Tensor, positions: Optional[Tensor] = None, cu_seqlens=None):
        """q [T, Hq, Dqk], K/V sets (lists of [T, Hkv, D]), gates [T, Hq, 3] of the tokens x [T, hidden],
        q and keys rotated by positions [T] or, without them, by the tokens' places in their sequences
        of cu_seqlens (every K set in one call)."""
        T = x.shape[0]
        if self._fuses(T):
            y = self._fused_projection(x)
            inv_freq, positions = self._rotary_args(x, positions) if self.rotary else (None, None)
            parts = (self.num_heads, self.num_kv_sets, self.num_kv_heads, self.head_dim, self.v_head_dim,
                     self.gate[0].out_features)
            q, *rest = _SplitRotate.apply(y, parts, inv_freq, positions, cu_seqlens, self.backend, self.num_threads)
            S = self.num_kv_sets
            ks, vs, g = rest[:S], rest[S:2 * S], rest[2 * S]
            if len(self.gate) > 1:  # the MLP gate: the product gave its first layer
                g = self.gate[2](self.gate[1](g))
        else:
            q, k, v, g = self.q_proj(x), self.k_proj(x), self.v_proj(x), self.gate(x)
            q = self._rotate(q.view(T, self.num_heads, self.head_dim), positions, cu_seqlens)
            k = self._rotate(k.view(T, self.num_kv_sets * self.num_kv_heads, self.head_dim), positions, cu_seqlens)
            ks = k.view(T, self.num_kv_sets, self.num_kv_heads, self.head_dim).unbind(1)
            vs = v.view(T, self.num_kv_sets, self.num_kv_heads, self.v_head_dim).unbind(1)
        g = torch.sigmoid(g).view(T, self.num_heads, 3)
        return q, list(ks), list(vs), g

    def _projections_of_x(self):
        """The modules that read x, in the order of the fused product's parts: q, k, v, gate[0]."""
        return self.q_proj, self.k_proj, self.v_proj, self.gate[0]

    def _fusable(self) -> bool:
        """Whether q, k, v and the gate's first layer, which all read x, run as one product: when
        all four are plain nn.Linear modules and nothing hooks them or the gate (an adapter such as
        LoRA, a parametrization or a hook replaces or wraps a module: then every module runs as
        itself), and q's, k's and v's parts are multiples of 8 columns (the library needs rows of
        the parts that reach it aligned to 16 bytes). The gate's part, the last, may have any width
        (3 Hq for the linear gate): the product is padded with zero columns to a multiple of 8."""
        mods = self._projections_of_x()
        hooked = [m for m in (*mods, self.gate)
                  if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks]
        global_hooks = getattr(nn.modules.module, "_global_forward_hooks", None) or \
            getattr(nn.modules.module, "_global_forward_pre_hooks", None)
        return (not hooked and not global_hooks and all(type(m) is nn.Linear for m in mods)
                and all(m.out_features % 8 == 0 for m in mods[:3]))

    def _fuses(self, T) -> bool:
        """Whether the projections of T tokens run as one product: where they can (_fusable) and it
        saves memory traffic. Stacking the weights copies them (2 N hidden elements for N output
        columns) each call; separate products read x (T hidden) three more times. So: while autograd
        records (one product also gives dx in the backward, not four and a sum), and otherwise where
        3 T > 2 N (a long prefill). A decode step (T = the batch) reads each weight once."""
        if not self._fusable():
            return False
        mods = self._projections_of_x()
        if torch.is_grad_enabled() and any(m.weight.requires_grad for m in mods):
            return True
        return 3 * T > 2 * sum(m.out_features for m in mods)

    def _fused_projection(self, x: Tensor) -> Tensor:
        """y [T, q | k | v | the gate's first layer | padding] of x [T, hidden]: one product with the
        four weights stacked, so x is read once and the backward's dx is one product, not four and a
        sum (_SplitRotate takes the parts apart); zero rows pad the stacked weight to a multiple of 8
        so that y's rows, which the library reads the parts from, stay aligned to 16 bytes."""
        mods = self._projections_of_x()
        w0 = mods[0].weight
        pad = -sum(m.out_features for m in mods) % 8
        weight = torch.cat([m.weight for m in mods] + ([w0.new_zeros(pad, w0.shape[1])] if pad else []))
        bias = None
        if any(m.bias is not None for m in mods):
            bias = torch.cat([w0.new_zeros(m.out_features) if m.bias is None else m.bias for m in mods]
                             + ([w0.new_zeros(pad)] if pad else []))
        return nn.functional.linear(x, weight, bias)

    def _attend(self, q, ks, vs, g, cu_seqlens, max_seqlen) -> Tensor:
        k = ks[0] if self.shared_kv else tuple(ks)
        v = vs[0] if self.shared_kv else tuple(vs)
        kv6 = (k, v, None, None, None, None) if self.shared_kv else (k[0], v[0], k[1], v[1], k[2], v[2])
        o, lse, indices = torch_ops.attention(q, kv6, g, self._phi(self.phi_k, q.dtype), self._phi(self.phi_v, q.dtype),
                                              self.config, cu_seqlens, max_seqlen, self.backend, self.num_threads,
                                              self.save_branch_outputs, save_cmp=self.save_cmp_output,
                                              save_win=self.save_win_output)
        if self.capture:
            self.aux = {"indices": indices.detach(), "lse": lse.detach(), "gates": g.detach()}
        return o

    # ---- forward ---------------------------------------------------------------------------

    def forward(self, x: Tensor, cu_seqlens=None, max_seqlen: Optional[int] = None,
                cache: Optional[NSACache] = None) -> Tensor:
        batched = x.dim() == 3
        if batched:
            if cu_seqlens is not None:
                raise error("cu_seqlens", "given", "must be None for a [B, S, hidden] input (it has B sequences of S)")
            B, S, _ = x.shape
            x = x.reshape(B * S, self.hidden_size)
            cu_seqlens = torch.arange(0, (B + 1) * S, S, dtype=torch.int32) if B > 1 else None
            max_seqlen = S
        elif x.dim() != 2:
            raise error("x.ndim", x.dim(), "must be 2 ([T, hidden], packed) or 3 ([B, S, hidden])")
        if x.shape[-1] != self.hidden_size:
            raise error("x.shape[-1]", x.shape[-1], f"must be hidden_size = {self.hidden_size}")
        weight = self.q_proj.weight
        # The projections need x in the parameters' dtype (autocast converts both itself).
        if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
            fw = arrays_for(x)
            raise error("x.dtype", fw.dtype_name(x),
                        f"must be the layer's dtype, {fw.dtype_name(weight)} (convert x, or the layer with .to(dtype))")
        if self.process_group is not None:
            if cache is not None or batched:
                raise error("cache" if cache is not None else "x.ndim", "given" if cache is not None else 3,
                            "must be None (2: [T, hidden]) with a process_group (context parallelism)")
            out = self._context_parallel(x, cu_seqlens)
        elif cache is None:
            out = self._prefill(x, cu_seqlens, max_seqlen)
        else:
            out = self._with_cache(x, cu_seqlens, cache, B if batched else None)
        return out.view(B, S, self.hidden_size) if batched else out

    def _prefill(self, x: Tensor, cu_seqlens, max_seqlen) -> Tensor:
        T = x.shape[0]
        if cu_seqlens is not None:
            cu = torch.as_tensor(cu_seqlens)
            # Host offsets: checked here, before they are copied next to device tensors, where the
            # library cannot read them (not while torch.compile traces: the values are data there;
            # the library checks host offsets when the call runs).
            if cu.device.type == "cpu" and not torch.compiler.is_compiling():
                _check_offsets([int(c) for c in cu.tolist()], T)
        # Each token's position within its sequence: the rotary kernel derives it from the offsets
        # (placed on x's device once for q and the keys).
        rotary_cu = torch_ops.sequences(cu_seqlens, None, x)[0] if self.rotary else None
        q, ks, vs, g = self._project(x, None, rotary_cu)
        o = self._attend(q, ks, vs, g, cu_seqlens, max_seqlen)
        return self.o_proj(o.reshape(T, self.num_heads * self.v_head_dim))

    def _context_parallel(self, x: Tensor, cu_seqlens) -> Tensor:
        """This rank's rows of the layer's output over the whole batch (nsa.distributed): its own
        projections, rotated by its rows' positions, then the context-parallel attention."""
        import torch.distributed as dist

        from . import distributed

        if cu_seqlens is None:
            raise error("cu_seqlens", "None", "must be the global offsets of the batch with a process_group")
        cu = [int(c) for c in torch.as_tensor(cu_seqlens).tolist()]
        group = self.process_group
        positions = distributed.zigzag_positions(cu, dist.get_rank(group), dist.get_world_size(group))
        # Rows that do not match the layout: left to distributed.attention, which raises on every
        # rank alike (an error here, on this rank only, would leave the others waiting).
        q, ks, vs, g = self._project(x, positions.to(x.device) if x.shape[0] == positions.numel() else None)
        k = ks[0] if self.shared_kv else tuple(ks)
        v = vs[0] if self.shared_kv else tuple(vs)
        o = distributed.attention(q, k, v, g, self._phi(self.phi_k, q.dtype), self._phi(self.phi_v, q.dtype),
                                  cu_seqlens=cu, group=group, config=self.config, backend=self.backend,
                                  num_threads=self.num_threads, sum_phi_grads=False)
        return self.o_proj(o.reshape(x.shape[0], self.num_heads * self.v_head_dim))

    def _with_cache(self, x: Tensor, cu_seqlens, cache: NSACache, batch: Optional[int]) -> Tensor:
        """Appends the new tokens x of each sequence to the cache and returns their rows: the
        prefill kernels on the first call, the library's decode afterwards (NSACache says more).
        batch: B for a [B, S, hidden] input (S new tokens each), else None (cu_seqlens over x)."""
        if not torch.compiler.is_compiling():  # (a host-side check, as the offsets' below)
            cache.bind(self)
        T = x.shape[0]
        if T == 0:
            return x.new_zeros((0, self.hidden_size))
        if batch is not None:
            B, counts = batch, None
        else:
            cu = [0, T] if cu_seqlens is None else [int(c) for c in torch.as_tensor(cu_seqlens).tolist()]
            _check_offsets(cu, T)
            B, counts = len(cu) - 1, [b - a for a, b in zip(cu, cu[1:])]
        if cache.block_table is None:
            cache._make(self, B, max(counts or [T // max(B, 1)]) + 1, None, x.device, x.dtype)
        if B != len(cache):
            raise error("cu_seqlens", f"{B} sequences",
                        f"must cover every cached sequence ({len(cache)}); give a 0-length entry for idle ones")
        if not cache.fixed:
            per_seq = counts if counts is not None else [T // B] * B
            need = max(length + m for length, m in zip(cache.lengths, per_seq))
            if need > cache.capacity:
                cache._make(self, B, max(need, 2 * cache.capacity), None, x.device, x.dtype)
        # Positions of the new tokens (their sequence's length so far, onwards), on the device.
        old = cache.seq_lens.to(torch.int64)
        if counts is None:
            S = T // B
            m_dev = torch.full((B,), S, dtype=torch.int32, device=x.device)
            positions = (old[:, None] + torch.arange(S, device=x.device)[None, :]).reshape(-1)
            cu_new = None
        else:
            m_dev = torch.tensor(counts, dtype=torch.int32, device=x.device)
            cu_new = torch.tensor([0] + list(torch.tensor(counts).cumsum(0).tolist()), dtype=torch.int32)
            starts = torch.repeat_interleave(cu_new[:-1].to(x.device, torch.int64), m_dev, output_size=T)
            positions = torch.repeat_interleave(old, m_dev, output_size=T) + torch.arange(T, device=x.device) - starts
        with torch.no_grad():
            q, ks, vs, g = self._project(x, positions)
        cache.seq_lens.add_(m_dev)
        kv6 = (ks[0], vs[0], None, None, None, None) if self.shared_kv else (ks[0], vs[0], ks[1], vs[1], ks[2], vs[2])
        prefill = not cache.filled
        if prefill:
            o = self._attend(q, ks, vs, g, cu_new if cu_new is not None else
                             torch.arange(0, (B + 1) * (T // B), T // B, dtype=torch.int32), None)
        phi_k, phi_v = self._phi(self.phi_k, ks[0].dtype), self._phi(self.phi_v, ks[0].dtype)
        detach = (lambda p: None if p is None else Phi(*[None if t is None else t.detach() for t in p]))
        max_new = (T // B) if counts is None else max(counts, default=0)
        torch_ops.cache_append(cache.arrays(), kv6, detach(phi_k), detach(phi_v), self.config, cu_new, max_new,
                               self.backend, self.num_threads)
        if not prefill:
            o = torch_ops.decode(cache.arrays(), q, g, self.config, cu_new, max_new, self.shared_kv, self.backend,
                                 self.num_threads)[0]
        cache.filled = True
        if not cache.fixed:
            cache.lengths = [length + m for length, m in zip(cache.lengths, counts or [T // B] * B)]
        return self.o_proj(o.reshape(T, self.num_heads * self.v_head_dim))
