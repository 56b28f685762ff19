"""The package on CUDA tensors (skipped without a GPU or without the CUDA backend in the build).

Against the fp64 reference on the host, run on the same (rounded) inputs; the CUDA backend
stores bf16/f16 with Dqk, Dv in {64, 128, 192} x {64, 128} and G in {1, 2, 4, 8, 16} (docs/cuda.md).
Tolerance: at most twice the error of the CPU backend on the same low-precision inputs, plus two
units in the last place of the largest output, on rows whose selected blocks agree with the
reference's (and they must agree on nearly all rows: top-n is discontinuous at near-ties).
"""
from __future__ import annotations

import pytest

from conftest import has_torch

if not has_torch():
    pytest.skip("PyTorch is not installed", allow_module_level=True)

import torch  # noqa: E402

import nsa  # noqa: E402

if not torch.cuda.is_available() or not nsa.backend_available("cuda"):
    pytest.skip("no CUDA device, or nsa was built without the CUDA backend", allow_module_level=True)

CFG = nsa.Config(cmp_block_len=32, cmp_stride=16, slc_block_len=64, n_selected=4, n_init=1, n_local=2, window=96)
# Units in the last place of bf16 / f16 (8 / 11 significant bits).
ULP = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def problem(dtype, seqlens=(300, 0, 170), hq=8, hkv=2, d=64, phi="mlp", hidden=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(seqlens)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).cuda()

    l = CFG.cmp_block_len
    q = r(T, hq, d)
    kv = [r(T, hkv, d) for _ in range(6)]
    gates = torch.rand(T, hq, 3, generator=g, dtype=torch.float64).to(dtype).cuda()
    phis = []
    for _ in range(2):
        if phi == "mean":
            phis.append(None)
        else:
            phis.append(nsa.Phi(w1=r(hidden, l * d, scale=(l * d) ** -0.5), b1=r(hidden, scale=0.1),
                                w2=r(d, hidden, scale=hidden ** -0.5), b2=r(d, scale=0.1), pe=r(l, d, scale=0.3)))
    cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32)
    return q, kv, gates, phis[0], phis[1], cu


def host(x, dtype=torch.float64):
    if x is None:
        return None
    if isinstance(x, nsa.Phi):
        return nsa.Phi(*[host(p, dtype) for p in x])
    if isinstance(x, (list, tuple)):
        return type(x)(host(p, dtype) for p in x)
    return x.detach().cpu().to(dtype)


def run(q, kv, g, pk, pv, cu, **kw):
    return nsa.attention(q, (kv[0], kv[2], kv[4]), (kv[1], kv[3], kv[5]), g, pk, pv, cu_seqlens=cu, config=CFG,
                         return_aux=True, **kw)


def max_err(a, b, rows):
    return (a.double().cpu()[rows] - b.double().cpu()[rows]).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("phi", ["mlp", "mean"])
def test_forward_against_reference(dtype, phi):
    q, kv, g, pk, pv, cu = problem(dtype, phi=phi)
    o, aux = run(q, kv, g, pk, pv, cu)
    assert o.is_cuda and o.dtype == dtype
    o_ref, aux_ref = run(*[host(x) for x in (q, kv, g, pk, pv)], cu)
    same = (aux.indices.cpu() == aux_ref.indices).all(dim=2).all(dim=1)
    assert same.float().mean() >= 0.95, f"{same.float().mean():.2%} of rows agree with the reference's blocks"
    err = max_err(o, o_ref, same)
    floor = 2 * ULP[dtype] * o_ref.abs().max().item()
    if nsa.backend_available("cpu"):
        o_cpu, aux_cpu = run(*[host(x, dtype) for x in (q, kv, g, pk, pv)], cu, backend="cpu")
        same_cpu = same & (aux_cpu.indices == aux_ref.indices).all(dim=2).all(dim=1)
        err_cpu = max_err(o_cpu, o_ref, same_cpu)
    else:
        err_cpu = 0.0
    assert err <= 2 * err_cpu + floor, (err, err_cpu, floor)


