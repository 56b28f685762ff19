"""``NativeSparseAttention``: the paper's attention layer as a ``torch.nn.Module``.

x -> q, k, v projections (independent K/V per branch, or one shared K/V) -> rotary embeddings
-> NSA (compression with a learned phi, top-n selection, sliding window) gated by
sigmoid(MLP(x)) -> output projection. Packed variable-length input with ``cu_seqlens`` or a
padded-free ``[B, S, hidden]`` batch; a simple decode path through ``NSACache``.

Rotary embeddings (which keys get them, and why): q and the raw keys of *every* branch are
rotated by their position within their own sequence, values never. One q serves all three
branches (the library computes them from the same q), so every key that q meets must carry its
own position for q.k to depend on relative position: the selection and window keys are plain
tokens; the compression keys are rotated before phi, so each compressed key is a learned
summary of keys that carry their positions (with phi = mean it behaves like a key at its
block's positions), and phi's intra-block position embedding adds the position inside the block.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch
from torch import Tensor, nn

from ._core import Config, Phi, error
from . import torch_ops

_PHI_KINDS = ("mean", "linear", "mlp")


class NSACache:
    """Raw keys and values of every sequence seen so far, for decoding with one layer.

    The library has no KV cache yet (spec §10). Until it has, decoding appends the new tokens'
    rotated keys and values here and recomputes the layer over each whole cached sequence,
    keeping only the new rows: exactly the prefill output of those rows, at the cost of a
    prefill per step. It will move to the library's cache (which computes each compressed block
    once, when its last token arrives) once that exists.
    """

    def __init__(self):
        self.keys: List[List[Tensor]] = []  # per sequence: one [T_b, Hkv, Dqk] per K/V set
        self.values: List[List[Tensor]] = []  # per sequence: one [T_b, Hkv, Dv] per K/V set

    def __len__(self) -> int:
        return len(self.keys)

    def seq_len(self, b: int) -> int:
        return int(self.keys[b][0].shape[0]) if b < len(self.keys) else 0

    def append(self, b: int, keys: List[Tensor], values: List[Tensor]) -> None:
        if b == len(self.keys):
            self.keys.append([k.detach() for k in keys])
            self.values.append([v.detach() for v in values])
        else:
            self.keys[b] = [torch.cat([old, new.detach()]) for old, new in zip(self.keys[b], keys)]
            self.values[b] = [torch.cat([old, new.detach()]) for old, new in zip(self.values[b], values)]


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
        gate_hidden: hidden width of the gate MLP. Default: hidden_size // 4.
        rotary: apply rotary position embeddings to q and keys; rope_theta: their base.
        bias: biases in the q/k/v/output projections.
        backend, num_threads: where the library runs ('auto', 'reference', 'cpu', 'cuda').
        save_branch_outputs: keep each branch's output for the backward when training (3x the
            attention output's memory per layer; the CUDA backward is then about 25% faster).

    forward(x, cu_seqlens=None, max_seqlen=None, cache=None):
        x [T, hidden] (packed sequences, cu_seqlens [B+1]) or [B, S, hidden] (B sequences of S).
        With a cache, x holds the new tokens of each cached sequence (cu_seqlens over the new
        tokens; a sequence not yet in the cache starts there) and the result holds their rows.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, v_head_dim: Optional[int] = None,
                 config: Optional[Config] = None, phi: str = "mlp", phi_hidden: Optional[int] = None,
                 shared_kv: bool = False, gate_hidden: Optional[int] = None, rotary: bool = True,
                 rope_theta: float = 10000.0, bias: bool = False, backend: str = "auto", num_threads: int = 0,
                 save_branch_outputs: bool = False, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        head_dim = hidden_size // num_heads if head_dim is None else head_dim
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise error("num_heads", num_heads, f"must be a positive multiple of num_kv_heads = {num_kv_heads}")
        if head_dim < 1 or v_head_dim < 1:
            raise error("head_dim", head_dim, "must be >= 1 (and v_head_dim too)")
        if rotary and head_dim % 2:
            raise error("head_dim", head_dim, "must be even with rotary embeddings (pairs of channels rotate)")
        if phi not in _PHI_KINDS:
            raise error("phi", repr(phi), "must be one of 'mean', 'linear', 'mlp'")
        self.config = config if config is not None else Config()
        self.config.native(phi, shared_kv).validate()
        self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_kv_heads
        self.head_dim, self.v_head_dim = head_dim, v_head_dim
        self.phi, self.shared_kv, self.rotary, self.rope_theta = phi, shared_kv, rotary, rope_theta
        self.backend, self.num_threads = backend, num_threads
        self.save_branch_outputs = save_branch_outputs
        self.num_kv_sets = 1 if shared_kv else 3  # K/V sets: one shared, or (cmp, slc, win)

        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(hidden_size, self.num_kv_sets * num_kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(hidden_size, self.num_kv_sets * num_kv_heads * v_head_dim, bias=bias, **factory)
        gate_hidden = max(1, hidden_size // 4) if gate_hidden is None else gate_hidden
        self.gate = nn.Sequential(nn.Linear(hidden_size, gate_hidden, **factory), nn.SiLU(),
                                  nn.Linear(gate_hidden, num_heads * 3, **factory))
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
        for module in (self.q_proj, self.k_proj, self.v_proj, self.gate[0], self.gate[2], self.o_proj):
            module.reset_parameters()
        self._reset_phi()

    def extra_repr(self) -> str:
        c = self.config
        return (f"hidden_size={self.hidden_size}, heads={self.num_heads}/{self.num_kv_heads}, "
                f"head_dim={self.head_dim}/{self.v_head_dim}, phi={self.phi}, shared_kv={self.shared_kv}, "
                f"l={c.cmp_block_len}, d={c.cmp_stride}, l'={c.slc_block_len}, n={c.n_selected}, w={c.window}, "
                f"rotary={self.rotary}")

    # ---- pieces ----------------------------------------------------------------------------

    def _phi(self, params: nn.ParameterDict) -> Optional[Phi]:
        if self.phi == "mean":
            return None
        return Phi(**{name: p for name, p in params.items()})

    def _rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """x [T, H, D] rotated by positions [T] (pairs (i, i + D/2), GPT-NeoX layout)."""
        if not self.rotary:
            return x
        # At least float32 (bf16/fp16 angles would be far off at long positions); float64 stays.
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        angles = positions.to(work)[:, None] * self.inv_freq.to(work)[None, :]  # [T, D/2]
        cos = torch.cos(angles)[:, None, :]
        sin = torch.sin(angles)[:, None, :]
        x1, x2 = x.to(work).chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def _project(self, x: Tensor, positions: Tensor):
        """q [T, Hq, Dqk], K/V sets (lists of [T, Hkv, D]), gates [T, Hq, 3] of the tokens x [T, hidden]."""
        T = x.shape[0]
        q = self._rotate(self.q_proj(x).view(T, self.num_heads, self.head_dim), positions)
        ks = self.k_proj(x).view(T, self.num_kv_sets, self.num_kv_heads, self.head_dim).unbind(1)
        vs = self.v_proj(x).view(T, self.num_kv_sets, self.num_kv_heads, self.v_head_dim).unbind(1)
        ks = [self._rotate(k, positions) for k in ks]
        g = torch.sigmoid(self.gate(x)).view(T, self.num_heads, 3)
        return q, list(ks), list(vs), g

    def _attend(self, q, ks, vs, g, cu_seqlens, max_seqlen) -> Tensor:
        k = ks[0] if self.shared_kv else tuple(ks)
        v = vs[0] if self.shared_kv else tuple(vs)
        kv6 = (k, v, None, None, None, None) if self.shared_kv else (k[0], v[0], k[1], v[1], k[2], v[2])
        o, _, _ = torch_ops.attention(q, kv6, g, self._phi(self.phi_k), self._phi(self.phi_v), self.config,
                                      cu_seqlens, max_seqlen, self.backend, self.num_threads,
                                      self.save_branch_outputs)
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
        if cache is None:
            out = self._prefill(x, cu_seqlens, max_seqlen)
        else:
            out = self._with_cache(x, cu_seqlens, cache)
        return out.view(B, S, self.hidden_size) if batched else out

    def _prefill(self, x: Tensor, cu_seqlens, max_seqlen) -> Tensor:
        T = x.shape[0]
        if cu_seqlens is None:
            positions = torch.arange(T, device=x.device)
        else:
            cu = torch.as_tensor(cu_seqlens).to(device=x.device, dtype=torch.int64)
            lengths = cu[1:] - cu[:-1]
            starts = torch.repeat_interleave(cu[:-1], lengths, output_size=T)
            positions = torch.arange(T, device=x.device) - starts
        q, ks, vs, g = self._project(x, positions)
        o = self._attend(q, ks, vs, g, cu_seqlens, max_seqlen)
        return self.o_proj(o.reshape(T, self.num_heads * self.v_head_dim))

    def _with_cache(self, x: Tensor, cu_seqlens, cache: NSACache) -> Tensor:
        # Decode: append the new tokens to the cache, recompute each whole cached sequence and keep
        # the new rows (NSACache's docstring says why and what replaces it).
        T = x.shape[0]
        cu = [0, T] if cu_seqlens is None else [int(c) for c in torch.as_tensor(cu_seqlens).tolist()]
        if cu[0] != 0 or cu[-1] != T:
            raise error("cu_seqlens", cu, f"must run from 0 to the number of new tokens T = {T}")
        if len(cu) - 1 < len(cache):
            raise error("cu_seqlens", f"{len(cu) - 1} sequences",
                        f"must cover every cached sequence ({len(cache)}); give a 0-length entry for idle ones")
        cached = [cache.seq_len(b) for b in range(len(cu) - 1)]
        positions = torch.cat([torch.arange(cached[b], cached[b] + cu[b + 1] - cu[b], device=x.device)
                               for b in range(len(cu) - 1)]) if T else torch.zeros(0, dtype=torch.int64, device=x.device)
        q, ks, vs, g = self._project(x, positions)
        full_q, full_g, full_k, full_v, full_cu, rows = [], [], [[] for _ in ks], [[] for _ in vs], [0], []
        for b in range(len(cu) - 1):
            new = slice(cu[b], cu[b + 1])
            cache.append(b, [k[new] for k in ks], [v[new] for v in vs])
            total = cache.seq_len(b)
            old = total - (cu[b + 1] - cu[b])
            # Rows of the cached tokens get zero queries and gates: their outputs are dropped.
            full_q += [q.new_zeros((old, *q.shape[1:])), q[new]]
            full_g += [g.new_zeros((old, *g.shape[1:])), g[new]]
            for i in range(len(ks)):
                full_k[i].append(cache.keys[b][i])
                full_v[i].append(cache.values[b][i])
            rows.append(torch.arange(full_cu[-1] + old, full_cu[-1] + total, device=x.device))
            full_cu.append(full_cu[-1] + total)
        o = self._attend(torch.cat(full_q), [torch.cat(k) for k in full_k], [torch.cat(v) for v in full_v],
                         torch.cat(full_g), torch.tensor(full_cu, dtype=torch.int32), None)
        o = o[torch.cat(rows)] if rows else o[:0]
        return self.o_proj(o.reshape(T, self.num_heads * self.v_head_dim))
