"""The binding on NumPy arrays: the C++ library (reference backend for float64) against the
independent NumPy oracle, the stages against the whole layer, gradients against finite
differences, strided inputs, errors, and every available float32 backend."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

import nsa
import oracle
from conftest import SMALL, make_problem

# float64 through the reference backend is exact up to summation order.
F64_TOL = 1e-11


def run(p, cfg=SMALL, **kw):
    return nsa.attention(p.q, p.k, p.v, p.g, p.phi_k, p.phi_v, cu_seqlens=p.cu, config=cfg, return_aux=True, **kw)


def run_oracle(p, cfg=SMALL):
    return oracle.forward(cfg, p.q, p.kv6, p.g, p.phi_k, p.phi_v, p.cu)


def assert_matches_oracle(p, cfg):
    o, aux = run(p, cfg)
    o_ref, lse_ref, idx_ref, _ = run_oracle(p, cfg)
    np.testing.assert_array_equal(aux.indices, idx_ref)
    np.testing.assert_allclose(o, o_ref, rtol=F64_TOL, atol=F64_TOL)
    assert np.array_equal(np.isneginf(aux.lse), np.isneginf(lse_ref))
    finite = np.isfinite(lse_ref)
    np.testing.assert_allclose(aux.lse[finite], lse_ref[finite], rtol=1e-6, atol=1e-6)  # lse is float32


CASES = {
    # name: (config changes, problem arguments)
    "mlp_per_branch_gqa": ({}, dict(seqlens=(37,), phi="mlp")),
    "linear_shared_kv": ({}, dict(seqlens=(41,), phi="linear", shared=True)),
    "mean_G1": ({}, dict(seqlens=(29,), phi="mean", hq=3, hkv=3)),
    "packed_with_empty_and_one_token": ({}, dict(seqlens=(23, 0, 1, 45), phi="mlp")),
    "n_larger_than_blocks": (dict(n_selected=6, n_init=2, n_local=2), dict(seqlens=(40,))),
    "window_and_selection_off": (dict(n_selected=0, window=0), dict(seqlens=(30, 19))),
    "window_1_explicit_scale": (dict(window=1, scale=0.3), dict(seqlens=(33,), dqk=5, dv=7)),
    "short_sequences": ({}, dict(seqlens=(7, 3, 8), phi="mlp")),
    "no_tokens_at_all": ({}, dict(seqlens=(0, 0), phi="mlp")),
    "one_empty_sequence": ({}, dict(seqlens=(0,), phi="linear")),
    "l_equals_d": (dict(cmp_block_len=4, cmp_stride=4, slc_block_len=8, n_selected=2, n_local=1), dict(seqlens=(27,))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_matches_oracle(name):
    changes, args = CASES[name]
    cfg = dataclasses.replace(SMALL, **changes)
    assert_matches_oracle(make_problem(seed=len(name), cfg=cfg, **args), cfg)


def test_oracle_can_fail():
    """The comparison notices a wrong answer: a swapped branch K/V set changes the output."""
    p = make_problem(seed=1)
    o, _ = run(p)
    swapped = dataclasses.replace(p, kv6=(p.kv6[0], p.kv6[1], p.kv6[4], p.kv6[5], p.kv6[2], p.kv6[3]))
    o_ref = run_oracle(swapped)[0]
    assert np.abs(o - o_ref).max() > 1e-3


def test_stages_compose_to_forward():
    """compress -> compressed_attention -> select_topn -> selected/window attention, gated, is forward()."""
    p = make_problem(seed=3, seqlens=(30, 0, 41))
    kw = dict(cu_seqlens=p.cu, config=SMALL)
    kc = nsa.compress(p.kv6[0], p.phi_k, **kw)
    vc = nsa.compress(p.kv6[1], p.phi_v, **kw)
    o_cmp, lse_cmp, S = nsa.compressed_attention(p.q, kc, vc, **kw)
    idx = nsa.select_topn(S, **kw)
    o_slc, lse_slc = nsa.selected_attention(p.q, p.kv6[2], p.kv6[3], idx, **kw)
    o_win, lse_win = nsa.window_attention(p.q, p.kv6[4], p.kv6[5], **kw)
    o = p.g[..., 0:1] * o_cmp + p.g[..., 1:2] * o_slc + p.g[..., 2:3] * o_win
    o_ref, aux = run(p)
    np.testing.assert_array_equal(idx, aux.indices)
    np.testing.assert_allclose(o, o_ref, rtol=F64_TOL, atol=F64_TOL)
    np.testing.assert_array_equal(np.stack([lse_cmp, lse_slc, lse_win], -1), aux.lse)
    _, _, idx_ref, S_ref = run_oracle(p)
    np.testing.assert_allclose(S, S_ref, rtol=1e-6, atol=1e-7)  # scores are float32
    branches = nsa.attention_branches(p.q, p.k, p.v, p.g, p.phi_k, p.phi_v, **kw)
    np.testing.assert_allclose(branches.o_branch[0], o_cmp, rtol=F64_TOL, atol=F64_TOL)
    np.testing.assert_allclose(branches.o_branch[2], o_win, rtol=F64_TOL, atol=F64_TOL)


def test_compress_layout_and_untouched_rows():
    p = make_problem(seed=4, seqlens=(13, 9, 20), phi="linear")
    xc = nsa.compress(p.kv6[0], p.phi_k, cu_seqlens=p.cu, config=SMALL)
    np.testing.assert_allclose(xc, oracle.compress(p.kv6[0], p.phi_k, p.cu, 8, 4), rtol=F64_TOL, atol=F64_TOL)


def test_select_topn_ties_go_to_smaller_block():
    cfg = dataclasses.replace(SMALL, n_selected=3, n_init=0, n_local=1)
    T = 80
    scores = np.ones((T, 1, 5), dtype=np.float32)  # all equal: the smallest admissible blocks win
    idx = nsa.select_topn(scores, config=cfg)
    assert idx[79, 0].tolist() == [0, 1, 4]  # forced local block 4, then the ties 0 and 1
    assert idx[5, 0].tolist() == [0, -1, -1]


def test_gradients_match_finite_differences():
    """attention_backward against central differences of attention along a random direction."""
    p = make_problem(seed=5, seqlens=(21, 17), hq=2, hkv=1, dqk=4, dv=3, hidden=3)
    kw = dict(cu_seqlens=p.cu, config=SMALL)
    o, aux = run(p)
    rng = np.random.default_rng(6)
    d_o = rng.standard_normal(o.shape)
    grads = nsa.attention_backward(p.q, p.k, p.v, p.g, p.phi_k, p.phi_v, aux.lse, aux.indices, d_o, **kw)
    flat_inputs = [p.q, *p.kv6, p.g, *p.phi_k, *p.phi_v]
    flat_grads = [grads.dq, grads.dk[0], grads.dv[0], grads.dk[1], grads.dv[1], grads.dk[2], grads.dv[2], grads.dg,
                  *grads.dphi_k, *grads.dphi_v]
    directions = [rng.standard_normal(x.shape) for x in flat_inputs]
    eps = 1e-6

    def loss(sign):
        moved = [x + sign * eps * u for x, u in zip(flat_inputs, directions)]
        kv = moved[1:7]
        o_moved = nsa.attention(moved[0], (kv[0], kv[2], kv[4]), (kv[1], kv[3], kv[5]), moved[7],
                                nsa.Phi(*moved[8:13]), nsa.Phi(*moved[13:18]), **kw)
        return float((o_moved * d_o).sum())

    numeric = (loss(1) - loss(-1)) / (2 * eps)
    analytic = sum(float((gr * u).sum()) for gr, u in zip(flat_grads, directions))
    assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic))
    # The same indices as the unperturbed forward: the check did not straddle a selection change.
    _, aux_moved = run(p)
    np.testing.assert_array_equal(aux_moved.indices, aux.indices)


def test_backward_takes_the_branch_outputs():
    """attention_backward with the forward's branch outputs: the same gradients (the CPU backends
    do not need them); a wrong shape is an error naming o_branch."""
    p = make_problem(seed=8, seqlens=(21, 17), hq=2, hkv=1, dqk=4, dv=3, hidden=3)
    kw = dict(cu_seqlens=p.cu, config=SMALL)
    r = nsa.attention_branches(p.q, p.k, p.v, p.g, p.phi_k, p.phi_v, **kw)
    d_o = np.random.default_rng(9).standard_normal(r.o.shape)
    plain = nsa.attention_backward(p.q, p.k, p.v, p.g, p.phi_k, p.phi_v, r.lse, r.indices, d_o, **kw)
    kept = nsa.attention_backward(p.q, p.k, p.v, p.g, p.phi_k, p.phi_v, r.lse, r.indices, d_o,
                                  o_branch=r.o_branch, **kw)
    np.testing.assert_array_equal(plain.dq, kept.dq)
    np.testing.assert_array_equal(plain.dg, kept.dg)
    with pytest.raises(nsa.Error, match="o_branch"):
        nsa.attention_backward(p.q, p.k, p.v, p.g, p.phi_k, p.phi_v, r.lse, r.indices, d_o,
                               o_branch=r.o_branch[:2], **kw)


def test_dense_attention_and_its_gradient():
    p = make_problem(seed=7, seqlens=(12, 0, 9), hq=4, hkv=2, dqk=5, dv=5)
    k, v = p.kv6[0], p.kv6[1]
    o, lse = nsa.dense_attention(p.q, k, v, cu_seqlens=p.cu, return_lse=True)
    o_ref, lse_ref = oracle.dense(p.q, k, v, 1 / np.sqrt(5), p.cu)
    np.testing.assert_allclose(o, o_ref, rtol=F64_TOL, atol=F64_TOL)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-6)
    d_o = np.random.default_rng(8).standard_normal(o.shape)
    dq, dk, dv = nsa.dense_attention_backward(p.q, k, v, o, lse, d_o, cu_seqlens=p.cu)
    u = np.random.default_rng(9).standard_normal(k.shape)
    eps = 1e-6
    f = [float((nsa.dense_attention(p.q, k + s * eps * u, v, cu_seqlens=p.cu) * d_o).sum()) for s in (1, -1)]
    assert abs((f[0] - f[1]) / (2 * eps) - float((dk * u).sum())) < 1e-6


def test_strided_and_reversed_inputs_give_the_same_result():
    p = make_problem(seed=10, seqlens=(33,))
    o_ref, _ = run(p)
    # q as a [Hq, T, D] array transposed: non-contiguous in dims 0 and 1, last dim contiguous.
    q_t = np.ascontiguousarray(p.q.transpose(1, 0, 2)).transpose(1, 0, 2)
    # k_cmp seen through negative strides (the binding copies those).
    k_rev = np.ascontiguousarray(p.kv6[0][::-1])[::-1]
    # g with a non-unit last stride.
    g_wide = np.zeros(p.g.shape[:2] + (6,))
    g_wide[..., ::2] = p.g
    o, _ = nsa.attention(q_t, (k_rev, p.kv6[2], p.kv6[4]), p.v, g_wide[..., ::2], p.phi_k, p.phi_v, config=SMALL,
                         return_aux=True)
    np.testing.assert_array_equal(o, o_ref)


def test_read_only_and_broadcast_inputs():
    p = make_problem(seed=18, seqlens=(33,))
    g_row = p.g[:1]
    expected = nsa.attention(p.q, p.k, p.v, np.repeat(g_row, p.q.shape[0], axis=0), p.phi_k, p.phi_v, config=SMALL)
    q_ro = p.q.copy()
    q_ro.setflags(write=False)
    g_broadcast = np.broadcast_to(g_row, p.g.shape)  # read-only, stride 0 along tokens
    o = nsa.attention(q_ro, p.k, p.v, g_broadcast, p.phi_k, p.phi_v, config=SMALL)
    np.testing.assert_array_equal(o, expected)


def test_cu_seqlens_from_a_list():
    p = make_problem(seed=11, seqlens=(10, 14))
    o_ref, _ = run(p)
    o = nsa.attention(p.q, p.k, p.v, p.g, p.phi_k, p.phi_v, cu_seqlens=[0, 10, 24], config=SMALL)
    np.testing.assert_array_equal(o, o_ref)


def test_config_fields_as_keywords():
    p = make_problem(seed=12)
    a = nsa.attention(p.q, p.k, p.v, p.g, p.phi_k, p.phi_v, config=SMALL)
    b = nsa.attention(p.q, p.k, p.v, p.g, p.phi_k, p.phi_v, cmp_block_len=8, cmp_stride=4, slc_block_len=16,
                      n_selected=3, n_init=1, n_local=1, window=12)
    np.testing.assert_array_equal(a, b)


ERRORS = [
    # (what to break, expected parameter in the message)
    (dict(config=nsa.Config(cmp_stride=5)), "cmp_stride"),
    (dict(config=dataclasses.replace(SMALL, n_init=3, n_local=2)), "n_init + n_local"),
    (dict(cu_seqlens=np.array([0, 10, 30], dtype=np.int32)), "cu_seqlens[2]"),
    (dict(backend="gpu"), "backend"),
    (dict(backend="cuda"), "ctx.backend"),
    (dict(window=-1), "window"),
    (dict(colour=3), "colour"),
]


@pytest.mark.parametrize("change,parameter", ERRORS, ids=[e[1] for e in ERRORS])
def test_errors_name_the_parameter(change, parameter):
    p = make_problem(seed=13)
    kw = dict(config=SMALL)
    kw.update(change)
    with pytest.raises(nsa.Error) as info:
        nsa.attention(p.q, p.k, p.v, p.g, p.phi_k, p.phi_v, **kw)
    assert isinstance(info.value, ValueError)
    assert parameter in str(info.value)
    assert str(info.value).startswith("nsa: invalid ")


def test_shape_and_dtype_errors():
    p = make_problem(seed=14)
    with pytest.raises(nsa.Error, match=r"g\.shape\[2\]"):
        nsa.attention(p.q, p.k, p.v, p.g[..., :2], p.phi_k, p.phi_v, config=SMALL)
    with pytest.raises(nsa.Error, match=r"k_slc\.dtype"):
        nsa.attention(p.q, (p.kv6[0], p.kv6[2].astype(np.float32), p.kv6[4]), p.v, p.g, p.phi_k, p.phi_v,
                      config=SMALL)
    with pytest.raises(nsa.Error, match="phi_v"):
        nsa.attention(p.q, p.k, p.v, p.g, p.phi_k, None, config=SMALL)
    with pytest.raises(nsa.Error) as info:
        nsa.attention(p.q, p.k, p.v, p.g, p.phi_k._replace(pe=p.phi_k.pe[:3]), p.phi_v, config=SMALL)
    assert info.value.parameter == "phi_k.pe.shape[0]" and info.value.value == "3"
    with pytest.raises(nsa.Error, match="q.ndim"):
        nsa.attention(p.q[0], p.k, p.v, p.g, p.phi_k, p.phi_v, config=SMALL)


def float32_backends():
    return [b for b in ("reference", "cpu") if nsa.backend_available(b)]


@pytest.mark.parametrize("backend", ["auto"] + float32_backends())
def test_float32_against_float64(backend):
    """Error of float32 against the float64 oracle is within 2x that of the plain float32 oracle
    (plus a small floor), on every row whose selected blocks agree with the oracle's."""
    p = make_problem(seed=15, seqlens=(60, 0, 35), hq=4, hkv=1, dqk=16, dv=16, hidden=8)
    o64, _, idx64, _ = run_oracle(p)
    p32 = p.astype(np.float32)
    o32_plain, _, idx32_plain, _ = run_oracle(p32)
    o, aux = run(p32, backend=backend)
    assert o.dtype == np.float32
    same = (aux.indices == idx64).all(axis=(1, 2))
    assert same.mean() >= 0.95, f"only {same.mean():.2%} of rows selected the oracle's blocks"
    err = np.abs(o[same].astype(np.float64) - o64[same]).max()
    plain_same = same & (idx32_plain == idx64).all(axis=(1, 2))
    err_plain = np.abs(o32_plain[plain_same].astype(np.float64) - o64[plain_same]).max()
    assert err <= 2 * err_plain + 1e-6, (err, err_plain)


