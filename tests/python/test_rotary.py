"""Rotary position embeddings (nsa.rotary, torch.ops.nsa.rotary, the layer's _rotate) against the
torch formula the layer used before them (kept here as the oracle): forward and gradients on the
CPU (f32, bf16, f16) and, with a GPU, on CUDA (bf16, f16: bit for bit); gradcheck in float64 on
the reference backend; positions from packed offsets against explicit ones; the numpy path;
opcheck and torch.compile; named errors; and the whole layer's output and gradients unchanged.

Tolerances on the CPU: the library takes cos and sin from the C library, torch from its own
vectorised functions; they differ by an ulp of fp32 now and then (about 5% of f32 outputs differ,
by at most a few fp32 ulps of |x|). After rounding to bf16 or f16 nearly every element is the same
bits; the rest differ by one ulp of the dtype. On CUDA both call the same cosf and sinf, so the bits
are the same."""
from __future__ import annotations

import types

import numpy as np
import pytest

from conftest import SMALL, has_torch

if not has_torch():
    pytest.skip("PyTorch is not installed", allow_module_level=True)

import torch  # noqa: E402

import nsa  # noqa: E402
from nsa import torch_ops  # noqa: E402,F401  (registers torch.ops.nsa.*)

HAS_CUDA = torch.cuda.is_available() and nsa.backend_available("cuda")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device (or no cuda backend)")


def inv_freq_of(D, theta=10000.0, device=None):
    return 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float32, device=device) / D))


def positions_of(cu, T, device=None):
    """Each token's place in its sequence of offsets cu (None: one sequence), as the layer computed it."""
    if cu is None:
        return torch.arange(T, device=device)
    cu = torch.as_tensor(cu, dtype=torch.int64, device=device)
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=T)
    return torch.arange(T, device=device) - starts


def rotate_by(x, angles):
    """x1 cos - x2 sin, x2 cos + x1 sin of x [T, H, D] by angles [T, D/2], in the angles' dtype."""
    cos, sin = torch.cos(angles)[:, None, :], torch.sin(angles)[:, None, :]
    x1, x2 = x.to(angles.dtype).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def old_rotate(x, positions, inv_freq):
    """The layer's formula before nsa::rotary (the oracle): cos and sin of fp32 angles (fp64 for fp64
    tensors), x1 cos - x2 sin, x2 cos + x1 sin, back to x's dtype."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    angles = positions.to(work)[:, None] * inv_freq.to(work)[None, :]  # [T, D/2]
    return rotate_by(x, angles).to(x.dtype)


def ideal_rotate(x, positions, inv_freq):
    """The formula on the fp32 angles that both sides compute, the rest in float64: which side strays,
    when the two disagree (a failure message)."""
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    return rotate_by(x.detach(), angles.double())


ULP = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def assert_like_the_formula(got, want, x, ideal=None):
    """CPU tolerance (module docstring): one ulp of the dtype at the value's magnitude, plus 4 fp32
    ulps of the largest |x| for products that nearly cancel; and nearly every element the same bits.
    ideal (float64, ideal_rotate): named in the message, each side's distance from it."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.double(), want.double()
    tol = ULP[got.dtype] * w.abs() + 4 * 2.0 ** -24 * float(x.detach().double().abs().max())
    bad = (g - w).abs() > tol
    if bad.any():
        where = ""
        if ideal is not None:
            where = (f"; from the float64 formula on the same angles: nsa {float((g - ideal).abs().max()):.3g}, "
                     f"torch {float((w - ideal).abs().max()):.3g}")
        pytest.fail(f"{int(bad.sum())} elements out of tolerance, worst {float((g - w).abs().max())}{where}")
    same = float((got == want).float().mean()) if got.numel() else 1.0
    assert same >= (0.9 if got.dtype == torch.float32 else 0.999), same