@pytest.mark.parametrize("kept", ["o", "o_cmp", "o_cmp_win", "o_win", "o_branch"])
def test_backward_against_reference(kept):
    # What the forward keeps for the backward besides o: nothing (every dg recomputed), the
    # compressed branch's output (its dg from it), the compressed and window branches' (no branch
    # output recomputed; the default), the window's alone, or every branch's output (each dg from
    # them).
    dtype = torch.bfloat16
    q, kv, g, pk, pv, cu = problem(dtype, seqlens=(200, 90))
    leaves = [q, *kv, g, *pk, *pv]
    for x in leaves:
        x.requires_grad_()
    o, aux = run(q, kv, g, pk, pv, cu, save_branch_outputs=kept == "o_branch",
                 save_cmp_output=kept in ("o_cmp", "o_cmp_win"), save_win_output=kept in ("o_win", "o_cmp_win"))
    d_o = torch.randn_like(o)
    o.backward(d_o)
    # The reference's gradients for the same selected blocks.
    hq, hkv, hg, hpk, hpv = (host(x) for x in (q, kv, g, pk, pv))
    ref = nsa.attention_backward(hq, (hkv[0], hkv[2], hkv[4]), (hkv[1], hkv[3], hkv[5]), hg, hpk, hpv,
                                 aux.lse.cpu(), aux.indices.cpu(), host(d_o), cu_seqlens=cu, config=CFG)
    ref_list = [ref.dq, ref.dk[0], ref.dv[0], ref.dk[1], ref.dv[1], ref.dk[2], ref.dv[2], ref.dg, *ref.dphi_k,
                *ref.dphi_v]
    names = ["dq", "dk_cmp", "dv_cmp", "dk_slc", "dv_slc", "dk_win", "dv_win", "dg"] + \
            [f"dphi_k.{n}" for n in nsa.Phi._fields] + [f"dphi_v.{n}" for n in nsa.Phi._fields]
    def group_scale(name):
        # phi's parameters are measured on the scale of all of that phi's gradients: dphi_k.b2 is
        # zero in exact arithmetic (softmax ignores a shift shared by every compressed key), so a
        # bf16 backward leaves only cancellation noise there, of the size of its siblings' rounding.
        if name.startswith("dphi_"):
            prefix = name.split(".")[0]
            return max(r.abs().max().item() for n, r in zip(names, ref_list) if n.startswith(prefix + "."))
        return None

    for name, x, r in zip(names, leaves, ref_list):
        err = (x.grad.double().cpu() - r).abs().max().item()
        scale = group_scale(name) or r.abs().max().item()
        # bf16 gradients summed over hundreds of keys: this checks the wiring (a wrong or swapped
        # gradient is off by O(scale)); the CUDA suite measures the kernels' accuracy itself.
        assert err <= 0.02 * scale + 1e-4, (name, err, scale)


