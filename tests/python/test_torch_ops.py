"""The torch operators: gradcheck in float64, opcheck (schema, fake tensors, autograd
registration, AOT dispatch), agreement with the numpy path and the oracle."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import SMALL, has_torch, make_problem

if not has_torch():
    pytest.skip("PyTorch is not installed", allow_module_level=True)

import torch  # noqa: E402

import nsa  # noqa: E402
import oracle  # noqa: E402
from nsa import torch_ops  # noqa: E402,F401  (registers torch.ops.nsa.*)

# A configuration with small blocks so that gradcheck's problems stay tiny: l = 4, d = 2, l' = 4.
TINY = nsa.Config(cmp_block_len=4, cmp_stride=2, slc_block_len=4, n_selected=3, n_init=1, n_local=1, window=3)


def to_torch(p, requires_grad=False):
    def t(x):
        return None if x is None else torch.tensor(x, requires_grad=requires_grad)

    def t_phi(phi):
        return None if phi is None else nsa.Phi(*[t(x) for x in phi])

    cu = None if p.cu is None else torch.tensor(p.cu)
    return t(p.q), tuple(t(x) for x in p.kv6), t(p.g), t_phi(p.phi_k), t_phi(p.phi_v), cu


def split(kv6):
    if kv6[2] is None:
        return kv6[0], kv6[1]
    return (kv6[0], kv6[2], kv6[4]), (kv6[1], kv6[3], kv6[5])


GRAD_CASES = {
    "mlp_per_branch_packed": (TINY, dict(seqlens=(9, 0, 11), phi="mlp")),
    "linear_shared": (TINY, dict(seqlens=(13,), phi="linear", shared=True)),
    "mean_G1_window_off": (dataclasses.replace(TINY, window=0), dict(seqlens=(10,), phi="mean", hq=2, hkv=2)),
}


@pytest.mark.parametrize("name", sorted(GRAD_CASES))
def test_forward_gradcheck(name):
    cfg, args = GRAD_CASES[name]
    p = make_problem(seed=20 + len(name), cfg=cfg, hq=args.pop("hq", 2), hkv=args.pop("hkv", 1), dqk=3, dv=2,
                     hidden=3, **args)
    q, kv6, g, phi_k, phi_v, cu = to_torch(p, requires_grad=True)
    phi_k_list = list(phi_k) if phi_k else []
    phi_v_list = list(phi_v) if phi_v else []
    kv_present = [x for x in kv6 if x is not None]
    inputs = (q, *kv_present, g, *phi_k_list, *phi_v_list)

    def f(*xs):
        it = iter(xs)
        q_ = next(it)
        kv = [next(it) if x is not None else None for x in kv6]
        g_ = next(it)
        pk = nsa.Phi(*[next(it) for _ in phi_k_list]) if phi_k else None
        pv = nsa.Phi(*[next(it) for _ in phi_v_list]) if phi_v else None
        k, v = split(kv)
        return nsa.attention(q_, k, v, g_, pk, pv, cu_seqlens=cu, config=cfg)

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("phi", ["mlp", "linear", "mean"])
def test_compress_gradcheck(phi):
    p = make_problem(seed=30, cfg=TINY, seqlens=(7, 10), hq=2, hkv=2, dqk=3, dv=3, hidden=2, phi=phi)
    q, kv6, g, phi_k, _, cu = to_torch(p, requires_grad=True)
    params = list(phi_k) if phi_k else []

    def f(x, *ps):
        return nsa.compress(x, nsa.Phi(*ps) if ps else None, cu_seqlens=cu, config=TINY)

    assert torch.autograd.gradcheck(f, (kv6[0], *params), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_dense_gradcheck():
    p = make_problem(seed=31, seqlens=(6, 5), hq=2, hkv=1, dqk=3, dv=2)
    q, kv6, _, _, _, cu = to_torch(p, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: nsa.dense_attention(a, b, c, cu_seqlens=cu),
                                    (q, kv6[0], kv6[1]), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_can_fail():
    """gradcheck notices a wrong gradient: scale the library's dq by 1.001."""
    p = make_problem(seed=32, cfg=TINY, seqlens=(9,), hq=2, hkv=1, dqk=3, dv=2, hidden=3)
    q, kv6, g, phi_k, phi_v, _ = to_torch(p, requires_grad=True)
    k, v = split(kv6)

    class Scaled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * 1.001

    f = lambda q_: nsa.attention(Scaled.apply(q_), k, v, g, phi_k, phi_v, config=TINY)  # noqa: E731
    assert not torch.autograd.gradcheck(f, (q,), eps=1e-6, atol=1e-7, rtol=1e-5, raise_exception=False)


