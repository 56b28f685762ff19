"""nsa.distributed: context-parallel NSA on 2 and 4 gloo processes of this machine against one
process on the whole batch.

Each case compares, on every rank, the rank's rows of the output and of every gradient with the
single-process call (same inputs, same backend, same loss sum(o * W)):
  - reference backend (float64): o, lse, indices, dq and dg bitwise (each rank's library call is
    a query packing, whose rows are computed exactly as the whole call computes them); dk, dv and
    phi's gradients are sums of the same terms over the ranks in another order: max abs error
    <= 1e-12 * max(1, the tensor's max abs entry);
  - cpu backend (float32): a query tile of the rank's call holds only the rank's queries, so the
    selection branch may visit its blocks in another order and the key-gradient sums group the
    queries differently: everything within 2e-5 * max(1, max abs entry) (fp32 rounding of sums
    of O(100) terms); the indices are compared exactly (these seeds have no near-tie a last-bit
    change of the scores could flip).
The layer (NativeSparseAttention with process_group, float64): its output rows and every
parameter's gradient summed over the ranks within 1e-12 * max(1, max abs entry) (its projections
run on the rank's rows only, another blocking of the products). Plus: other offsets on one rank, a
rank with the wrong rows or another head dim raise the same nsa.Error on every rank (a hang would
hit the process group's 60 s timeout).
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import sys

import numpy as np
import pytest

from conftest import SMALL, has_torch, make_problem

if not has_torch():
    pytest.skip("PyTorch is not installed", allow_module_level=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import nsa  # noqa: E402
import nsa.distributed  # noqa: E402

# (name, config, torch dtype, backend, shared K/V, phi, sequence lengths): uneven lengths, an empty
# sequence and one shorter than 2P chunks; none divides by 2P.
# The reach backbone (spec §11) forces blocks at offsets from each query's own position.
BACKBONE = dataclasses.replace(SMALL, n_selected=4, backbone_offsets=(2,))
CASES = [
    ("reference_f64_independent_mlp", SMALL, "float64", "reference", False, "mlp", (37, 0, 50, 5)),
    ("reference_f64_shared_linear_backbone", BACKBONE, "float64", "reference", True, "linear", (66, 17)),
    ("cpu_f32_shared_linear", SMALL, "float32", "cpu", True, "linear", (61,)),
    ("cpu_f32_independent_mean", SMALL, "float32", "cpu", False, "mean", (23, 42)),
    ("cpu_f32_independent_mlp_backbone", BACKBONE, "float32", "cpu", False, "mlp", (3, 70)),
]


def _leaves(p, dt):
    def t(x):
        return None if x is None else torch.tensor(x, dtype=dt, requires_grad=True)

    def t_phi(phi):
        return None if phi is None else nsa.Phi(*[t(x) for x in phi])

    return t(p.q), tuple(t(x) for x in p.kv6), t(p.g), t_phi(p.phi_k), t_phi(p.phi_v)


def _kv(kv6, shared):
    return (kv6[0], kv6[1]) if shared else ((kv6[0], kv6[2], kv6[4]), (kv6[1], kv6[3], kv6[5]))


def _params(kv6, q, g, phi_k, phi_v):
    """(name, leaf) of every differentiable input."""
    out = [("q", q), ("g", g)]
    out += [(n, x) for n, x in zip(("k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win"), kv6) if x is not None]
    for name, phi in (("phi_k", phi_k), ("phi_v", phi_v)):
        if phi is not None:
            out += [(f"{name}.{f}", x) for f, x in zip(phi._fields, phi) if x is not None]
    return out


def _compare(name, got, want, exact, dtype, rank):
    if exact:
        assert torch.equal(got, want), f"rank {rank}: {name} differs (max {float((got - want).abs().max())})"
        return
    # -inf (an empty branch's lse) in the same places, the finite values close.
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite) and torch.equal(got[~finite], want[~finite]), \
        f"rank {rank}: {name} has its infinities elsewhere"
    got, want = got[finite], want[finite]
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    tol = 1e-12 * scale if dtype == torch.float64 else 2e-5 * scale
    err = float((got - want).abs().max()) if got.numel() else 0.0
    assert err <= tol, f"rank {rank}: {name} error {err} above {tol}"


def _run_case(rank, world, case):
    name, cfg, dtype_name, backend, shared, phi, seqlens = case
    dt = getattr(torch, dtype_name)
    p = make_problem(17, cfg, seqlens, shared=shared, phi=phi)
    cu = [0] + [int(c) for c in np.cumsum(seqlens)]
    kw = dict(config=cfg, backend=backend)
    # One process on the whole batch.
    q, kv6, g, phi_k, phi_v = _leaves(p, dt)
    k, v = _kv(kv6, shared)
    o, (lse, idx) = nsa.attention(q, k, v, g, phi_k, phi_v, cu_seqlens=torch.tensor(cu), return_aux=True, **kw)
    W = torch.linspace(-1, 1, o.numel(), dtype=dt).reshape(o.shape)
    (o * W).sum().backward()
    full = _params(kv6, q, g, phi_k, phi_v)
    # This rank's rows, context-parallel.
    rows = nsa.distributed.zigzag_rows(cu, rank, world)
    q2, kv2, g2, phk2, phv2 = _leaves(p, dt)
    local = lambda x: None if x is None else x.detach()[rows].requires_grad_(True)  # noqa: E731
    ql, gl, kvl = local(q2), local(g2), tuple(local(x) for x in kv2)
    kl, vl = _kv(kvl, shared)
    ol, (lsel, idxl) = nsa.distributed.attention(ql, kl, vl, gl, phk2, phv2, cu_seqlens=cu, return_aux=True, **kw)
    (ol * W[rows]).sum().backward()
    exact_rows = backend == "reference"
    _compare(f"{name}: o", ol.detach(), o.detach()[rows], exact_rows, dt, rank)
    _compare(f"{name}: lse", lsel, lse[rows], exact_rows, torch.float32, rank)
    _compare(f"{name}: indices", idxl, idx[rows], True, dt, rank)
    got = dict(_params(kvl, ql, gl, phk2, phv2))
    for pname, leaf in full:
        if pname.startswith("phi_"):  # the same, summed over the ranks, on every rank
            _compare(f"{name}: d{pname}", got[pname].grad, leaf.grad, False, dt, rank)
        else:
            _compare(f"{name}: d{pname}", got[pname].grad, leaf.grad[rows], exact_rows and pname in ("q", "g"), dt,
                     rank)


def _expect_error_everywhere(rank, world, cu_of_rank, rows_delta, words, narrow_v_on=-1):
    p = make_problem(3, SMALL, (30, 11))
    cu = [0, 30, 41]
    rows = nsa.distributed.zigzag_rows(cu, rank, world)
    q = torch.tensor(p.q)[rows]
    if rank == 0 and rows_delta:
        q = q[:-1]
    g = torch.tensor(p.g)[rows[: q.shape[0]]]
    kv = [torch.tensor(x)[rows[: q.shape[0]]] for x in p.kv6[:2]]
    if rank == narrow_v_on:  # another head dim of v than the other ranks
        kv[1] = kv[1][..., :-1].contiguous()
    phi = [nsa.Phi(*[None if x is None else torch.tensor(x) for x in f]) for f in (p.phi_k, p.phi_v)]
    with pytest.raises(nsa.Error, match=words):
        nsa.distributed.attention(q, kv[0], kv[1], g, phi[0], phi[1], cu_seqlens=cu_of_rank(rank), config=SMALL)


def _run_module(rank, world):
    """NativeSparseAttention with the process group against the same layer on the whole batch:
    this rank's output rows, and every parameter's gradient summed over the ranks (rank order)."""
    from conftest import make_layer

    cu = [0, 45, 45, 70]
    full, cp = make_layer(0), make_layer(0, process_group=dist.group.WORLD)
    x = torch.randn(70, full.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    y = full(x, cu_seqlens=torch.tensor(cu))
    W = torch.linspace(-1, 1, y.numel(), dtype=torch.float64).reshape(y.shape)
    (y * W).sum().backward()
    rows = nsa.distributed.zigzag_rows(cu, rank, world)
    yl = cp(x[rows], cu_seqlens=cu)
    (yl * W[rows]).sum().backward()
    _compare("layer: y", yl.detach(), y.detach()[rows], False, torch.float64, rank)
    for (name, a), (_, b) in zip(cp.named_parameters(), full.named_parameters()):
        parts = [torch.empty_like(a.grad) for _ in range(world)]
        dist.all_gather(parts, a.grad)
        _compare(f"layer: d{name}", sum(parts[1:], parts[0].clone()), b.grad, False, torch.float64, rank)


def _exit_after_success():
    """Ends a worker whose checks all passed and whose process group is destroyed without the
    interpreter's teardown, where gloo's threads now and then abort the process ("terminate called
    without an active exception": about one spawn in ten on 2 cores, every rank past
    destroy_process_group). A failing check never gets here: its exception reaches mp.spawn."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _worker(rank, world, store):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    # A file store: no port to find free (and none another process could take in between).
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for case in CASES:
            _run_case(rank, world, case)
        _run_module(rank, world)
        # A rank with other offsets, and a rank with one row too few: every rank raises.
        _expect_error_everywhere(rank, world, lambda r: [0, 30, 41] if r == 0 else [0, 29, 41], False,
                                 r"cu_seqlens.*different on rank 1")
        _expect_error_everywhere(rank, world, lambda r: [0, 30, 41], True, r"q.shape\[0\].*on rank 0")
        _expect_error_everywhere(rank, world, lambda r: [0, 30, 41], False, r"v_cmp.*on rank 1.*rank 0's heads",
                                 narrow_v_on=1)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    _exit_after_success()


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_matches_one_process(world, tmp_path):
    mp.spawn(_worker, args=(world, str(tmp_path / "store")), nprocs=world, join=True)


