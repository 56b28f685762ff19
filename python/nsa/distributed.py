"""Context parallelism: one packed batch of long sequences split over the ranks of a
``torch.distributed`` process group, each rank computing NSA for its own queries only.

Layout (zig-zag, load-balanced): every sequence of ``cu_seqlens`` is cut into 2P chunks of
nearly equal length (chunk c covers positions ``c * L // 2P .. (c + 1) * L // 2P - 1`` of a
sequence of L tokens, so any L works, also L < 2P); rank r owns chunks r and 2P - 1 - r of every
sequence. Causal attention makes a query's cost grow with its position, so one early and one
late chunk give every rank about the same work. A rank's local tensors hold, sequence after
sequence, its first chunk's rows and then its second chunk's (``zigzag_split``).

``attention`` (a ``torch.autograd.Function`` underneath):
  forward   all-gathers the raw keys and values of every branch (all of ``cu_seqlens``' tokens),
            then calls the library once with its two chunks of each sequence as a query packing:
            chunk c of a sequence is the last len(c) queries of the sequence's prefix that ends
            with c, so each of them attends exactly as in the call on the whole sequence
            (compression, selection and window see the same keys at the same positions).
  backward  the library's backward of the same call gives dq and dg of the rank's own rows,
            and the rank's share of every key's and value's gradient and of phi's parameter
            gradients. Each rank sends every other rank that rank's rows of its key/value shares
            (one all-to-all) and adds the P pieces it receives in rank order 0 .. P-1; phi's
            shares are all-gathered and summed in the same order on every rank: a fixed order, so
            the result does not depend on timing, and every rank holds the same phi gradients.

Every rank must pass the same global ``cu_seqlens`` (host integers) and its own rows; this is
checked with an all-gather of the sizes before any other collective, so a mismatch raises the same
``nsa.Error`` on every rank instead of hanging.

Equality with one process on the whole batch: the outputs, dq and dg are the rows of the
single-process call (the library's query packing computes each query as that call does: bitwise
on the reference backend, within fp32 rounding on the cpu one, docs/api.md); dk, dv and phi's
gradients are sums of the same terms in another order, equal within the rounding of the dtype's
accumulation (fp64 on the reference backend, fp32 on the cpu one).
docs/distributed.md says more. The gathers use whatever backend the group has (gloo on CPUs);
the library's cuda backend does not take a query packing yet.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor
import torch.distributed as dist

from . import torch_ops
from ._core import Config, Phi, error, make_config, split_kv, threads

__all__ = ["zigzag_bounds", "zigzag_rows", "zigzag_positions", "zigzag_split", "zigzag_unsplit", "local_cu_seqlens",
           "attention"]


# ---- Layout -----------------------------------------------------------------------------------


def zigzag_bounds(length: int, world_size: int) -> List[int]:
    """The 2P + 1 chunk boundaries of a sequence of `length` tokens: chunk c is
    [bounds[c], bounds[c + 1])."""
    n = 2 * world_size
    return [c * length // n for c in range(n + 1)]


def _offsets(cu_seqlens) -> List[int]:
    """Host offsets as a list of ints, checked: [0, ..., T] non-decreasing."""
    if isinstance(cu_seqlens, Tensor):
        if cu_seqlens.is_floating_point() or cu_seqlens.dim() != 1:
            raise error("cu_seqlens", f"a {cu_seqlens.dtype} tensor of shape {list(cu_seqlens.shape)}",
                        "must be a 1-D integer tensor of B+1 offsets")
        cu = [int(x) for x in cu_seqlens.cpu().tolist()]
    else:
        cu = [int(x) for x in cu_seqlens]
    if not cu or cu[0] != 0:
        raise error("cu_seqlens[0]", cu[0] if cu else "absent", "must be 0")
    for b in range(1, len(cu)):
        if cu[b] < cu[b - 1]:
            raise error(f"cu_seqlens[{b}]", cu[b], f"must be >= cu_seqlens[{b - 1}] = {cu[b - 1]}")
    return cu


def _chunks(cu: Sequence[int], rank: int, world_size: int) -> List[Tuple[int, int, int]]:
    """The (sequence start, chunk start, chunk end) of rank's chunks, in its local order (positions
    within the sequence for the chunk's ends)."""
    out = []
    for b in range(len(cu) - 1):
        bounds = zigzag_bounds(cu[b + 1] - cu[b], world_size)
        for c in (rank, 2 * world_size - 1 - rank):
            out.append((cu[b], bounds[c], bounds[c + 1]))
    return out