def test_unavailable_backend_says_so():
    p = make_problem(seed=16)
    for backend in ("cpu", "cuda"):
        if nsa.backend_available(backend):
            continue
        with pytest.raises(nsa.Error, match="ctx.backend"):
            nsa.attention(p.q.astype(np.float32), p.k, p.v, p.g, p.phi_k, p.phi_v, config=SMALL, backend=backend)


def test_workspaces_are_aligned_and_sized():
    """The package allocates what workspace_size asks for, 256-byte aligned (api.h)."""
    from nsa import _arrays, _nsa

    fw = _arrays.NumpyArrays()
    for nbytes in (1, 255, 4096, 12345):
        ws = fw.workspace(nbytes, None)
        assert ws.nbytes == nbytes and ws.ctypes.data % 256 == 0
    for backend in ["reference"] + (["cpu"] if nsa.backend_available("cpu") else []):
        size = _nsa.workspace_size("forward", backend, 0, SMALL.native("mlp"), 200, 2, 150, 8, 2, 64, 64, 32,
                                   "f32", "cpu")
        assert size >= 0


@pytest.mark.skipif(not nsa.backend_available("cpu"), reason="the CPU backend is not in this build")
def test_results_do_not_depend_on_thread_count():
    p = make_problem(seed=17, seqlens=(70, 33), hq=4, hkv=2, dqk=16, dv=16, hidden=8).astype(np.float32)
    # At most the machine's threads: the CPU backend sizes its workspace for OpenMP's default
    # thread count (BackendOps::workspace_size does not see ctx.num_threads).
    outs = [run(p, backend="cpu", num_threads=n) for n in (1, min(2, os.cpu_count() or 1), 0)]
    for o, aux in outs[1:]:
        np.testing.assert_array_equal(o, outs[0][0])
        np.testing.assert_array_equal(aux.indices, outs[0][1].indices)