def test_torch_matches_numpy_and_oracle():
    p = make_problem(seed=33, seqlens=(30, 0, 25))
    q, kv6, g, phi_k, phi_v, cu = to_torch(p)
    k, v = split(kv6)
    o, aux = nsa.attention(q, k, v, g, phi_k, phi_v, cu_seqlens=cu, config=SMALL, return_aux=True)
    o_np, aux_np = nsa.attention(p.q, p.k, p.v, p.g, p.phi_k, p.phi_v, cu_seqlens=p.cu, config=SMALL, return_aux=True)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.float64
    np.testing.assert_array_equal(o.numpy(), o_np)
    np.testing.assert_array_equal(aux.indices.numpy(), aux_np.indices)
    o_ref = oracle.forward(SMALL, p.q, p.kv6, p.g, p.phi_k, p.phi_v, p.cu)[0]
    np.testing.assert_allclose(o.numpy(), o_ref, rtol=1e-11, atol=1e-11)


def test_stage_operators_match_numpy():
    p = make_problem(seed=34, seqlens=(40,))
    q, kv6, g, phi_k, phi_v, _ = to_torch(p)
    kc = nsa.compress(kv6[0], phi_k, config=SMALL)
    vc = nsa.compress(kv6[1], phi_v, config=SMALL)
    o_c, lse_c, S = nsa.compressed_attention(q, kc, vc, config=SMALL)
    idx = nsa.select_topn(S, config=SMALL)
    o_s, _ = nsa.selected_attention(q, kv6[2], kv6[3], idx, config=SMALL)
    o_w, _ = nsa.window_attention(q, kv6[4], kv6[5], config=SMALL)
    o = g[..., 0:1] * o_c + g[..., 1:2] * o_s + g[..., 2:3] * o_w
    k, v = split(kv6)
    np.testing.assert_allclose(o.numpy(), nsa.attention(q, k, v, g, phi_k, phi_v, config=SMALL).numpy(),
                               rtol=1e-12, atol=1e-12)


def test_backward_of_shared_kv_sums_the_branches():
    p = make_problem(seed=35, seqlens=(20,), phi="mean", shared=True)
    q, kv6, g, _, _, _ = to_torch(p, requires_grad=True)
    nsa.attention(q, kv6[0], kv6[1], g, config=SMALL).square().sum().backward()
    shared_grad = kv6[0].grad.clone()
    k3 = [kv6[0].detach().clone().requires_grad_() for _ in range(3)]
    v3 = [kv6[1].detach().clone() for _ in range(3)]
    nsa.attention(q.detach(), tuple(k3), tuple(v3), g.detach(), config=SMALL).square().sum().backward()
    torch.testing.assert_close(shared_grad, k3[0].grad + k3[1].grad + k3[2].grad, rtol=1e-12, atol=1e-12)


def test_empty_batch_forward_and_backward():
    p = make_problem(seed=42, seqlens=(0, 0))
    q, kv6, g, phi_k, phi_v, cu = to_torch(p, requires_grad=True)
    k, v = split(kv6)
    o = nsa.attention(q, k, v, g, phi_k, phi_v, cu_seqlens=cu, config=SMALL)
    assert o.shape == (0, 4, 6)
    o.sum().backward()
    assert q.grad.shape == q.shape and phi_k.w1.grad.abs().sum() == 0


