"""The layer with a query packing (cu_seqlens_q: each sequence's last positions are the queries)
against the call on every position, through numpy and torch: the outputs are the full call's rows,
the gradients the full call's with d_o zero on the rows not queried. Bitwise on the reference
backend; on the cpu backend the same indices and everything else within 2e-5 (absolute, values of
O(1)): a tile of the suffix call holds only queried positions, so the selection branch may visit
its blocks in another order and the key-gradient sums group the queries differently
(tests/test_query_packing.cpp)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import SMALL, has_torch, make_problem

import nsa

SEQLENS = (37, 0, 50, 21, 9)
TQ = (5, 0, 50, 1, 0)  # Tq = 0, = Tk, = 1, and lengths no multiple of the blocks


def query_rows(seqlens, tq):
    """(full-call rows of the queries, cu_seqlens_q)."""
    rows, start = [], 0
    for n, m in zip(seqlens, tq):
        rows += range(start + n - m, start + n)
        start += n
    return np.array(rows, dtype=np.int64), np.concatenate([[0], np.cumsum(tq)]).astype(np.int32)


def masked(d_o, rows):
    out = np.zeros_like(d_o)
    out[rows] = d_o[rows]
    return out


@pytest.mark.parametrize("dtype,backend,shared,phi", [
    (np.float64, "reference", False, "mlp"),
    (np.float32, "cpu", False, "linear"),
    (np.float32, "cpu", True, "mean"),
    (np.float32, "reference", True, "mlp"),
])
def test_numpy_rows_and_gradients(dtype, backend, shared, phi):
    p = make_problem(3, SMALL, SEQLENS, shared=shared, phi=phi).astype(dtype)
    rows, cu_q = query_rows(SEQLENS, TQ)
    kw = dict(cu_seqlens=p.cu, config=SMALL, backend=backend)
    o, aux = nsa.attention(p.q, p.k, p.v, p.g, p.phi_k, p.phi_v, return_aux=True, **kw)
    os, auxs = nsa.attention(p.q[rows], p.k, p.v, p.g[rows], p.phi_k, p.phi_v, return_aux=True,
                             cu_seqlens_q=cu_q, **kw)
    np.testing.assert_array_equal(auxs.indices, aux.indices[rows])
    if backend == "reference":
        np.testing.assert_array_equal(os, o[rows])
        np.testing.assert_array_equal(auxs.lse, aux.lse[rows])
    else:
        np.testing.assert_allclose(os, o[rows], rtol=0, atol=2e-5)
        np.testing.assert_allclose(auxs.lse, aux.lse[rows], rtol=0, atol=2e-5)  # -inf in the same places

    d_o = np.random.default_rng(4).standard_normal(o.shape).astype(dtype)
    full = nsa.attention_backward(p.q, p.k, p.v, p.g, p.phi_k, p.phi_v, aux.lse, aux.indices, masked(d_o, rows), **kw)
    part = nsa.attention_backward(p.q[rows], p.k, p.v, p.g[rows], p.phi_k, p.phi_v, auxs.lse, auxs.indices,
                                  d_o[rows], cu_seqlens_q=cu_q, **kw)
    def check(a, b):
        if backend == "reference":
            np.testing.assert_array_equal(a, b)
        else:  # the cpu's fp32 key-gradient sums group the queries differently: sums of O(100) O(1) terms
            np.testing.assert_allclose(a, b, rtol=0, atol=2e-5)

    def tensors(grads):
        """dk, dv (one array or a (cmp, slc, win) tuple each) and phi's gradients, flattened."""
        flat = [x for d in (grads.dk, grads.dv) for x in (d if isinstance(d, tuple) else (d,))]
        return flat + [x for phi in (grads.dphi_k, grads.dphi_v) if phi is not None for x in phi if x is not None]

    check(part.dq, full.dq[rows])
    check(part.dg, full.dg[rows])
    for a, b in zip(tensors(part), tensors(full), strict=True):
        check(a, b)