def zigzag_rows(cu_seqlens, rank: int, world_size: int) -> Tensor:
    """The global rows (int64) that rank owns, in its local order."""
    cu = _offsets(cu_seqlens)
    rows = [torch.arange(s + a, s + e) for s, a, e in _chunks(cu, rank, world_size)]
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)


def zigzag_positions(cu_seqlens, rank: int, world_size: int) -> Tensor:
    """The position within its sequence (int64) of each of rank's rows, in its local order (what
    rotary embeddings need)."""
    cu = _offsets(cu_seqlens)
    pos = [torch.arange(a, e) for _, a, e in _chunks(cu, rank, world_size)]
    return torch.cat(pos) if pos else torch.zeros(0, dtype=torch.int64)


def local_cu_seqlens(cu_seqlens, rank: int, world_size: int) -> Tensor:
    """Offsets (int32) of rank's local rows: one entry per chunk, 2B chunks (the query packing of its
    library call)."""
    cu = _offsets(cu_seqlens)
    sizes = [e - a for _, a, e in _chunks(cu, rank, world_size)]
    return torch.tensor([0] + sizes, dtype=torch.int64).cumsum(0).to(torch.int32)


def zigzag_split(x: Tensor, cu_seqlens, rank: int, world_size: int) -> Tensor:
    """Rank's rows of a [T, ...] tensor of the whole batch."""
    return x[zigzag_rows(cu_seqlens, rank, world_size).to(x.device)]


def zigzag_unsplit(parts: Sequence[Tensor], cu_seqlens) -> Tensor:
    """The [T, ...] tensor of the whole batch from every rank's local rows (parts[r] from rank r)."""
    world_size = len(parts)
    cu = _offsets(cu_seqlens)
    out = parts[0].new_empty((cu[-1],) + tuple(parts[0].shape[1:]))
    for r, part in enumerate(parts):
        out[zigzag_rows(cu, r, world_size).to(part.device)] = part
    return out


# ---- Collectives ------------------------------------------------------------------------------


def _gather_sizes(values: List[int], group) -> List[List[int]]:
    """Every rank's `values` (int64, the same count on every rank)."""
    t = torch.tensor(values, dtype=torch.int64)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return [[int(x) for x in o.tolist()] for o in out]


_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _signature(tensors) -> List[int]:
    """Per (name, tensor): present, rows, the two trailing extents, the dtype's code."""
    out = []
    for _, t in tensors:
        if t is None or t.dim() != 3:
            out += [0, 0, 0, 0, -1] if t is None else [1, -1, -1, -1, -1]
        else:
            code = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else -1
            out += [1, int(t.shape[0]), int(t.shape[1]), int(t.shape[2]), code]
    return out


def _check_ranks(cu: List[int], tensors, group) -> None:
    """Before any other collective: the same offsets on every rank, each rank's rows those of its
    chunks, and the same heads, head dims and dtypes everywhere (the gathers need them). Every
    rank sees everyone's sizes, so each raises the same error (tensors: (name, tensor or None) of
    the rank's q, g, k and v)."""
    world = dist.get_world_size(group)
    sig = _gather_sizes([len(cu), cu[-1]] + _signature(tensors), group)
    n = max(h[0] for h in sig)
    table = _gather_sizes(cu + [-1] * (n - len(cu)), group)
    for r in range(world):
        if table[r] != table[0]:
            raise error("cu_seqlens", f"different on rank {r} (B = {sig[r][0] - 1}, T = {sig[r][1]}) "
                        f"than on rank 0 (B = {sig[0][0] - 1}, T = {sig[0][1]})",
                        "must be the same global offsets on every rank of the group")
    for r in range(world):
        want = sum(e - a for _, a, e in _chunks(cu, r, world))
        for i, (name, _) in enumerate(tensors):
            present, rows, d1, d2, code = sig[r][2 + 5 * i:7 + 5 * i]
            if present != sig[0][2 + 5 * i]:
                raise error(name, f"{'given' if present else 'absent'} on rank {r}", "must be so on every rank")
            if not present:
                continue
            if rows != want:
                raise error(f"{name}.shape[0]", f"{rows} on rank {r}",
                            f"must be {want}: the rows of rank {r}'s chunks {r} and {2 * world - 1 - r} of every "
                            f"sequence (zigzag_split)")
            if [d1, d2, code] != sig[0][4 + 5 * i:7 + 5 * i]:
                raise error(name, f"shape [{rows}, {d1}, {d2}] and dtype code {code} on rank {r}",
                            "must have rank 0's heads, head dim and dtype (3-D [rows, heads, dim] on every rank)")


