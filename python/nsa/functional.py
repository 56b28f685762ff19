"""The functional API: NSA and its stages on numpy arrays and torch tensors.

Every function takes host or CUDA arrays of one framework and returns arrays of the same
framework on the same device. Torch tensors go through the operators of ``nsa.torch_ops``
(``torch.ops.nsa.*``), so autograd and ``torch.compile`` work where the library has a backward
(``attention``, ``compress``, ``dense_attention``, ``rotary``); the other stages are forward-only.

Shapes (spec §1; T = packed tokens of all sequences, see ``cu_seqlens``):
  q [T, Hq, Dqk]; k [T, Hkv, Dqk]; v [T, Hkv, Dv]; g [T, Hq, 3] gates (cmp, slc, win).
Common keyword arguments:
  cu_seqlens  [B+1] integer offsets of B packed sequences (None: one sequence); host offsets are
              range-checked and converted to int32, offsets on a GPU must be int32.
  max_seqlen  the longest sequence; required only when cu_seqlens is on a GPU.
  cu_seqlens_q  (attention, attention_branches, attention_backward) a query packing, FlashAttention's
              varlen convention bottom-right aligned: sequence b's queries are its LAST
              cu_seqlens_q[b+1] - cu_seqlens_q[b] positions (at most its length). q, g, d_o and the
              outputs then have cu_seqlens_q[-1] rows, k and v (and dk, dv) the keys' rows of
              cu_seqlens. Each query row equals the same position's row of the call on every
              position. None: every position is a query. max_seqlen_q: the most queries of a
              sequence (0 or None: derived). The CPU backends only.
  config      an nsa.Config (default: the paper's values); single fields may also be given as
              keywords, e.g. ``window=64``.
  backend     'auto' (CUDA for device arrays; reference for float64, else the fast CPU backend
              when it is compiled in, else reference), 'reference', 'cpu' or 'cuda'.
  num_threads CPU backends: threads to use (0: OpenMP's default). Results never depend on it.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

from . import _core
from ._arrays import arrays_for, is_torch
from ._core import Config, Phi, as_phi, make_config, split_kv


class AttentionAux(NamedTuple):
    lse: Any  # [T, Hq, 3] float32: each branch's log-sum-exp, -inf where the branch saw no key
    indices: Any  # [T, Hkv, n] int32: selected blocks per token and KV head, ascending, -1 padded


def _torch_ops():
    from . import torch_ops

    return torch_ops


def _stage(name: str, cfg: Config, arrays: tuple, *rest):
    """The forward-only stage `name` on the framework of arrays[0]: torch_ops' wrapper for torch
    tensors, else _core's call; rest: the arguments after the arrays (cu_seqlens, max_seqlen, ...)."""
    if is_torch(arrays[0]):
        return getattr(_torch_ops(), name)(*arrays, cfg, *rest)
    return getattr(_core, name)(arrays_for(arrays[0]), cfg, *arrays, *rest)


def attention(q, k, v, g, phi_k=None, phi_v=None, *, cu_seqlens=None, max_seqlen=None,
              config: Optional[Config] = None, backend: str = "auto", num_threads: int = 0,
              return_aux: bool = False, save_branch_outputs: bool = False, save_cmp_output: bool = True,
              save_win_output: bool = True, cu_seqlens_q=None, max_seqlen_q=None, **config_fields):
    """Native Sparse Attention (spec §2-§7): o [T, Hq, Dv] = sum_b g[..., b] * o_b.

    k, v: one array each, shared by the three branches, or a (cmp, slc, win) tuple each for
    independent K/V per branch (the paper's choice). phi_k, phi_v: the compression functions'
    parameters (``nsa.Phi``); None for mean pooling. With ``return_aux`` the result is
    ``(o, AttentionAux(lse, indices))``. ``save_branch_outputs`` (torch autograd only): keep each
    branch's output o_b [3, T, Hq, Dv] for the backward, which on CUDA then takes dg from it
    instead of recomputing the compressed and window branches (the CUDA backward ~13% faster at 64K,
    for three times o's memory until the backward runs). ``save_cmp_output`` (torch autograd on
    CUDA only, on by default): keep the compressed branch's output [T, Hq, Dv] for the backward,
    which then takes that branch's dg from it instead of recomputing it (o's memory until the
    backward runs); ``save_win_output`` (likewise) the same for the window branch. With both (and
    o, which the backward keeps anyway) the CUDA backward recomputes no branch output. Neither is
    needed with ``save_branch_outputs``.
    """
    cfg = make_config(config, config_fields)
    phi_k, phi_v = as_phi(phi_k, "phi_k"), as_phi(phi_v, "phi_v")
    kv6, _ = split_kv(k, v)
    if is_torch(q):
        o, lse, idx = _torch_ops().attention(q, kv6, g, phi_k, phi_v, cfg, cu_seqlens, max_seqlen,
                                              backend, num_threads, save_branch_outputs, cu_seqlens_q,
                                              max_seqlen_q, save_cmp_output, save_win_output)
    else:
        o, lse, idx, _ = _core.forward(arrays_for(q), cfg, q, kv6, g, phi_k, phi_v, cu_seqlens,
                                       max_seqlen, backend, num_threads, cu_seqlens_q=cu_seqlens_q,
                                       max_seqlen_q=max_seqlen_q)
    return (o, AttentionAux(lse, idx)) if return_aux else o