def test_saved_branch_outputs_give_the_same_gradients():
    # The CPU backends ignore the kept branch outputs: the gradients must be identical, and the
    # operator must return them with their shape.
    p = make_problem(seed=41, seqlens=(9, 13), phi="mlp")
    grads = []
    for save in (False, True):
        q, kv6, g, phi_k, phi_v, cu = to_torch(p, requires_grad=True)
        k, v = split(kv6)
        nsa.attention(q, k, v, g, phi_k, phi_v, cu_seqlens=cu, config=SMALL,
                      save_branch_outputs=save).square().sum().backward()
        grads.append([x.grad for x in (q, *[x for x in kv6 if x is not None], g, *phi_k, *phi_v)])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    q, kv6, g, phi_k, phi_v, cu = to_torch(p)
    outs = torch.ops.nsa.forward(q, *kv6, g, *phi_k, *phi_v, cu, 0, SMALL.ints(), 0.0, "auto", 0, True)
    assert outs[3].shape == (3, q.shape[0], q.shape[1], kv6[1].shape[2])
    # save_cmp: the fourth output is the compressed branch's output alone, o_branch[0] bit for bit
    # (save_branches, when both are asked, keeps all three).
    kept = torch.ops.nsa.forward(q, *kv6, g, *phi_k, *phi_v, cu, 0, SMALL.ints(), 0.0, "auto", 0, False, None, 0,
                                 True)[3]
    assert kept.shape == (q.shape[0], q.shape[1], kv6[1].shape[2])
    assert torch.equal(kept, outs[3][0])
    both = torch.ops.nsa.forward(q, *kv6, g, *phi_k, *phi_v, cu, 0, SMALL.ints(), 0.0, "auto", 0, True, None, 0,
                                 True)[3]
    assert torch.equal(both, outs[3])
    # save_win: the window branch's output, o_branch[2]; with save_cmp both, [2, T, Hq, Dv] in
    # branch order; save_branches keeps all three whatever else is asked.
    win = torch.ops.nsa.forward(q, *kv6, g, *phi_k, *phi_v, cu, 0, SMALL.ints(), 0.0, "auto", 0, False, None, 0,
                                False, True)[3]
    assert win.shape == kept.shape and torch.equal(win, outs[3][2])
    pair = torch.ops.nsa.forward(q, *kv6, g, *phi_k, *phi_v, cu, 0, SMALL.ints(), 0.0, "auto", 0, False, None, 0,
                                 True, True)[3]
    assert pair.shape == (2, *kept.shape) and torch.equal(pair, outs[3][0::2])
    every = torch.ops.nsa.forward(q, *kv6, g, *phi_k, *phi_v, cu, 0, SMALL.ints(), 0.0, "auto", 0, True, None, 0,
                                  True, True)[3]
    assert torch.equal(every, outs[3])