def test_numpy_errors_name_the_query_packing():
    p = make_problem(3, SMALL, SEQLENS)
    rows, cu_q = query_rows(SEQLENS, TQ)
    bad = cu_q.copy()
    bad[2:] += 1  # sequence 1 has no keys
    q = np.concatenate([p.q[rows], p.q[:1]])
    g = np.concatenate([p.g[rows], p.g[:1]])
    with pytest.raises(nsa.Error, match=r"cu_seqlens_q\[2\] - cu_seqlens_q\[1\].*must be <= sequence 1's keys"):
        nsa.attention(q, p.k, p.v, g, p.phi_k, p.phi_v, cu_seqlens=p.cu, config=SMALL, cu_seqlens_q=bad)
    with pytest.raises(nsa.Error, match=r"cu_seqlens_q.shape\[0\]"):
        nsa.attention(p.q[rows], p.k, p.v, p.g[rows], p.phi_k, p.phi_v, cu_seqlens=p.cu, config=SMALL,
                      cu_seqlens_q=cu_q[:3])
    with pytest.raises(nsa.Error, match=r"g.shape\[0\]"):
        nsa.attention(p.q[rows], p.k, p.v, p.g, p.phi_k, p.phi_v, cu_seqlens=p.cu, config=SMALL, cu_seqlens_q=cu_q)


@pytest.mark.skipif(not has_torch(), reason="PyTorch is not installed")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_torch_autograd_matches_masked_full_call(dtype):
    import torch

    dt = getattr(torch, dtype)
    p = make_problem(5, SMALL, SEQLENS, phi="mlp")
    rows, cu_q = query_rows(SEQLENS, TQ)
    rows_t = torch.tensor(rows)

    def leaves():
        t = lambda x: None if x is None else torch.tensor(x, dtype=dt, requires_grad=True)  # noqa: E731
        return (t(p.q), tuple(t(x) for x in p.kv6), t(p.g), nsa.Phi(*[t(x) for x in p.phi_k]),
                nsa.Phi(*[t(x) for x in p.phi_v]))

    def run(suffix):
        q, kv6, g, phi_k, phi_v = leaves()
        k, v = (kv6[0], kv6[2], kv6[4]), (kv6[1], kv6[3], kv6[5])
        kw = dict(cu_seqlens=torch.tensor(p.cu), config=SMALL)
        if suffix:
            o = nsa.attention(q[rows_t], k, v, g[rows_t], phi_k, phi_v, cu_seqlens_q=torch.tensor(cu_q), **kw)
        else:
            o = nsa.attention(q, k, v, g, phi_k, phi_v, **kw)[rows_t]
        w = torch.linspace(-1, 1, o.numel(), dtype=dt).reshape(o.shape)
        (o * w).sum().backward()
        return o.detach(), [x.grad for x in (q, *kv6, g, *phi_k, *phi_v) if x is not None]

    o_s, g_s = run(True)
    o_f, g_f = run(False)
    for a, b in zip([o_s, *g_s], [o_f, *g_f]):
        if dtype == "float64":  # the reference backend
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=2e-5)


@pytest.mark.skipif(not has_torch(), reason="PyTorch is not installed")
def test_opcheck_forward_with_query_packing():
    """nsa::forward's schema, fake implementation (q's rows: Tq) and autograd registration with
    cu_seqlens_q (torch.library.opcheck)."""
    import torch

    from nsa import torch_ops  # noqa: F401  (registers torch.ops.nsa.*)

    tiny = nsa.Config(cmp_block_len=4, cmp_stride=2, slc_block_len=4, n_selected=3, n_init=1, n_local=1, window=3)
    p = make_problem(41, tiny, (9, 6), hq=2, hkv=1, dqk=3, dv=2, hidden=3)
    rows, cu_q = query_rows((9, 6), (4, 6))

    def t(x):
        return None if x is None else torch.tensor(x, requires_grad=True)

    q = t(p.q[rows]).detach().requires_grad_(True)
    g = t(p.g[rows]).detach().requires_grad_(True)
    args = (q, *[t(x) for x in p.kv6], g, *[t(x) for x in p.phi_k], *[t(x) for x in p.phi_v], torch.tensor(p.cu), 0,
            tiny.ints(), 0.0, "auto", 0, False, torch.tensor(cu_q), 0)
    torch.library.opcheck(torch.ops.nsa.forward.default, args)