def attention_branches(q, k, v, g, phi_k=None, phi_v=None, *, cu_seqlens=None, max_seqlen=None,
                       config: Optional[Config] = None, backend: str = "auto", num_threads: int = 0,
                       cu_seqlens_q=None, max_seqlen_q=None, **config_fields):
    """Forward only, with every branch's output before gating: ``_core.ForwardResult``
    (o, lse [T, Hq, 3], indices [T, Hkv, n], o_branch [3, T, Hq, Dv]). No autograd."""
    cfg = make_config(config, config_fields)
    phi_k, phi_v = as_phi(phi_k, "phi_k"), as_phi(phi_v, "phi_v")
    kv6, _ = split_kv(k, v)
    return _core.forward(arrays_for(q), cfg, q, kv6, g, phi_k, phi_v, cu_seqlens, max_seqlen, backend,
                         num_threads, branches=True, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q)


def attention_backward(q, k, v, g, phi_k, phi_v, lse, indices, d_o, *, cu_seqlens=None, max_seqlen=None,
                       config: Optional[Config] = None, backend: str = "auto", num_threads: int = 0,
                       o_branch=None, o=None, o_cmp=None, o_win=None, cu_seqlens_q=None, max_seqlen_q=None,
                       **config_fields) -> _core.Gradients:
    """Gradients of NSA (spec §8) given what ``attention(..., return_aux=True)`` returned and
    d_o = dLoss/do [T, Hq, Dv]. Selection is a constant. Returns ``Gradients(dq, dk, dv, dg,
    dphi_k, dphi_v)`` where dk/dv are arrays (shared K/V) or (cmp, slc, win) tuples like k/v.
    o_branch: optionally the branch outputs ``attention_branches`` returned; the CUDA backend then
    takes dg from them instead of recomputing the three branches (the CPU backends ignore it).
    o: optionally the forward's output; without o_branch the CUDA backend then takes the
    selection branch's part from it instead of recomputing that branch (the CPU backends ignore it).
    o_cmp: optionally the compressed branch's output (``attention_branches``' o_branch[0]; not with
    o_branch); the CUDA backend then takes that branch's dg from it (the CPU backends ignore it).
    o_win: the same for the window branch (o_branch[2])."""
    cfg = make_config(config, config_fields)
    phi_k, phi_v = as_phi(phi_k, "phi_k"), as_phi(phi_v, "phi_v")
    kv6, shared = split_kv(k, v)
    grads = _core.backward(arrays_for(q), cfg, q, kv6, g, phi_k, phi_v, lse, indices, d_o, cu_seqlens,
                           max_seqlen, backend, num_threads, o_branch=o_branch, o=o, cu_seqlens_q=cu_seqlens_q,
                           max_seqlen_q=max_seqlen_q, o_cmp=o_cmp, o_win=o_win)
    d = grads.dkv
    dk, dv = (d[0], d[1]) if shared else ((d[0], d[2], d[4]), (d[1], d[3], d[5]))
    return Gradients(grads.dq, dk, dv, grads.dg, grads.dphi_k, grads.dphi_v)


class Gradients(NamedTuple):
    dq: Any
    dk: Any  # like k: one array (shared K/V: summed over branches) or (cmp, slc, win)
    dv: Any
    dg: Any
    dphi_k: Optional[Phi]
    dphi_v: Optional[Phi]


def compress(x, phi=None, *, cu_seqlens=None, max_seqlen=None, config: Optional[Config] = None,
             backend: str = "auto", num_threads: int = 0, **config_fields):
    """Compressed keys or values (spec §2): x [T, Hkv, D] -> xc [T // d, Hkv, D].

    The sequence that starts at packed token s owns rows s // d .. s // d + N_c - 1 (blocks.h);
    rows that no block uses are zero. Differentiable for torch tensors."""
    cfg = make_config(config, config_fields)
    phi = as_phi(phi, "phi")
    if is_torch(x):
        return _torch_ops().compress(x, phi, cfg, cu_seqlens, max_seqlen, backend, num_threads)
    return _core.compress(arrays_for(x), cfg, phi, x, cu_seqlens, max_seqlen, backend, num_threads)