PACKED = [0, 100, 100, 101, 300]  # an empty and a one-token sequence


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("explicit", [False, True])
def test_op_matches_the_formula_on_the_cpu(dtype, explicit):
    torch.manual_seed(0)
    x = (2 * torch.randn(300, 5, 64)).to(dtype)
    f = inv_freq_of(64)
    if explicit:  # long positions too
        pos = torch.randint(0, 200_000, (300,))
        got = nsa.rotary(x, f, positions=pos)
    else:
        pos = positions_of(PACKED, 300)
        got = nsa.rotary(x, f, cu_seqlens=PACKED)
    assert_like_the_formula(got, old_rotate(x, pos, f), x, ideal_rotate(x, pos, f))
    # The inverse undoes it (up to the roundings of both passes).
    if dtype == torch.float32:
        back = nsa.rotary(got, f, positions=pos if explicit else None, cu_seqlens=None if explicit else PACKED,
                          inverse=True)
        torch.testing.assert_close(back, x, rtol=0, atol=1e-5)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_op_matches_the_formula_on_cuda_bit_for_bit(dtype):
    torch.manual_seed(0)
    x = (2 * torch.randn(3000, 9, 128, device="cuda")).to(dtype)
    f = inv_freq_of(128, device="cuda")
    cu = torch.tensor([0, 1000, 1000, 1001, 3000], dtype=torch.int32, device="cuda")
    pos = positions_of(cu, 3000, device="cuda")
    torch.testing.assert_close(nsa.rotary(x, f, cu_seqlens=cu), old_rotate(x, pos, f), rtol=0, atol=0)
    long_pos = torch.randint(0, 200_000, (3000,), device="cuda", dtype=torch.int32)
    torch.testing.assert_close(nsa.rotary(x, f, positions=long_pos), old_rotate(x, long_pos, f), rtol=0, atol=0)
    # Gradients: the backward's rotation by -angle against autograd through the formula.
    xr = x.clone().requires_grad_(True)
    xo = x.clone().requires_grad_(True)
    w = torch.randn_like(x)
    (nsa.rotary(xr, f, cu_seqlens=cu).float() * w.float()).sum().backward()
    (old_rotate(xo, pos, f).float() * w.float()).sum().backward()
    torch.testing.assert_close(xr.grad, xo.grad, rtol=0, atol=0)


def test_positions_from_offsets_equal_explicit_positions():
    torch.manual_seed(1)
    x = torch.randn(300, 3, 16)
    f = inv_freq_of(16)
    want = nsa.rotary(x, f, positions=positions_of(PACKED, 300))
    for cu in (PACKED, np.array(PACKED), torch.tensor(PACKED), torch.tensor(PACKED, dtype=torch.int32)):
        assert torch.equal(nsa.rotary(x, f, cu_seqlens=cu), want)
    # Positions win over offsets; one sequence counts from 0.
    assert torch.equal(nsa.rotary(x, f, positions=positions_of(PACKED, 300), cu_seqlens=[0, 300]), want)
    assert torch.equal(nsa.rotary(x, f), nsa.rotary(x, f, positions=torch.arange(300)))
    assert torch.equal(nsa.rotary(x[:1], f, positions=[0]), x[:1])  # position 0: the identity