@pytest.mark.parametrize("phi", ["mlp", "linear", "mean"])
def test_compress_autograd_against_reference(phi):
    """nsa.compress on CUDA tensors through autograd (the CUDA compress_bwd: dx and phi's gradients)
    against the same on the fp64 reference."""
    dtype = torch.bfloat16
    _, kv, _, pk, _, cu = problem(dtype, seqlens=(200, 0, 90), phi="mean" if phi == "mean" else "mlp")
    if phi == "linear":  # w1 = W [D, l * D] and pe only
        D, ld = kv[0].shape[2], CFG.cmp_block_len * kv[0].shape[2]
        w = torch.randn(D, ld, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * ld ** -0.5
        pk = nsa.Phi(w1=w.to(dtype).cuda(), b1=None, w2=None, b2=None, pe=pk.pe)
    x = kv[0].clone().requires_grad_()
    params = [] if pk is None else [p.requires_grad_() for p in pk if p is not None]
    xc = nsa.compress(x, pk, cu_seqlens=cu, config=CFG)
    dxc = torch.randn_like(xc)
    xc.backward(dxc)
    hx = host(x).requires_grad_()
    hpk = host(pk)
    hparams = [] if hpk is None else [p.requires_grad_() for p in hpk if p is not None]
    ref = nsa.compress(hx, hpk, cu_seqlens=cu, config=CFG)
    ref.backward(host(dxc))
    assert xc.is_cuda and xc.dtype == dtype
    for name, got, want in [("xc", xc, ref), ("dx", x.grad, hx.grad)] + \
            [(f"dphi[{i}]", p.grad, h.grad) for i, (p, h) in enumerate(zip(params, hparams))]:
        assert got is not None and want is not None, name
        err = (got.detach().double().cpu() - want.detach()).abs().max().item()
        scale = want.abs().max().item()
        assert err <= 0.02 * scale + 1e-4, (name, err, scale)


def test_streams_and_device_offsets():
    """The library runs on the current stream; device cu_seqlens need max_seqlen; host ones are moved."""
    q, kv, g, pk, pv, cu = problem(torch.bfloat16)
    o_default, _ = run(q, kv, g, pk, pv, cu)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        o_side, _ = run(q, kv, g, pk, pv, cu)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(o_side, o_default, rtol=0, atol=0)
    with pytest.raises(nsa.Error, match="max_seqlen"):
        run(q, kv, g, pk, pv, cu.cuda())
    o_dev, _ = run(q, kv, g, pk, pv, cu.cuda(), max_seqlen=300)
    torch.testing.assert_close(o_dev, o_default, rtol=0, atol=0)


def test_module_on_cuda():
    torch.manual_seed(0)
    m = nsa.NativeSparseAttention(512, num_heads=8, num_kv_heads=2, head_dim=64, config=CFG, device="cuda",
                                  dtype=torch.bfloat16)
    x = torch.randn(2, 256, 512, device="cuda", dtype=torch.bfloat16)
    y = m(x)
    y.float().square().mean().backward()
    assert y.is_cuda and torch.isfinite(y.float()).all()
    assert all(p.grad is not None and torch.isfinite(p.grad.float()).all() for p in m.parameters())


def test_torch_compile_on_cuda():
    """The operators trace on CUDA tensors too (fake implementations on the device)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = nsa.NativeSparseAttention(256, num_heads=4, num_kv_heads=2, head_dim=64, config=CFG, device="cuda",
                                  dtype=torch.bfloat16)
    x = torch.randn(200, 256, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), m(x), rtol=0, atol=0)


def test_layer_decode_on_cuda_matches_prefill_and_replays_as_a_cuda_graph():
    """The layer's decode with a fixed cache on the GPU: steps equal the prefill's rows (bf16
    tolerance, rows whose selection agrees); a step captured with torch.cuda.graph replays the eager
    steps' bits (lengths advance on the device at each replay)."""
    torch.manual_seed(0)
    m = nsa.NativeSparseAttention(512, num_heads=8, num_kv_heads=2, head_dim=64, config=CFG, device="cuda",
                                  dtype=torch.bfloat16).eval()
    x = torch.randn(2, 420, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        full = m(x)
        eager, graphed = nsa.NSACache.allocate(m, 2, 512), nsa.NSACache.allocate(m, 2, 512)
        for cache in (eager, graphed):  # the prompt, and one eager step (warms up every kernel)
            m(x[:, :300], cache=cache)
            m(x[:, 300:301], cache=cache)
        static_x = x[:, 301:302].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):  # records a step; runs nothing
            static_y = m(static_x, cache=graphed)
        torch.cuda.synchronize()
        scale = full.float().abs().max().item()
        for t in range(301, 420):
            y = m(x[:, t:t + 1], cache=eager)
            err = (y.float() - full[:, t:t + 1].float()).abs().max().item()
            assert err <= 0.03 * scale, (t, err, scale)
            static_x.copy_(x[:, t:t + 1])
            graph.replay()
            torch.testing.assert_close(static_y, y, rtol=0, atol=0)
        eager.check()
        graphed.check()
        assert graphed.seq_lens.tolist() == [420, 420]