def compress_backward(x, phi, dxc, *, cu_seqlens=None, max_seqlen=None, config: Optional[Config] = None,
                      backend: str = "auto", num_threads: int = 0, **config_fields):
    """(dx [T, Hkv, D], dphi) of ``compress`` given dxc [T // d, Hkv, D]; dphi is None for mean."""
    cfg = make_config(config, config_fields)
    phi = as_phi(phi, "phi")
    return _core.compress_backward(arrays_for(x), cfg, phi, x, dxc, cu_seqlens, max_seqlen, backend,
                                   num_threads)


def compressed_attention(q, kc, vc, *, cu_seqlens=None, max_seqlen=None, scores: bool = True,
                         config: Optional[Config] = None, backend: str = "auto", num_threads: int = 0,
                         **config_fields):
    """Compression branch and selection scores (spec §2-§3): q [T, Hq, Dqk] against the
    compressed kc [T // d, Hkv, Dqk], vc [T // d, Hkv, Dv] (as ``compress`` lays them out).
    Returns (o [T, Hq, Dv], lse [T, Hq] f32, S [T, Hkv, ceil(max_seqlen / l')] f32 or None)."""
    return _stage("compressed_attention", make_config(config, config_fields), (q, kc, vc), cu_seqlens, max_seqlen,
                  scores, backend, num_threads)


def select_topn(scores, *, cu_seqlens=None, max_seqlen=None, config: Optional[Config] = None,
                backend: str = "auto", num_threads: int = 0, **config_fields):
    """Top-n selection (spec §4): scores [T, Hkv, Ns] f32 -> indices [T, Hkv, n] int32, ascending,
    padded with -1; forced initial and local blocks included, ties to the smaller block."""
    return _stage("select_topn", make_config(config, config_fields), (scores,), cu_seqlens, max_seqlen, backend,
                  num_threads)


def selected_attention(q, k, v, indices, *, cu_seqlens=None, max_seqlen=None, config: Optional[Config] = None,
                       backend: str = "auto", num_threads: int = 0, **config_fields):
    """Selection branch (spec §5): attention over the blocks in indices [T, Hkv, n].
    Returns (o [T, Hq, Dv], lse [T, Hq] f32)."""
    return _stage("selected_attention", make_config(config, config_fields), (q, k, v, indices), cu_seqlens,
                  max_seqlen, backend, num_threads)


def window_attention(q, k, v, *, cu_seqlens=None, max_seqlen=None, config: Optional[Config] = None,
                     backend: str = "auto", num_threads: int = 0, **config_fields):
    """Sliding-window branch (spec §6): keys max(0, t - w + 1) .. t.
    Returns (o [T, Hq, Dv], lse [T, Hq] f32)."""
    return _stage("window_attention", make_config(config, config_fields), (q, k, v), cu_seqlens, max_seqlen,
                  backend, num_threads)


def dense_attention(q, k, v, *, scale: Optional[float] = None, cu_seqlens=None, max_seqlen=None,
                    backend: str = "auto", num_threads: int = 0, return_lse: bool = False):
    """Dense causal attention with GQA, per sequence (the baseline NSA is compared with).
    scale None means 1/sqrt(Dqk). Returns o [T, Hq, Dv] (and lse [T, Hq] f32 with return_lse).
    Differentiable for torch tensors."""
    s = 0.0 if scale is None else _core.check_float(scale, "scale")
    if is_torch(q):
        o, lse = _torch_ops().dense_attention(q, k, v, s, cu_seqlens, max_seqlen, backend, num_threads)
    else:
        o, lse = _core.dense_attention(arrays_for(q), s, q, k, v, cu_seqlens, max_seqlen, backend, num_threads)
    return (o, lse) if return_lse else o


def dense_attention_backward(q, k, v, o, lse, d_o, *, scale: Optional[float] = None, cu_seqlens=None,
                             max_seqlen=None, backend: str = "auto", num_threads: int = 0):
    """(dq, dk, dv) of ``dense_attention`` given its o and lse."""
    s = 0.0 if scale is None else _core.check_float(scale, "scale")
    return _core.dense_attention_backward(arrays_for(q), s, q, k, v, o, lse, d_o, cu_seqlens, max_seqlen,
                                          backend, num_threads)


