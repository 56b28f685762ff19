"""PyTorch operators of nsa: ``torch.ops.nsa.*``, with autograd and fake-tensor implementations.

The operators are registered with ``torch.library.custom_op``, so ``torch.compile`` treats each
one as an opaque node (their fake implementations give it the output shapes), and autograd
uses the library's own backward through ``register_autograd``:

  nsa::forward / nsa::backward                     the whole layer (spec §2-§8)
  nsa::compress / nsa::compress_backward           phi over blocks (spec §2)
  nsa::dense_attention / nsa::dense_attention_backward   the dense baseline
  nsa::compressed_attention, nsa::select_topn, nsa::selected_attention, nsa::window_attention
                                                   forward-only stages (the library has no
                                                   per-stage backward; use nsa::forward to train)
  nsa::rotary                                      rotary position embeddings (GPT-NeoX layout),
                                                   out of place; its backward is nsa::rotary with
                                                   inverse flipped (the rotation's transpose)
  nsa::rotary_into                                 the same into a given (strided) output, no autograd

Outputs and workspaces are allocated with torch on the inputs' device (the caching allocator on
CUDA) and the library runs on ``torch.cuda.current_stream()``. Config travels as a list of 7
integers (l, d, l', n, n_init, n_local, w) plus the float scale, which is what an operator
schema can carry. Absent optional tensors are None; an absent gradient is an empty tensor.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _arrays, _core
from ._core import Config, Phi

_fw = _arrays.TorchArrays()

# The differentiable inputs of nsa::forward, in schema order (18): q, six K/V, g, phi_k, phi_v.
_N_KV = 6
_N_PHI = 5


def _phi(w1, b1, w2, b2, pe) -> Optional[Phi]:
    p = Phi(w1, b1, w2, b2, pe)
    return None if all(x is None for x in p) else p


def _phi_args(phi: Optional[Phi]) -> list:
    return [None] * _N_PHI if phi is None else list(phi)


def _empty_grad(like: Tensor) -> Tensor:
    # A custom operator cannot return None: an absent gradient is an empty tensor.
    return like.new_empty((0,))


def _cfg(config: List[int], scale: float) -> Config:
    return Config.from_ints(config, scale)


def _attention_fake(q, k, v, *rest):
    # The fake of an attention over (q, k, v): o [T, Hq, Dv], lse [T, Hq] f32.
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2])), q.new_empty(q.shape[:2], dtype=torch.float32)


# ---- nsa::forward / nsa::backward ---------------------------------------------------------------


@torch.library.custom_op("nsa::forward", mutates_args=())
def forward_op(
    q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_slc: Optional[Tensor], v_slc: Optional[Tensor],
    k_win: Optional[Tensor], v_win: Optional[Tensor], g: Tensor,
    phi_k_w1: Optional[Tensor], phi_k_b1: Optional[Tensor], phi_k_w2: Optional[Tensor],
    phi_k_b2: Optional[Tensor], phi_k_pe: Optional[Tensor],
    phi_v_w1: Optional[Tensor], phi_v_b1: Optional[Tensor], phi_v_w2: Optional[Tensor],
    phi_v_b2: Optional[Tensor], phi_v_pe: Optional[Tensor],
    cu_seqlens: Optional[Tensor], max_seqlen: int, config: List[int], scale: float, backend: str,
    num_threads: int, save_branches: bool, cu_seqlens_q: Optional[Tensor] = None, max_seqlen_q: int = 0,
    save_cmp: bool = False, save_win: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """o [Tq, Hq, Dv], lse [Tq, Hq, 3] f32, indices [Tq, Hkv, n] int32, and what is kept for the
    backward (_kept_shape): o_branch [3, Tq, Hq, Dv] (each branch's output) if save_branches, else
    the outputs of the compressed branch (save_cmp) and of the window branch (save_win) in that
    order, [Tq, Hq, Dv] for one and [2, Tq, Hq, Dv] for both, else an empty tensor. Tq = T (k's
    rows) unless cu_seqlens_q gives a query packing (each sequence's last positions)."""
    kept_shape = _kept_shape(q, v_cmp, save_branches, save_cmp, save_win)
    kept = None if save_branches else q.new_empty(kept_shape)
    o_cmp, o_win = _kept_planes(kept, save_branches, save_cmp, save_win)
    r = _core.forward(_fw, _cfg(config, scale), q, (k_cmp, v_cmp, k_slc, v_slc, k_win, v_win), g,
                      _phi(phi_k_w1, phi_k_b1, phi_k_w2, phi_k_b2, phi_k_pe),
                      _phi(phi_v_w1, phi_v_b1, phi_v_w2, phi_v_b2, phi_v_pe),
                      cu_seqlens, max_seqlen, backend, num_threads, branches=save_branches,
                      cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, o_cmp=o_cmp, o_win=o_win)
    return r.o, r.lse, r.indices, r.o_branch if save_branches else kept


def _kept_shape(q, v_cmp, save_branches, save_cmp, save_win=False):
    """The shape of nsa::forward's fourth output (what the backward reads besides o)."""
    T, Hq, Dv = q.shape[0], q.shape[1], v_cmp.shape[2]
    if save_branches:
        return (3, T, Hq, Dv)
    planes = int(bool(save_cmp)) + int(bool(save_win))
    return (0,) if planes == 0 else (T, Hq, Dv) if planes == 1 else (2, T, Hq, Dv)


def _kept_planes(kept, save_branches, save_cmp, save_win):
    """(o_cmp, o_win) of nsa::forward's fourth output without save_branches: views of it, or None."""
    if save_branches or not (save_cmp or save_win):
        return None, None
    if save_cmp and save_win:
        return kept[0], kept[1]
    return (kept, None) if save_cmp else (None, kept)


@forward_op.register_fake
def _forward_fake(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, g, *rest):
    config, save_branches = rest[2 * _N_PHI + 2], rest[2 * _N_PHI + 6]
    save_cmp = rest[2 * _N_PHI + 9] if len(rest) > 2 * _N_PHI + 9 else False
    save_win = rest[2 * _N_PHI + 10] if len(rest) > 2 * _N_PHI + 10 else False
    T, Hq, Dv = q.shape[0], q.shape[1], v_cmp.shape[2]
    return (q.new_empty((T, Hq, Dv)), q.new_empty((T, Hq, 3), dtype=torch.float32),
            q.new_empty((T, k_cmp.shape[1], config[3]), dtype=torch.int32),
            q.new_empty(_kept_shape(q, v_cmp, save_branches, save_cmp, save_win)))


@torch.library.custom_op("nsa::backward", mutates_args=())
def backward_op(
    q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_slc: Optional[Tensor], v_slc: Optional[Tensor],
    k_win: Optional[Tensor], v_win: Optional[Tensor], g: Tensor,
    phi_k_w1: Optional[Tensor], phi_k_b1: Optional[Tensor], phi_k_w2: Optional[Tensor],
    phi_k_b2: Optional[Tensor], phi_k_pe: Optional[Tensor],
    phi_v_w1: Optional[Tensor], phi_v_b1: Optional[Tensor], phi_v_w2: Optional[Tensor],
    phi_v_b2: Optional[Tensor], phi_v_pe: Optional[Tensor],
    cu_seqlens: Optional[Tensor], max_seqlen: int, config: List[int], scale: float, backend: str,
    num_threads: int, lse: Tensor, indices: Tensor, o_branch: Optional[Tensor], d_o: Tensor,
    o: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None, max_seqlen_q: int = 0,
    o_cmp: Optional[Tensor] = None, o_win: Optional[Tensor] = None,
) -> List[Tensor]:
    """The 18 gradients in the order of nsa::forward's tensor inputs; empty where an input was None
    (shared K/V: the sum over branches is in dk_cmp, dv_cmp). o_branch: the forward's kept branch
    outputs, or None (the CUDA backward then recomputes them; with the forward's output o it
    recomputes only the compressed and window branches, and neither of those it is given as o_cmp
    or o_win)."""
    phi_k = _phi(phi_k_w1, phi_k_b1, phi_k_w2, phi_k_b2, phi_k_pe)
    phi_v = _phi(phi_v_w1, phi_v_b1, phi_v_w2, phi_v_b2, phi_v_pe)
    r = _core.backward(_fw, _cfg(config, scale), q, (k_cmp, v_cmp, k_slc, v_slc, k_win, v_win), g, phi_k,
                       phi_v, lse, indices, d_o, cu_seqlens, max_seqlen, backend, num_threads, o_branch=o_branch,
                       o=o, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, o_cmp=o_cmp, o_win=o_win)
    grads = [r.dq, *r.dkv, r.dg, *_phi_args(r.dphi_k), *_phi_args(r.dphi_v)]
    return [x if x is not None else _empty_grad(q) for x in grads]


@backward_op.register_fake
def _backward_fake(*args):
    inputs = args[: 8 + 2 * _N_PHI]
    q = inputs[0]
    return [q.new_empty(x.shape) if x is not None else _empty_grad(q) for x in inputs]


# nsa::forward's inputs after the differentiable tensors and cu_seqlens: max_seqlen, config,
# scale, backend, num_threads (the backward's statics), save_branches, cu_seqlens_q, max_seqlen_q,
# save_cmp, save_win.
_N_TENSORS = 8 + 2 * _N_PHI + 1


def _forward_setup(ctx, inputs, output):
    inputs = list(inputs) + [None, 0, False, False][len(inputs) - _N_TENSORS - 6:]  # defaults of the last four
    tensors = inputs[:_N_TENSORS]  # the differentiable inputs and cu_seqlens
    ctx.present = [x is not None for x in tensors]
    ctx.statics = inputs[_N_TENSORS:_N_TENSORS + 5]
    cu_seqlens_q, ctx.max_seqlen_q = inputs[_N_TENSORS + 6], inputs[_N_TENSORS + 7]
    ctx.kept = (inputs[_N_TENSORS + 5], inputs[_N_TENSORS + 8], inputs[_N_TENSORS + 9])  # branches, cmp, win
    o, lse, indices, kept = output
    ctx.mark_non_differentiable(lse, indices, kept)
    # No zero-filled gradients for the outputs that get none (autograd's default): lse, indices and
    # the kept branch outputs never do, and o_branch is 3x the output (a zero tensor that size
    # would be made and freed on every backward).
    ctx.set_materialize_grads(False)
    # o too (the layer's output, alive anyway): without o_branch the CUDA backward takes the
    # selection branch's part from it instead of recomputing that branch.
    ctx.save_for_backward(*tensors, lse, indices, kept, o, cu_seqlens_q)


def _forward_backward(ctx, d_o, _d_lse, _d_indices, _d_kept):
    n_grad = 8 + 2 * _N_PHI
    if d_o is None:  # no gradient reached o (gradcheck's undefined-gradient check does this)
        out = [None] * n_grad
    else:
        saved = ctx.saved_tensors
        tensors, (lse, indices, kept, o, cu_seqlens_q) = saved[:-5], saved[-5:]
        # (what forward_op kept: o_branch [3, T, Hq, Dv], o_cmp and / or o_win, or nothing)
        save_branches, save_cmp, save_win = ctx.kept
        o_branch = kept if save_branches else None
        o_cmp, o_win = _kept_planes(kept, save_branches, save_cmp, save_win)
        grads = torch.ops.nsa.backward(*tensors, *ctx.statics, lse, indices, o_branch, d_o.contiguous(), o,
                                       cu_seqlens_q, ctx.max_seqlen_q, o_cmp, o_win)
        out = [grad if present else None for grad, present in zip(grads, ctx.present[:n_grad])]
    # cu_seqlens, the 6 statics, cu_seqlens_q, max_seqlen_q, save_cmp and save_win get none
    return (*out, None, None, None, None, None, None, None, None, None, None, None)


forward_op.register_autograd(_forward_backward, setup_context=_forward_setup)


# ---- nsa::compress ----------------------------------------------------------------------------


@torch.library.custom_op("nsa::compress", mutates_args=())
def compress_op(
    x: Tensor, w1: Optional[Tensor], b1: Optional[Tensor], w2: Optional[Tensor], b2: Optional[Tensor],
    pe: Optional[Tensor], cu_seqlens: Optional[Tensor], max_seqlen: int, config: List[int], backend: str,
    num_threads: int,
) -> Tensor:
    """xc [T // d, Hkv, D]; rows no compressed block uses are zero."""
    return _core.compress(_fw, _cfg(config, 0.0), _phi(w1, b1, w2, b2, pe), x, cu_seqlens, max_seqlen,
                          backend, num_threads)


@compress_op.register_fake
def _compress_fake(x, w1, b1, w2, b2, pe, cu_seqlens, max_seqlen, config, backend, num_threads):
    return x.new_empty((x.shape[0] // config[1], x.shape[1], x.shape[2]))


@torch.library.custom_op("nsa::compress_backward", mutates_args=())
def compress_backward_op(
    x: Tensor, w1: Optional[Tensor], b1: Optional[Tensor], w2: Optional[Tensor], b2: Optional[Tensor],
    pe: Optional[Tensor], cu_seqlens: Optional[Tensor], max_seqlen: int, config: List[int], backend: str,
    num_threads: int, dxc: Tensor,
) -> List[Tensor]:
    """[dx, dw1, db1, dw2, db2, dpe], empty where a parameter was None."""
    dx, dphi = _core.compress_backward(_fw, _cfg(config, 0.0), _phi(w1, b1, w2, b2, pe), x, dxc, cu_seqlens,
                                       max_seqlen, backend, num_threads)
    return [dx] + [p if p is not None else _empty_grad(x) for p in _phi_args(dphi)]


@compress_backward_op.register_fake
def _compress_backward_fake(x, w1, b1, w2, b2, pe, *rest):
    return [x.new_empty(x.shape)] + [x.new_empty(p.shape) if p is not None else _empty_grad(x)
                                     for p in (w1, b1, w2, b2, pe)]


def _compress_setup(ctx, inputs, output):
    ctx.present = [x is not None for x in inputs[:6]]
    ctx.statics = inputs[7:]
    ctx.save_for_backward(*inputs[:7])


def _compress_backward(ctx, dxc):
    saved = ctx.saved_tensors
    grads = torch.ops.nsa.compress_backward(*saved, *ctx.statics, dxc.contiguous())
    out = [grad if present else None for grad, present in zip(grads, ctx.present)]
    return (*out, None, None, None, None, None)


compress_op.register_autograd(_compress_backward, setup_context=_compress_setup)


# ---- nsa::dense_attention ---------------------------------------------------------------------


@torch.library.custom_op("nsa::dense_attention", mutates_args=())
def dense_attention_op(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Optional[Tensor], max_seqlen: int, scale: float,
    backend: str, num_threads: int,
) -> Tuple[Tensor, Tensor]:
    """o [T, Hq, Dv], lse [T, Hq] f32."""
    return _core.dense_attention(_fw, scale, q, k, v, cu_seqlens, max_seqlen, backend, num_threads)


dense_attention_op.register_fake(_attention_fake)


@torch.library.custom_op("nsa::dense_attention_backward", mutates_args=())
def dense_attention_backward_op(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, d_o: Tensor, cu_seqlens: Optional[Tensor],
    max_seqlen: int, scale: float, backend: str, num_threads: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    return _core.dense_attention_backward(_fw, scale, q, k, v, o, lse, d_o, cu_seqlens, max_seqlen, backend,
                                          num_threads)


@dense_attention_backward_op.register_fake
def _dense_backward_fake(q, k, v, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _dense_setup(ctx, inputs, output):
    q, k, v, cu_seqlens = inputs[:4]
    o, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # lse gets no gradient: no zero tensor for it
    ctx.statics = inputs[4:]
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)


def _dense_backward(ctx, d_o, _d_lse):
    dq = dk = dv = None  # when no gradient reached o
    if d_o is not None:
        q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
        max_seqlen, scale, backend, num_threads = ctx.statics
        dq, dk, dv = torch.ops.nsa.dense_attention_backward(q, k, v, o, lse, d_o.contiguous(), cu_seqlens,
                                                            max_seqlen, scale, backend, num_threads)
    return dq, dk, dv, None, None, None, None, None


dense_attention_op.register_autograd(_dense_backward, setup_context=_dense_setup)


# ---- Forward-only stages ----------------------------------------------------------------------


@torch.library.custom_op("nsa::compressed_attention", mutates_args=())
def compressed_attention_op(
    q: Tensor, kc: Tensor, vc: Tensor, cu_seqlens: Optional[Tensor], max_seqlen: int, config: List[int],
    scale: float, scores: bool, backend: str, num_threads: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    """o [T, Hq, Dv], lse [T, Hq] f32, S [T, Hkv, ceil(max_seqlen / l')] f32 (empty without scores).
    max_seqlen must be the real value here (it sets S's width)."""
    o, lse, s = _core.compressed_attention(_fw, _cfg(config, scale), q, kc, vc, cu_seqlens, max_seqlen, scores,
                                           backend, num_threads)
    return o, lse, s if s is not None else _empty_grad(lse)


@compressed_attention_op.register_fake
def _compressed_attention_fake(q, kc, vc, cu_seqlens, max_seqlen, config, scale, scores, *rest):
    T, Hq = q.shape[0], q.shape[1]
    o = q.new_empty((T, Hq, vc.shape[2]))
    lse = q.new_empty((T, Hq), dtype=torch.float32)
    ns = -(-torch.sym_min(max_seqlen, T) // config[2])  # a declared bound above T counts as T
    s = q.new_empty((T, kc.shape[1], ns) if scores else (0,), dtype=torch.float32)
    return o, lse, s


@torch.library.custom_op("nsa::select_topn", mutates_args=())
def select_topn_op(
    scores: Tensor, cu_seqlens: Optional[Tensor], max_seqlen: int, config: List[int], backend: str,
    num_threads: int,
) -> Tensor:
    return _core.select_topn(_fw, _cfg(config, 0.0), scores, cu_seqlens, max_seqlen, backend, num_threads)


@select_topn_op.register_fake
def _select_topn_fake(scores, cu_seqlens, max_seqlen, config, *rest):
    return scores.new_empty((scores.shape[0], scores.shape[1], config[3]), dtype=torch.int32)


@torch.library.custom_op("nsa::selected_attention", mutates_args=())
def selected_attention_op(
    q: Tensor, k: Tensor, v: Tensor, indices: Tensor, cu_seqlens: Optional[Tensor], max_seqlen: int,
    config: List[int], scale: float, backend: str, num_threads: int,
) -> Tuple[Tensor, Tensor]:
    return _core.selected_attention(_fw, _cfg(config, scale), q, k, v, indices, cu_seqlens, max_seqlen, backend,
                                    num_threads)


selected_attention_op.register_fake(_attention_fake)


@torch.library.custom_op("nsa::window_attention", mutates_args=())
def window_attention_op(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Optional[Tensor], max_seqlen: int, config: List[int],
    scale: float, backend: str, num_threads: int,
) -> Tuple[Tensor, Tensor]:
    return _core.window_attention(_fw, _cfg(config, scale), q, k, v, cu_seqlens, max_seqlen, backend,
                                  num_threads)


window_attention_op.register_fake(_attention_fake)


# ---- nsa::rotary ------------------------------------------------------------------------------


@torch.library.custom_op("nsa::rotary", mutates_args=())
def rotary_op(
    x: Tensor, inv_freq: Tensor, cu_seqlens: Optional[Tensor], positions: Optional[Tensor], inverse: bool,
    backend: str, num_threads: int,
) -> Tensor:
    """x [T, H, D] rotated by each token's angles float(pos) * inv_freq [D/2] f32 (pairs (i, i + D/2));
    pos = positions [T] int32, or the token's place in its sequence of cu_seqlens. inverse: rotate
    back. A new tensor; inv_freq, positions and cu_seqlens get no gradient."""
    return _core.rotary(_fw, x, inv_freq, positions, cu_seqlens, 0, inverse, backend, num_threads)


@rotary_op.register_fake
def _rotary_fake(x, *rest):
    return x.new_empty(x.shape)


def _rotary_setup(ctx, inputs, output):
    x, inv_freq, cu_seqlens, positions, inverse, backend, num_threads = inputs
    ctx.save_for_backward(inv_freq, cu_seqlens, positions)
    ctx.statics = (inverse, backend, num_threads)


def _rotary_backward(ctx, d_out):
    # The rotation is orthogonal: its gradient is the rotation by -angle, the same kernel.
    inv_freq, cu_seqlens, positions = ctx.saved_tensors
    inverse, backend, num_threads = ctx.statics
    dx = torch.ops.nsa.rotary(d_out, inv_freq, cu_seqlens, positions, not inverse, backend, num_threads)
    return dx, None, None, None, None, None, None


rotary_op.register_autograd(_rotary_backward, setup_context=_rotary_setup)


@torch.library.custom_op("nsa::rotary_into", mutates_args=("out",))
def rotary_into_op(
    x: Tensor, inv_freq: Tensor, cu_seqlens: Optional[Tensor], positions: Optional[Tensor], inverse: bool,
    backend: str, num_threads: int, out: Tensor,
) -> None:
    """nsa::rotary written into out [T, H, D] (any strides: e.g. columns of a wider array; x itself or
    no memory shared with it). Not differentiable (the layer's backward writes gradients with it)."""
    _core.rotary(_fw, x, inv_freq, positions, cu_seqlens, 0, inverse, backend, num_threads, out=out)


@rotary_into_op.register_fake
def _rotary_into_fake(*args):
    return None


# ---- Python wrappers (what nsa.functional calls for torch tensors) -------------------------------


def _scale(scale) -> float:
    return _core.check_float(scale, "scale")


def _cache_bound(max_cache_len) -> int:
    return _core.check_int(max_cache_len or 0, "pages.max_seqlen", 0)


def sequences(cu_seqlens, max_seqlen, like: Tensor):
    """cu_seqlens as an int32 tensor on like's device, and max_seqlen (0: the library derives it).

    Host offsets for device inputs are read here (no device sync) and then copied over, so that
    the library, which never syncs to read device offsets, gets max_seqlen."""
    if cu_seqlens is None:
        return None, _core.check_int(max_seqlen or 0, "seqs.max_seqlen", 0)
    if not isinstance(cu_seqlens, Tensor):
        cu_seqlens = torch.as_tensor(cu_seqlens)
    if cu_seqlens.is_floating_point():
        raise _core.error("cu_seqlens.dtype", str(cu_seqlens.dtype), "must be an integer type")
    _arrays.check_device_offsets(cu_seqlens)
    ms = _core.check_int(max_seqlen or 0, "seqs.max_seqlen", 0)
    if cu_seqlens.dtype != torch.int32:
        cu_seqlens = _arrays.torch_offsets_to_int32(cu_seqlens)
    if cu_seqlens.device != like.device:
        if cu_seqlens.device.type == "cpu" and not ms and cu_seqlens.numel() > 1:
            ms = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        cu_seqlens = cu_seqlens.to(like.device)
    return cu_seqlens, ms


def same_device(like: Tensor, like_name: str, **named) -> None:
    """Every tensor in named (tensors, tuples of them or Phi; None skipped) on like's device: a
    named error otherwise (with a meta tensor among real ones the dispatcher would run the fake
    implementation and return uninitialised memory)."""
    for name, value in named.items():
        items = value if isinstance(value, tuple) else (value,)
        fields = getattr(value, "_fields", None)
        for i, t in enumerate(items):
            if isinstance(t, Tensor) and t.device != like.device:
                label = f"{name}.{fields[i]}" if fields else (f"{name}[{i}]" if len(items) > 1 else name)
                raise _core.error(f"{label}.device", str(t.device), f"must be {like.device} ({like_name}'s device)")


_KV6 = ("k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win")


def rotary(x, inv_freq, positions=None, cu_seqlens=None, inverse=False, backend="auto", num_threads=0):
    """nsa::rotary with its arguments checked and placed: positions of any integer dtype on the host
    (range-checked) or int32 on x's device; host offsets copied to x's device (they need no
    max_seqlen here)."""
    positions = None if positions is None else _fw.to_positions(positions, x)
    same_device(x, "x", inv_freq=inv_freq, positions=positions)
    cu, _ = sequences(cu_seqlens, None, x)
    return torch.ops.nsa.rotary(x, inv_freq, cu, positions, bool(inverse), backend, _core.threads(num_threads))


def attention(q, kv6, g, phi_k, phi_v, cfg: Config, cu_seqlens, max_seqlen, backend, num_threads,
              save_branches: bool = False, cu_seqlens_q=None, max_seqlen_q=None, save_cmp: bool = False,
              save_win: bool = False):
    """(o, lse, indices); save_branches keeps each branch's output for the backward, save_cmp the
    compressed branch's and save_win the window branch's (see nsa.attention's save_branch_outputs,
    save_cmp_output and save_win_output): only when autograd records, since nothing else reads
    them, and o_cmp / o_win only on CUDA, whose backward alone reads them. cu_seqlens_q: the query
    packing (None: every position is a query)."""
    same_device(q, "q", g=g, phi_k=phi_k, phi_v=phi_v, **dict(zip(_KV6, kv6)))
    cu, ms = sequences(cu_seqlens, max_seqlen, q)
    save = bool(save_branches) and torch.is_grad_enabled()
    save_cmp = bool(save_cmp) and not save and torch.is_grad_enabled() and q.is_cuda
    save_win = bool(save_win) and not save and torch.is_grad_enabled() and q.is_cuda
    if cu_seqlens_q is None:
        cu_q, ms_q = None, _core.check_int(max_seqlen_q or 0, "seqs_q.max_seqlen", 0)
    else:
        cu_q, ms_q = sequences(cu_seqlens_q, max_seqlen_q, q)
    o, lse, idx, _ = torch.ops.nsa.forward(q, *kv6, g, *_phi_args(phi_k), *_phi_args(phi_v), cu, ms, cfg.ints(),
                                           _scale(cfg.scale), backend, _core.threads(num_threads), save, cu_q, ms_q,
                                           save_cmp, save_win)
    return o, lse, idx


def compress(x, phi, cfg: Config, cu_seqlens, max_seqlen, backend, num_threads):
    same_device(x, "x", phi=phi)
    cu, ms = sequences(cu_seqlens, max_seqlen, x)
    return torch.ops.nsa.compress(x, *_phi_args(phi), cu, ms, cfg.ints(), backend, _core.threads(num_threads))


def dense_attention(q, k, v, scale, cu_seqlens, max_seqlen, backend, num_threads):
    same_device(q, "q", k=k, v=v)
    cu, ms = sequences(cu_seqlens, max_seqlen, q)
    return torch.ops.nsa.dense_attention(q, k, v, cu, ms, _scale(scale), backend, _core.threads(num_threads))


def compressed_attention(q, kc, vc, cfg: Config, cu_seqlens, max_seqlen, scores, backend, num_threads):
    same_device(q, "q", kc=kc, vc=vc)
    cu, ms = sequences(cu_seqlens, max_seqlen, q)
    if not ms:  # S's width depends on it; read host offsets (or T for one sequence)
        if cu is None:
            ms = int(q.shape[0])
        elif cu.device.type == "cpu":
            ms = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
        else:
            raise _core.error("max_seqlen", 0, "must be given (>= the longest sequence) when cu_seqlens is on the GPU")
    o, lse, s = torch.ops.nsa.compressed_attention(q, kc, vc, cu, ms, cfg.ints(), _scale(cfg.scale), bool(scores),
                                                   backend, _core.threads(num_threads))
    return o, lse, (s if scores else None)


def select_topn(scores, cfg: Config, cu_seqlens, max_seqlen, backend, num_threads):
    cu, ms = sequences(cu_seqlens, max_seqlen, scores)
    return torch.ops.nsa.select_topn(scores, cu, ms, cfg.ints(), backend, _core.threads(num_threads))


def selected_attention(q, k, v, indices, cfg: Config, cu_seqlens, max_seqlen, backend, num_threads):
    same_device(q, "q", k=k, v=v, indices=indices)
    cu, ms = sequences(cu_seqlens, max_seqlen, q)
    return torch.ops.nsa.selected_attention(q, k, v, indices, cu, ms, cfg.ints(), _scale(cfg.scale), backend,
                                            _core.threads(num_threads))


def window_attention(q, k, v, cfg: Config, cu_seqlens, max_seqlen, backend, num_threads):
    same_device(q, "q", k=k, v=v)
    cu, ms = sequences(cu_seqlens, max_seqlen, q)
    return torch.ops.nsa.window_attention(q, k, v, cu, ms, cfg.ints(), _scale(cfg.scale), backend,
                                          _core.threads(num_threads))


# ---- Decoding: nsa::cache_append, nsa::decode, nsa::dense_decode ------------------------------------
#
# The cache's pools are arguments the operators mutate (so torch.compile orders them and CUDA
# graphs capture them); a pool that shared K/V does not have is an empty tensor.

_POOLS = ("k_cmp_pages", "v_cmp_pages", "k_slc_pages", "v_slc_pages", "k_win_pages", "v_win_pages", "kc_pages",
          "vc_pages")


def _cache(pools, block_table, seq_lens, status, max_cache_len) -> _core.CacheArrays:
    return _core.CacheArrays(tuple(p if p.numel() > 0 else None for p in pools), block_table, seq_lens, status,
                             max_cache_len)


@torch.library.custom_op("nsa::cache_append", mutates_args=_POOLS + ("status",))
def cache_append_op(
    k_cmp_pages: Tensor, v_cmp_pages: Tensor, k_slc_pages: Tensor, v_slc_pages: Tensor, k_win_pages: Tensor,
    v_win_pages: Tensor, kc_pages: Tensor, vc_pages: Tensor, block_table: Tensor, seq_lens: Tensor, status: Tensor,
    max_cache_len: int, k_cmp: Tensor, v_cmp: Tensor, k_slc: Optional[Tensor], v_slc: Optional[Tensor],
    k_win: Optional[Tensor], v_win: Optional[Tensor],
    phi_k_w1: Optional[Tensor], phi_k_b1: Optional[Tensor], phi_k_w2: Optional[Tensor],
    phi_k_b2: Optional[Tensor], phi_k_pe: Optional[Tensor],
    phi_v_w1: Optional[Tensor], phi_v_b1: Optional[Tensor], phi_v_w2: Optional[Tensor],
    phi_v_b2: Optional[Tensor], phi_v_pe: Optional[Tensor],
    cu_seqlens: Optional[Tensor], max_new: int, config: List[int], backend: str, num_threads: int,
) -> None:
    """Appends the new tokens (k_cmp .. v_win [Tn, Hkv, D]) to the paged cache (spec §10)."""
    pools = (k_cmp_pages, v_cmp_pages, k_slc_pages, v_slc_pages, k_win_pages, v_win_pages, kc_pages, vc_pages)
    _core.cache_append(_fw, _cfg(config, 0.0), _cache(pools, block_table, seq_lens, status, max_cache_len),
                       (k_cmp, v_cmp, k_slc, v_slc, k_win, v_win),
                       _phi(phi_k_w1, phi_k_b1, phi_k_w2, phi_k_b2, phi_k_pe),
                       _phi(phi_v_w1, phi_v_b1, phi_v_w2, phi_v_b2, phi_v_pe), cu_seqlens, max_new, backend,
                       num_threads)


@cache_append_op.register_fake
def _cache_append_fake(*args):
    return None


@torch.library.custom_op("nsa::decode", mutates_args=("status",))
def decode_op(
    q: Tensor, g: Tensor, k_cmp_pages: Tensor, v_cmp_pages: Tensor, k_slc_pages: Tensor, v_slc_pages: Tensor,
    k_win_pages: Tensor, v_win_pages: Tensor, kc_pages: Tensor, vc_pages: Tensor, block_table: Tensor,
    seq_lens: Tensor, status: Tensor, max_cache_len: int, cu_seqlens: Optional[Tensor], max_new: int,
    config: List[int], scale: float, shared_kv: bool, backend: str, num_threads: int, branches: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """o [Tq, Hq, Dv], lse [Tq, Hq, 3] f32, indices [Tq, Hkv, n] int32 and o_branch [3, Tq, Hq, Dv]
    (empty unless branches) of the queries at the end of their sequences."""
    pools = (k_cmp_pages, v_cmp_pages, k_slc_pages, v_slc_pages, k_win_pages, v_win_pages, kc_pages, vc_pages)
    r = _core.decode(_fw, _cfg(config, scale), _cache(pools, block_table, seq_lens, status, max_cache_len), q, g,
                     cu_seqlens, max_new, shared_kv, backend, num_threads, branches)
    return r.o, r.lse, r.indices, (r.o_branch if branches else q.new_empty((0,)))


@decode_op.register_fake
def _decode_fake(q, g, k_cmp_pages, v_cmp_pages, *rest):
    config, branches = rest[-6], rest[-1]
    T, Hq, Dv = q.shape[0], q.shape[1], v_cmp_pages.shape[3]
    return (q.new_empty((T, Hq, Dv)), q.new_empty((T, Hq, 3), dtype=torch.float32),
            q.new_empty((T, k_cmp_pages.shape[2], config[3]), dtype=torch.int32),
            q.new_empty((3, T, Hq, Dv) if branches else (0,)))


@torch.library.custom_op("nsa::dense_decode", mutates_args=("status",))
def dense_decode_op(
    q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, seq_lens: Tensor, status: Tensor,
    max_cache_len: int, cu_seqlens: Optional[Tensor], max_new: int, scale: float, backend: str, num_threads: int,
) -> Tuple[Tensor, Tensor]:
    """o [Tq, Hq, Dv], lse [Tq, Hq] f32: dense attention over every cached token (the baseline)."""
    return _core.dense_decode(_fw, scale, k_pages, v_pages, block_table, seq_lens, status, q, cu_seqlens, max_new,
                              max_cache_len, backend, num_threads)


@dense_decode_op.register_fake
def _dense_decode_fake(q, k_pages, v_pages, *rest):
    return q.new_empty((q.shape[0], q.shape[1], v_pages.shape[3])), q.new_empty(q.shape[:2], dtype=torch.float32)


def _pool_args(cache: _core.CacheArrays, like: Tensor) -> list:
    empty = like.new_empty((0,))
    return [p if p is not None else empty for p in cache.pools]


def cache_append(cache: _core.CacheArrays, kv6, phi_k, phi_v, cfg: Config, cu_seqlens, max_new, backend, num_threads,
                 phi: str = "mean"):
    cu, ms = sequences(cu_seqlens, max_new, kv6[0])
    torch.ops.nsa.cache_append(*_pool_args(cache, kv6[0]), cache.block_table, cache.seq_lens, cache.status,
                               _cache_bound(cache.max_cache_len), *kv6, *_phi_args(phi_k), *_phi_args(phi_v), cu, ms,
                               cfg.ints(), backend, _core.threads(num_threads))


def decode(cache: _core.CacheArrays, q, g, cfg: Config, cu_seqlens, max_new, shared_kv: bool, backend, num_threads,
           branches: bool = False):
    cu, ms = sequences(cu_seqlens, max_new, q)
    return torch.ops.nsa.decode(q, g, *_pool_args(cache, q), cache.block_table, cache.seq_lens, cache.status,
                                _cache_bound(cache.max_cache_len), cu, ms, cfg.ints(), _scale(cfg.scale),
                                bool(shared_kv), backend, _core.threads(num_threads), bool(branches))


def dense_decode(k_pages, v_pages, block_table, seq_lens, status, q, scale, cu_seqlens, max_new, max_cache_len,
                 backend, num_threads):
    cu, ms = sequences(cu_seqlens, max_new, q)
    return torch.ops.nsa.dense_decode(q, k_pages, v_pages, block_table, seq_lens, status, _cache_bound(max_cache_len),
                                      cu, ms, _scale(scale), backend, _core.threads(num_threads))