def test_saved_compressed_output_gives_the_same_gradients():
    # The backward op given o_cmp (the CPU backends ignore it): the same gradients.
    p = make_problem(seed=43, seqlens=(9, 13), phi="mlp")
    q, kv6, g, phi_k, phi_v, cu = to_torch(p)
    o, lse, idx, o_cmp = torch.ops.nsa.forward(q, *kv6, g, *phi_k, *phi_v, cu, 0, SMALL.ints(), 0.0, "auto", 0,
                                               False, None, 0, True)
    d_o = torch.randn_like(o)
    args = (q, *kv6, g, *phi_k, *phi_v, cu, 0, SMALL.ints(), 0.0, "auto", 0, lse, idx, None, d_o, o)
    plain = torch.ops.nsa.backward(*args)
    with_cmp = torch.ops.nsa.backward(*args, None, 0, o_cmp)
    for a, b in zip(plain, with_cmp):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # And o_win, alone and beside o_cmp.
    o_win = torch.ops.nsa.forward(q, *kv6, g, *phi_k, *phi_v, cu, 0, SMALL.ints(), 0.0, "auto", 0,
                                  False, None, 0, False, True)[3]
    for kept in ((None, o_win), (o_cmp, o_win)):
        for a, b in zip(plain, torch.ops.nsa.backward(*args, None, 0, *kept)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kept", [(False, True), (True, True), (True, False)])
def test_kept_outputs_reach_the_backward_through_autograd(kept):
    # The autograd wiring of the kept compressed / window outputs (nsa.attention keeps them on CUDA
    # only; the op itself takes the flags on any device, and the CPU backends ignore the planes):
    # the gradients are those without anything kept.
    p = make_problem(seed=47, seqlens=(9, 13), phi="mlp")
    grads = []
    for flags in ((False, False), kept):
        q, kv6, g, phi_k, phi_v, cu = to_torch(p, requires_grad=True)
        outs = torch.ops.nsa.forward(q, *kv6, g, *phi_k, *phi_v, cu, 0, SMALL.ints(), 0.0, "auto", 0, False, None,
                                     0, *flags)
        outs[0].square().sum().backward()
        grads.append([x.grad for x in (q, *[x for x in kv6 if x is not None], g, *phi_k, *phi_v)])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_lse_and_indices_are_not_differentiable():
    p = make_problem(seed=36, seqlens=(20,), phi="mean")
    q, kv6, g, _, _, _ = to_torch(p, requires_grad=True)
    k, v = split(kv6)
    o, aux = nsa.attention(q, k, v, g, config=SMALL, return_aux=True)
    assert o.requires_grad and not aux.lse.requires_grad and not aux.indices.requires_grad


def _zero_fills_in_backward(out):
    """Shapes of the tensors zero-filled while out.sum() is differentiated."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        out.sum().backward()
    return [tuple(e.input_shapes[0]) for e in prof.events() if e.name == "aten::zero_" and e.input_shapes]


def test_backward_makes_no_zero_gradients_for_the_outputs_without_one():
    # lse, indices and the kept branch outputs (3x o) get no gradient: autograd must not make and
    # fill a zero tensor of each on every backward.
    p = make_problem(seed=38, seqlens=(9, 13), phi="mlp")
    q, kv6, g, phi_k, phi_v, cu = to_torch(p, requires_grad=True)
    k, v = split(kv6)
    o = nsa.attention(q, k, v, g, phi_k, phi_v, cu_seqlens=cu, config=SMALL, save_branch_outputs=True)
    T, Hq, Hkv, Dv = q.shape[0], q.shape[1], kv6[0].shape[1], o.shape[2]
    filled = _zero_fills_in_backward(o)
    for shape in ((T, Hq, 3), (T, Hkv, SMALL.n_selected), (3, T, Hq, Dv)):
        assert shape not in filled
    assert q.grad is not None and g.grad is not None
    o = nsa.dense_attention(q, kv6[0], kv6[1], cu_seqlens=cu)
    assert (T, Hq) not in _zero_fills_in_backward(o)


def _opcheck_args(p, cfg):
    q, kv6, g, phi_k, phi_v, cu = to_torch(p, requires_grad=True)
    phi = lambda x: list(x) if x is not None else [None] * 5  # noqa: E731
    return (q, *kv6, g, *phi(phi_k), *phi(phi_v), cu, 0, cfg.ints(), 0.0, "auto", 0, False)


def test_opcheck_forward():
    p = make_problem(seed=37, cfg=TINY, seqlens=(9, 6), hq=2, hkv=1, dqk=3, dv=2, hidden=3)
    torch.library.opcheck(torch.ops.nsa.forward.default, _opcheck_args(p, TINY))
    torch.library.opcheck(torch.ops.nsa.forward.default, _opcheck_args(p, TINY)[:-1] + (True,))
    torch.library.opcheck(torch.ops.nsa.forward.default, _opcheck_args(p, TINY) + (None, 0, True))
    p = make_problem(seed=38, cfg=TINY, seqlens=(11,), hq=2, hkv=1, dqk=3, dv=2, phi="mean", shared=True)
    torch.library.opcheck(torch.ops.nsa.forward.default, _opcheck_args(p, TINY))


def test_opcheck_other_operators():
    p = make_problem(seed=39, cfg=TINY, seqlens=(12,), hq=2, hkv=1, dqk=3, dv=2, hidden=3)
    q, kv6, g, phi_k, _, _ = to_torch(p, requires_grad=True)
    cfg = TINY.ints()
    torch.library.opcheck(torch.ops.nsa.compress.default, (kv6[0], *phi_k, None, 0, cfg, "auto", 0))
    torch.library.opcheck(torch.ops.nsa.dense_attention.default, (q, kv6[0], kv6[1], None, 0, 0.0, "auto", 0))
    qd, kd, vd = q.detach(), kv6[0].detach(), kv6[1].detach()
    kc = torch.ops.nsa.compress(kd, *[x.detach() for x in phi_k], None, 0, cfg, "auto", 0)
    torch.library.opcheck(torch.ops.nsa.compressed_attention.default, (qd, kc, kc[..., :2].contiguous(), None, 12, cfg,
                                                                        0.0, True, "auto", 0))
    _, _, S = torch.ops.nsa.compressed_attention(qd, kc, kc[..., :2].contiguous(), None, 12, cfg, 0.0, True, "auto", 0)
    torch.library.opcheck(torch.ops.nsa.select_topn.default, (S, None, 12, cfg, "auto", 0))
    idx = torch.ops.nsa.select_topn(S, None, 12, cfg, "auto", 0)
    torch.library.opcheck(torch.ops.nsa.selected_attention.default, (qd, kd, vd, idx, None, 0, cfg, 0.0, "auto", 0))
    torch.library.opcheck(torch.ops.nsa.window_attention.default, (qd, kd, vd, None, 0, cfg, 0.0, "auto", 0))


def test_errors_are_value_errors_from_torch():
    p = make_problem(seed=40)
    q, kv6, g, phi_k, phi_v, _ = to_torch(p)
    k, v = split(kv6)
    with pytest.raises(ValueError, match=r"g\.shape\[1\]"):
        nsa.attention(q, k, v, g[:, :2], phi_k, phi_v, config=SMALL)


def test_torch_compile_of_the_functional_api():
    p = make_problem(seed=41, seqlens=(30,), phi="linear")
    q, kv6, g, phi_k, phi_v, _ = to_torch(p)
    k, v = split(kv6)

    def f(q_, g_):
        return nsa.attention(torch.tanh(q_), k, v, g_ * 0.5, phi_k, phi_v, config=SMALL).sum(-1)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, g), f(q, g), rtol=1e-12, atol=1e-12)