def rotary(x, inv_freq, *, positions=None, cu_seqlens=None, inverse: bool = False, backend: str = "auto",
           num_threads: int = 0):
    """Rotary position embeddings, GPT-NeoX layout (channel i pairs with i + D/2): x [T, H, D] ->
    [T, H, D], each token rotated by angle float(pos) * inv_freq[i] (inv_freq [D/2] float32), in
    float32 (float64 for float64 arrays) as ``x1 * cos - x2 * sin, x2 * cos + x1 * sin``, rounded once
    to x's dtype. pos: ``positions`` [T] (integers >= 0), else the token's place in its sequence of
    ``cu_seqlens`` (None: one sequence). ``inverse`` rotates back (the gradient). Differentiable for
    torch tensors (x only: inv_freq and the positions are constants)."""
    if is_torch(x):
        return _torch_ops().rotary(x, inv_freq, positions, cu_seqlens, inverse, backend, num_threads)
    fw = arrays_for(x)
    return _core.rotary(fw, x, inv_freq, None if positions is None else fw.to_positions(positions, x), cu_seqlens,
                        None, inverse, backend, num_threads)


# ---- Decoding (spec §10, include/nsa/cache.h) ------------------------------------------------------


def _cache_arrays(cache) -> _core.CacheArrays:
    if isinstance(cache, _core.CacheArrays):
        return cache
    if hasattr(cache, "arrays"):  # nsa.NSACache
        return cache.arrays()
    raise _core.error("cache", type(cache).__name__, "must be an nsa.CacheArrays or an nsa.NSACache")


def cache_append(cache, k, v, phi_k=None, phi_v=None, *, cu_seqlens=None, max_new=None,
                 config: Optional[Config] = None, backend: str = "auto", num_threads: int = 0, **config_fields) -> None:
    """Appends new tokens to a paged cache (``nsa.CacheArrays`` or ``nsa.NSACache``): k, v [Tn, Hkv, D]
    (one array each for shared K/V, or (cmp, slc, win) tuples), packed over the cache's B
    sequences by cu_seqlens (None: Tn / B each). cache.seq_lens must already count them. Every
    compressed block whose last token is among them is computed by phi (phi_k, phi_v as for
    ``attention``). max_new: the most new tokens of one sequence (derived unless cu_seqlens is on
    a GPU)."""
    cfg = make_config(config, config_fields)
    phi_k, phi_v = as_phi(phi_k, "phi_k"), as_phi(phi_v, "phi_v")
    kv6, _ = split_kv(k, v)
    arrays = _cache_arrays(cache)
    if is_torch(kv6[0]):
        _torch_ops().cache_append(arrays, kv6, phi_k, phi_v, cfg, cu_seqlens, max_new, backend, num_threads)
    else:
        _core.cache_append(arrays_for(kv6[0]), cfg, arrays, kv6, phi_k, phi_v, cu_seqlens, max_new, backend,
                           num_threads)


def decode(cache, q, g, *, cu_seqlens=None, max_new=None, config: Optional[Config] = None, backend: str = "auto",
           num_threads: int = 0, return_aux: bool = False, **config_fields):
    """NSA of the queries q [Tq, Hq, Dqk] at the end of the cache's sequences (their tokens
    appended), gated by g [Tq, Hq, 3]: the rows of the prefill of the whole sequences (spec §10),
    each query with its own selection. o [Tq, Hq, Dv]; with ``return_aux``, ``(o,
    AttentionAux(lse, indices))``. Not differentiable."""
    cfg = make_config(config, config_fields)
    arrays = _cache_arrays(cache)
    shared = arrays.pools[2] is None
    if is_torch(q):
        o, lse, idx, _ = _torch_ops().decode(arrays, q, g, cfg, cu_seqlens, max_new, shared, backend, num_threads)
    else:
        o, lse, idx, _ = _core.decode(arrays_for(q), cfg, arrays, q, g, cu_seqlens, max_new, shared, backend,
                                      num_threads)
    return (o, AttentionAux(lse, idx)) if return_aux else o


def dense_decode(k_pages, v_pages, block_table, seq_lens, q, *, status=None, scale: float = 0.0, cu_seqlens=None,
                 max_new=None, max_cache_len: int = 0, backend: str = "auto", num_threads: int = 0):
    """(o [Tq, Hq, Dv], lse [Tq, Hq]): dense causal attention of the queries over every cached
    token of the pools k_pages, v_pages [P, page_size, Hkv, D] (the decode baseline)."""
    if is_torch(q):
        if status is None:
            import torch

            status = torch.zeros(block_table.shape[0], dtype=torch.int32, device=q.device)
        return _torch_ops().dense_decode(k_pages, v_pages, block_table, seq_lens, status, q, scale, cu_seqlens, max_new,
                                         max_cache_len, backend, num_threads)
    return _core.dense_decode(arrays_for(q), scale, k_pages, v_pages, block_table, seq_lens, status, q, cu_seqlens,
                              max_new, max_cache_len, backend, num_threads)