def test_zigzag_layout():
    cu = [0, 5, 5, 22]
    for world in (1, 2, 3):
        parts = [nsa.distributed.zigzag_rows(cu, r, world) for r in range(world)]
        assert sorted(torch.cat(parts).tolist()) == list(range(22))  # every row once
        x = torch.arange(22.0)[:, None]
        assert torch.equal(nsa.distributed.zigzag_unsplit([x[p] for p in parts], cu), x)
    assert nsa.distributed.zigzag_bounds(17, 2) == [0, 4, 8, 12, 17]
    # Rank 0 of 2: chunks 0 and 3 of each sequence, in that order.
    assert nsa.distributed.zigzag_rows([0, 17], 0, 2).tolist() == [0, 1, 2, 3] + list(range(12, 17))
    assert nsa.distributed.local_cu_seqlens([0, 17], 0, 2).tolist() == [0, 4, 9]


def _one_rank_worker(rank, store):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        _run_case(0, 1, CASES[0])
    finally:
        dist.destroy_process_group()
    _exit_after_success()


def test_one_rank_is_the_plain_call(tmp_path):
    """P = 1: rank 0 owns chunks 0 and 1, the whole of every sequence; its call packs them as two
    query packings of one sequence each and gives the plain call's rows. In a process of its own,
    as the other cases, so that no process group state outlives the test in the test process."""
    mp.spawn(_one_rank_worker, args=(str(tmp_path / "store"),), nprocs=1, join=True)