def test_gradcheck_float64_on_the_reference_backend():
    torch.manual_seed(2)
    f = inv_freq_of(6)
    x = torch.randn(9, 3, 6, dtype=torch.float64, requires_grad=True)
    for kw in (dict(cu_seqlens=[0, 4, 4, 5, 9]), dict(positions=torch.tensor([7, 0, 3, 90000, 2, 2, 5, 1, 0])),
               dict(cu_seqlens=[0, 9], inverse=True)):
        def fn(t, kw=kw):
            return nsa.rotary(t, f, backend="reference", **kw)

        assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-9, rtol=1e-7)
        assert torch.autograd.gradgradcheck(fn, (x,), eps=1e-6, atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_autograd_through_the_formula(dtype):
    torch.manual_seed(3)
    x = (2 * torch.randn(300, 4, 32)).to(dtype)
    f = inv_freq_of(32)
    w = torch.randn(300, 4, 32)
    xr, xo = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    (nsa.rotary(xr, f, cu_seqlens=PACKED).float() * w).sum().backward()
    (old_rotate(xo, positions_of(PACKED, 300), f).float() * w).sum().backward()
    assert_like_the_formula(xr.grad, xo.grad, w)


def test_numpy_path_equals_the_torch_path():
    rng = np.random.default_rng(4)
    f = inv_freq_of(10).numpy()
    for dtype in (np.float32, np.float64):
        x = rng.standard_normal((40, 2, 10)).astype(dtype)
        pos = rng.integers(0, 100_000, 40)
        got = nsa.rotary(x, f, positions=pos)
        assert isinstance(got, np.ndarray) and got.dtype == dtype
        np.testing.assert_array_equal(got, nsa.rotary(torch.from_numpy(x), torch.from_numpy(f), positions=pos).numpy())
        back = nsa.rotary(got, f, positions=pos, inverse=True)
        np.testing.assert_allclose(back, x, rtol=0, atol=1e-5 if dtype == np.float32 else 1e-12)
        np.testing.assert_array_equal(nsa.rotary(x, f, cu_seqlens=[0, 15, 15, 40]),
                                      nsa.rotary(x, f, positions=positions_of([0, 15, 15, 40], 40).numpy()))


def test_opcheck_and_compile():
    torch.manual_seed(5)
    x = torch.randn(20, 3, 8, requires_grad=True)
    f = inv_freq_of(8)
    cu = torch.tensor([0, 7, 7, 20], dtype=torch.int32)
    pos = torch.arange(20, dtype=torch.int32) * 11
    for args in ((x, f, cu, None, False, "auto", 0), (x, f, None, pos, True, "auto", 0),
                 (x, f, None, None, False, "cpu", 1)):
        torch.library.opcheck(torch.ops.nsa.rotary.default, args)
    torch._dynamo.reset()

    def fn(t, c):
        return nsa.rotary(t, f, cu_seqlens=c) * 2

    compiled = torch.compile(fn, backend="aot_eager", dynamic=True, fullgraph=True)
    for T in (20, 33):
        xt = torch.randn(T, 3, 8)
        c = torch.tensor([0, 5, T], dtype=torch.int32)
        assert torch.equal(compiled(xt, c), fn(xt, c))


def test_rotary_into_writes_columns_of_a_wider_array():
    """torch.ops.nsa.rotary_into (the layer's backward writes q's and the keys' gradients with it):
    the rotation of nsa.rotary, bit for bit, into a strided view of a wider array whose other
    columns stay as they were; opcheck (its schema declares out mutated)."""
    torch.manual_seed(6)
    f = inv_freq_of(8)
    cu = torch.tensor([0, 7, 7, 20], dtype=torch.int32)
    x = torch.randn(20, 3, 8)
    for inverse in (False, True):
        wide = torch.randn(20, 40)
        before = wide.clone()
        out = wide[:, 5:29].view(20, 3, 8)
        torch.ops.nsa.rotary_into(x, f, cu, None, inverse, "auto", 0, out)
        assert torch.equal(out, nsa.rotary(x, f, cu_seqlens=cu, inverse=inverse))
        assert torch.equal(wide[:, :5], before[:, :5]) and torch.equal(wide[:, 29:], before[:, 29:])
    torch.library.opcheck(torch.ops.nsa.rotary_into.default, (x, f, cu, None, True, "auto", 0, torch.empty(20, 3, 8)))
    with pytest.raises(nsa.Error, match="out"):  # overlapping x without being x
        wide = torch.randn(20, 3, 9)
        torch.ops.nsa.rotary_into(wide[:, :, :8], f, None, None, False, "auto", 0, wide[:, :, 1:])


def test_errors_name_the_parameter():
    x = torch.randn(5, 2, 8)
    f = inv_freq_of(8)
    cases = [
        (lambda: nsa.rotary(torch.randn(5, 2, 7), inv_freq_of(8)[:3]), "x.shape[2] (D)"),
        (lambda: nsa.rotary(x[..., :4].contiguous()[..., :3], f), "x.shape[2] (D)"),
        (lambda: nsa.rotary(x, f[:3]), "inv_freq.shape[0]"),
        (lambda: nsa.rotary(x, f.double()), "inv_freq.dtype"),
        (lambda: nsa.rotary(x, f, positions=torch.tensor([0, -1, 2, 3, 4])), "positions[1]"),
        (lambda: nsa.rotary(x, f, positions=torch.arange(4)), "positions.shape[0]"),
        (lambda: nsa.rotary(x, f, positions=torch.arange(5.0)), "positions.dtype"),
        (lambda: nsa.rotary(x, f, positions=torch.tensor([0, 1, 2, 3, 2 ** 40])), "positions"),
        (lambda: nsa.rotary(x, f, cu_seqlens=[0, 2, 4]), "cu_seqlens[2]"),
        (lambda: nsa.rotary(x.to(torch.int32), f), "x.dtype"),
        (lambda: nsa.rotary(x.double(), f, backend="cpu"), "x.dtype"),
    ]
    for call, parameter in cases:
        with pytest.raises(nsa.Error) as info:
            call()
        assert info.value.parameter == parameter, (parameter, str(info.value))
    if HAS_CUDA:
        xc, fc = x.cuda().bfloat16(), f.cuda()
        with pytest.raises(nsa.Error, match="positions.dtype"):
            nsa.rotary(xc, fc, positions=torch.arange(5, device="cuda"))  # int64 on a GPU
        with pytest.raises(nsa.Error, match="dtype"):
            nsa.rotary(xc.float(), fc)  # the cuda backend takes bf16 and f16


# ---- The layer --------------------------------------------------------------------------------------


def old_project(self, x, positions):
    """The layer's projections as they were: the fused product split by autograd, the formula's
    rotation by the positions (torch ops, autograd's own backward: it stacks the sets' gradients and
    concatenates the parts'), where the layer now takes the product apart in one node (_SplitRotate)."""
    T, S = x.shape[0], self.num_kv_sets
    if self._fusable():
        widths = [m.out_features for m in self._projections_of_x()]
        q, k, v, g = self._fused_projection(x)[:, :sum(widths)].split(widths, dim=-1)
        if len(self.gate) > 1:
            g = self.gate[2](self.gate[1](g))
    else:
        q, k, v, g = self.q_proj(x), self.k_proj(x), self.v_proj(x), self.gate(x)
    q = old_layer_rotate(self, q.view(T, self.num_heads, self.head_dim), positions)
    k = old_layer_rotate(self, k.view(T, S * self.num_kv_heads, self.head_dim), positions)
    ks = k.view(T, S, self.num_kv_heads, self.head_dim).unbind(1)
    vs = v.view(T, S, self.num_kv_heads, self.v_head_dim).unbind(1)
    return q, list(ks), list(vs), torch.sigmoid(g).view(T, self.num_heads, 3)


def old_prefill(self, x, cu_seqlens, max_seqlen):
    """The layer's prefill as it was: positions from the offsets in torch, the layer's pieces after."""
    T = x.shape[0]
    positions = positions_of(None if cu_seqlens is None else torch.as_tensor(cu_seqlens).cpu(), T, device=x.device)
    q, ks, vs, g = old_project(self, x, positions)
    o = self._attend(q, ks, vs, g, cu_seqlens, max_seqlen)
    return self.o_proj(o.reshape(T, self.num_heads * self.v_head_dim))


def old_layer_rotate(self, x, positions, cu_seqlens=None):
    """The layer's _rotate as it was: the formula, by the positions."""
    return old_rotate(x, positions, self.inv_freq) if self.rotary else x


def run_layer(m, x, cu, old):
    if old:
        m._prefill = types.MethodType(old_prefill, m)
        m._rotate = types.MethodType(old_layer_rotate, m)
    try:
        x = x.clone().requires_grad_(True)
        y = m(x, cu_seqlens=cu)
        y.float().square().sum().backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        m.zero_grad()
        return y.detach(), x.grad, grads
    finally:
        if old:
            del m._prefill, m._rotate


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("shared_kv", [False, True])
def test_layer_output_and_gradients_equal_the_old_formula(dtype, tol, shared_kv):
    """The layer (its fused product taken apart by _SplitRotate, nsa::rotary forward and backward)
    against its old pieces (old_project). f64 runs on the reference backend (cos and sin in double:
    the two libraries agree to ~1e-16);
    f32 on the cpu backend (ulp differences of the rotated q and keys, through attention). Each
    gradient is compared at the scale of the layer's largest one (a bias's gradient can be a
    near-cancelling sum)."""
    torch.manual_seed(6)
    m = nsa.NativeSparseAttention(32, num_heads=4, num_kv_heads=2, config=SMALL, phi_hidden=12, shared_kv=shared_kv,
                                  dtype=dtype)
    assert m._fuses(50)  # the product taken apart by _SplitRotate
    x = torch.randn(50, 32, dtype=dtype)
    cu = [0, 20, 20, 21, 50]
    y, dx, grads = run_layer(m, x, cu, old=False)
    y0, dx0, grads0 = run_layer(m, x, cu, old=True)
    scale = float(y0.abs().max())
    torch.testing.assert_close(y, y0, rtol=0, atol=tol * scale)
    torch.testing.assert_close(dx, dx0, rtol=0, atol=tol * float(dx0.abs().max()))
    gmax = max(float(g.abs().max()) for g in grads0.values())
    for n in grads0:
        torch.testing.assert_close(grads[n], grads0[n], rtol=0, atol=tol * gmax, msg=lambda s, n=n: f"{n}: {s}")


def test_layer_rotates_under_autocast_as_the_formula():
    torch.manual_seed(7)
    m = nsa.NativeSparseAttention(32, num_heads=4, num_kv_heads=2, config=SMALL, phi="mean")
    x = torch.randn(40, 4, 8)
    pos = positions_of([0, 10, 40], 40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q = m.q_proj(torch.randn(40, 32)).view(40, 4, 8)
        assert q.dtype == torch.bfloat16
        assert_like_the_formula(m._rotate(q, None, [0, 10, 40]), old_rotate(q, pos, m.inv_freq), q)
        assert_like_the_formula(m._rotate(x, pos), old_rotate(x, pos, m.inv_freq), x)  # bench's signature
    off = nsa.NativeSparseAttention(32, num_heads=4, num_kv_heads=2, config=SMALL, phi="mean", rotary=False)
    assert off._rotate(x, pos) is x


@needs_cuda
def test_layer_on_cuda_equals_the_old_formula():
    """bf16 on CUDA: the rotation's bits are the formula's, so the layer's output and gradients are too."""
    torch.manual_seed(8)
    cfg = nsa.Config(cmp_block_len=32, cmp_stride=16, slc_block_len=64, n_selected=4, window=128)
    m = nsa.NativeSparseAttention(256, num_heads=4, num_kv_heads=2, head_dim=64, config=cfg, device="cuda",
                                  dtype=torch.bfloat16)
    assert m._fuses(600)
    x = torch.randn(600, 256, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 300, 300, 301, 600], dtype=torch.int32)
    y, dx, grads = run_layer(m, x, cu, old=False)
    y0, dx0, grads0 = run_layer(m, x, cu, old=True)
    torch.testing.assert_close(y, y0, rtol=0, atol=0)
    torch.testing.assert_close(dx, dx0, rtol=0, atol=0)
    for n in grads0:
        torch.testing.assert_close(grads[n], grads0[n], rtol=0, atol=0, msg=lambda s, n=n: f"{n}: {s}")