def _all_gather_rows(x: Tensor, counts: List[int], group) -> List[Tensor]:
    """Every rank's local rows of x (rank r has counts[r] rows): padded to the most rows for the
    gather, cut back after."""
    most = max(counts)
    padded = x.new_zeros((most,) + tuple(x.shape[1:]))
    padded[: x.shape[0]] = x
    out = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(out, padded.contiguous(), group=group)
    return [o[:c] for o, c in zip(out, counts)]


def _sum_rows_in_rank_order(x: Tensor, rows: List[Tensor], rank: int, group) -> Tensor:
    """Rows rows[rank] of sum_r x_r over the ranks (x [T, ...], rows[s]: rank s's rows), added in
    the order 0 .. P-1: every rank sends rank s its rows rows[s] (one all_to_all_single over a
    [P, most rows, ...] buffer, every piece padded to the most rows a rank has: gloo has only the
    equal-split form) and adds the P pieces it receives in rank order. A rank holds x, its pieces
    and what it receives, about 3 T rows, where an all-gather of x would take P T."""
    most = max(int(r.numel()) for r in rows)
    send = x.new_zeros((len(rows), most) + tuple(x.shape[1:]))
    for s, r in enumerate(rows):
        send[s, : r.numel()] = x[r.to(x.device)]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    mine = int(rows[rank].numel())
    total = recv[0, :mine].clone()
    for o in recv[1:]:
        total += o[:mine]
    return total


def _sum_in_rank_order(x: Tensor, group) -> Tensor:
    """sum_r x_r over the ranks, added in the order 0 .. P-1 on every rank (the same bits
    everywhere, whatever the collective's own reduction order would be)."""
    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, x.contiguous(), group=group)
    total = out[0].clone()
    for o in out[1:]:
        total += o
    return total


# ---- The attention ----------------------------------------------------------------------------


class _Plan:
    """What a rank's call needs, from the global offsets: the rows of every rank, the prefix key
    rows of its library call and the query and key packings of that call."""

    def __init__(self, cu: List[int], rank: int, world: int):
        self.world, self.rank = world, rank
        self.rows = [zigzag_rows(cu, r, world) for r in range(world)]
        self.counts = [int(r.numel()) for r in self.rows]
        chunks = _chunks(cu, rank, world)
        # Key rows of the call: for each chunk the prefix of its sequence that ends with it.
        self.key_rows = (torch.cat([torch.arange(s, s + e) for s, _, e in chunks]) if chunks
                         else torch.zeros(0, dtype=torch.int64))
        self.cu_k = torch.tensor([0] + [e for _, _, e in chunks], dtype=torch.int64).cumsum(0).to(torch.int32)
        self.cu_q = local_cu_seqlens(cu, rank, world)
        self.prefixes = [(s, e) for s, _, e in chunks]
        self.T = cu[-1]

    def gather_full(self, x: Tensor, group) -> Tensor:
        """[T, ...] of the whole batch from every rank's local rows."""
        parts = _all_gather_rows(x, self.counts, group)
        full = x.new_empty((self.T,) + tuple(x.shape[1:]))
        for r, part in enumerate(parts):
            full[self.rows[r].to(x.device)] = part
        return full

    def scatter_keys(self, d_call: Tensor) -> Tensor:
        """[T, ...]: the gradient of the call's prefix key rows added back to their global rows,
        prefix after prefix (a fixed order)."""
        full = d_call.new_zeros((self.T,) + tuple(d_call.shape[1:]))
        at = 0
        for s, e in self.prefixes:
            full[s:s + e] += d_call[at:at + e]
            at += e
        return full


class _ContextParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, group, cfg, backend, num_threads, sum_phi, q, g, *tensors):
        kv_local, phi_flat = tensors[:6], tensors[6:]
        kv_call = []
        for x in kv_local:
            kv_call.append(None if x is None else plan.gather_full(x, group)[plan.key_rows.to(x.device)])
        phi_k, phi_v = torch_ops._phi(*phi_flat[:5]), torch_ops._phi(*phi_flat[5:])
        with torch.no_grad():
            o, lse, idx = torch_ops.attention(q, tuple(kv_call), g, phi_k, phi_v, cfg, plan.cu_k, 0, backend,
                                              num_threads, False, plan.cu_q, 0)
        ctx.plan, ctx.group, ctx.cfg, ctx.backend, ctx.num_threads = plan, group, cfg, backend, num_threads
        ctx.sum_phi = sum_phi
        ctx.present = [x is not None for x in tensors]
        ctx.mark_non_differentiable(lse, idx)
        ctx.save_for_backward(q, g, lse, idx, *kv_call, *phi_flat)
        ctx.n_kv = len(kv_call)
        return o, lse, idx

    @staticmethod
    def backward(ctx, d_o, _d_lse, _d_idx):
        plan, group = ctx.plan, ctx.group
        saved = ctx.saved_tensors
        q, g, lse, idx = saved[:4]
        kv_call, phi_flat = saved[4:4 + ctx.n_kv], saved[4 + ctx.n_kv:]
        cfg = ctx.cfg
        grads = torch.ops.nsa.backward(q, *kv_call, g, *phi_flat, plan.cu_k, 0, cfg.ints(), torch_ops._scale(cfg.scale),
                                       ctx.backend, ctx.num_threads, lse, idx, None, d_o.contiguous(), None,
                                       plan.cu_q, 0)
        dq, d_kv, dg, d_phi = grads[0], grads[1:7], grads[7], grads[8:]
        out_kv = []
        for d, present in zip(d_kv, ctx.present[:6]):
            if not present:
                out_kv.append(None)
                continue
            out_kv.append(_sum_rows_in_rank_order(plan.scatter_keys(d), plan.rows, plan.rank, group))
        out_phi = [(_sum_in_rank_order(d, group) if ctx.sum_phi else d) if present else None
                   for d, present in zip(d_phi, ctx.present[6:])]
        return (None, None, None, None, None, None, dq, dg, *out_kv, *out_phi)


def attention(q: Tensor, k, v, g: Tensor, phi_k: Optional[Phi] = None, phi_v: Optional[Phi] = None, *,
              cu_seqlens, group=None, config: Optional[Config] = None, backend: str = "auto", num_threads: int = 0,
              return_aux: bool = False, sum_phi_grads: bool = True, **config_fields):
    """Context-parallel NSA: this rank's rows of ``nsa.attention`` on the whole batch.

    q [Tr, Hq, Dqk], g [Tr, Hq, 3] and k, v (one tensor each, shared by the branches, or (cmp,
    slc, win) tuples) [Tr, Hkv, D] are this rank's rows (``zigzag_split``); ``cu_seqlens`` the
    GLOBAL offsets of the batch (host integers, the same on every rank; [0, T] for one sequence).
    phi_k, phi_v: the compression functions' parameters, the same on every rank. Their gradients
    come back summed over the ranks (the same on every rank), or with ``sum_phi_grads=False`` as
    this rank's share, for a caller that reduces every parameter's gradient over the group itself
    (the sum is the single-process gradient; DistributedDataParallel's all-reduce gives the mean,
    1/P of it). group: the process group (None: the default one). Returns o [Tr, Hq, Dv] (and
    with return_aux ``(o, (lse, indices))`` of the rows). Differentiable in q, k, v, g and phi."""
    cfg = make_config(config, config_fields)
    if cu_seqlens is None:
        raise error("cu_seqlens", "None", "must be the global offsets of the batch (e.g. [0, T] for one sequence)")
    cu = _offsets(cu_seqlens)
    group = group if group is not None else dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    kv6, _ = split_kv(k, v)
    _check_ranks(cu, [("q", q), ("g", g)] + list(zip(("k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win"), kv6)),
                 group)
    phi_k, phi_v = torch_ops._phi_args(phi_k), torch_ops._phi_args(phi_v)
    plan = _Plan(cu, rank, world)
    o, lse, idx = _ContextParallel.apply(plan, group, cfg, backend, threads(num_threads), bool(sum_phi_grads), q, g,
                                         *kv6, *phi_k, *phi_v)
    return (o, (lse, idx)) if return_aux else o
