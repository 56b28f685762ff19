"""NativeSparseAttention: forward and backward, batching and packing, causality, decoding,
dtypes, and torch.compile on the CPU."""
from __future__ import annotations

import pytest

from conftest import HIDDEN, SMALL, has_torch, make_layer

if not has_torch():
    pytest.skip("PyTorch is not installed", allow_module_level=True)

import torch  # noqa: E402

import nsa  # noqa: E402

@pytest.mark.parametrize("phi", ["mlp", "linear", "mean"])
@pytest.mark.parametrize("shared_kv", [False, True])
@pytest.mark.parametrize("gate_hidden", [8, 0])
def test_forward_backward_reach_every_parameter(phi, shared_kv, gate_hidden):
    m = make_layer(phi=phi, shared_kv=shared_kv, gate_hidden=gate_hidden)
    x = torch.randn(50, HIDDEN, dtype=torch.float64, requires_grad=True)
    y = m(x)
    assert y.shape == (50, HIDDEN) and torch.isfinite(y).all()
    y.square().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    for name, param in m.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


@pytest.mark.parametrize("gate_hidden", [4, 0])
def test_module_gradcheck(gate_hidden):
    """Gradients of the whole layer (projections, rotary, gates, phi, NSA) against finite differences,
    with the MLP gate and the linear one."""
    m = make_layer(hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, phi_hidden=3, gate_hidden=gate_hidden,
                   config=nsa.Config(cmp_block_len=4, cmp_stride=2, slc_block_len=4, n_selected=3, n_init=1,
                                     n_local=1, window=3))
    x = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(m, (x,), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_batched_input_equals_packed_and_separate_sequences():
    m = make_layer()
    x = torch.randn(3, 40, HIDDEN, dtype=torch.float64)
    batched = m(x)
    packed = m(x.reshape(120, HIDDEN), cu_seqlens=torch.tensor([0, 40, 80, 120], dtype=torch.int32))
    torch.testing.assert_close(batched.reshape(120, HIDDEN), packed, rtol=1e-12, atol=1e-12)
    for b in range(3):
        torch.testing.assert_close(m(x[b]), batched[b], rtol=1e-12, atol=1e-12)


def test_varlen_with_empty_sequence():
    m = make_layer()
    x = torch.randn(45, HIDDEN, dtype=torch.float64)
    y = m(x, cu_seqlens=[0, 20, 20, 45])
    torch.testing.assert_close(y[20:], m(x[20:]), rtol=1e-12, atol=1e-12)


def test_causality():
    m = make_layer()
    x = torch.randn(60, HIDDEN, dtype=torch.float64)
    y = m(x)
    x2 = x.clone()
    x2[45:] = torch.randn(15, HIDDEN, dtype=torch.float64)
    y2 = m(x2)
    torch.testing.assert_close(y[:45], y2[:45], rtol=1e-12, atol=1e-12)
    assert (y[45:] - y2[45:]).abs().max() > 1e-3


@pytest.mark.parametrize("shared_kv", [False, True])
def test_decode_equals_prefill(shared_kv):
    """Prefill, then steps of 1 and 3 tokens for two sequences at once (one of them idle for a
    step), crossing compression, selection and window block boundaries: every new row equals
    the matching row of one prefill over the whole sequences."""
    m = make_layer(shared_kv=shared_kv)
    xa = torch.randn(45, HIDDEN, dtype=torch.float64)
    xb = torch.randn(35, HIDDEN, dtype=torch.float64)
    full_a, full_b = m(xa), m(xb)
    cache = nsa.NSACache()
    with torch.no_grad():
        out = m(torch.cat([xa[:30], xb[:16]]), cu_seqlens=[0, 30, 46], cache=cache)
        torch.testing.assert_close(out[:30], full_a[:30], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out[30:], full_b[:16], rtol=1e-12, atol=1e-12)
        pa, pb = 30, 16
        for step_a, step_b in [(1, 3), (3, 1), (0, 3), (1, 1), (3, 0), (3, 3), (1, 3)]:
            x = torch.cat([xa[pa:pa + step_a], xb[pb:pb + step_b]])
            out = m(x, cu_seqlens=[0, step_a, step_a + step_b], cache=cache)
            torch.testing.assert_close(out[:step_a], full_a[pa:pa + step_a], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(out[step_a:], full_b[pb:pb + step_b], rtol=1e-12, atol=1e-12)
            pa, pb = pa + step_a, pb + step_b
    assert cache.seq_len(0) == pa and cache.seq_len(1) == pb


def test_cache_must_cover_its_sequences():
    m = make_layer()
    cache = nsa.NSACache()
    m(torch.randn(10, HIDDEN, dtype=torch.float64), cu_seqlens=[0, 4, 10], cache=cache)
    with pytest.raises(nsa.Error, match="cu_seqlens"):
        m(torch.randn(1, HIDDEN, dtype=torch.float64), cache=cache)
    with pytest.raises(nsa.Error, match="cu_seqlens"):
        m(torch.randn(3, HIDDEN, dtype=torch.float64), cu_seqlens=[0, 1, 4], cache=cache)


def test_rotary_uses_positions_within_each_sequence():
    """Rotary changes the output (it is applied), and positions count from each sequence's start:
    packing a sequence after another one gives the same rows as running it alone."""
    cfg = nsa.Config(cmp_block_len=8, cmp_stride=4, slc_block_len=16, n_selected=0, window=5)
    m = make_layer(config=cfg, phi="mean")
    x = torch.randn(30, HIDDEN, dtype=torch.float64)
    y = m(x)
    m_plain = make_layer(config=cfg, phi="mean", rotary=False)
    assert (y - m_plain(x)).abs().max() > 1e-6
    # Each sequence counts positions from its own start: packing after another sequence is a no-op.
    packed = m(torch.cat([torch.randn(7, HIDDEN, dtype=torch.float64), x]), cu_seqlens=[0, 7, 37])
    torch.testing.assert_close(packed[7:], y, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtypes(dtype):
    m = make_layer(dtype=dtype)
    assert all(p.dtype == dtype for p in m.parameters())
    x = torch.randn(2, 33, HIDDEN, dtype=dtype)
    y = m(x)
    assert y.dtype == dtype and torch.isfinite(y.float()).all()
    y.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == dtype for p in m.parameters())
    # Against the same weights in float64: bfloat16 storage costs a few percent at most here.
    m64 = make_layer(dtype=torch.float64)
    m64.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
    ref = m64(x.double())
    tol = {torch.float32: 1e-4, torch.bfloat16: 0.1}[dtype]
    assert (y.double() - ref).abs().max() <= tol * ref.abs().max()


def test_to_dtype_and_reset_parameters():
    m = make_layer(dtype=torch.float32, phi="linear").to(torch.float64)
    assert all(p.dtype == torch.float64 for p in m.parameters())
    w = m.phi_k["w1"]
    l, D = SMALL.cmp_block_len, m.head_dim
    # linear phi starts as mean pooling
    torch.testing.assert_close(w, (torch.eye(D, dtype=torch.float64) / l).repeat(1, l))
    before = m.q_proj.weight.clone()
    m.reset_parameters()
    assert not torch.equal(before, m.q_proj.weight)


def test_bad_arguments():
    with pytest.raises(nsa.Error, match="num_heads"):
        nsa.NativeSparseAttention(32, num_heads=4, num_kv_heads=3)
    with pytest.raises(nsa.Error, match="head_dim"):
        nsa.NativeSparseAttention(30, num_heads=2, head_dim=15)
    with pytest.raises(nsa.Error, match="phi"):
        nsa.NativeSparseAttention(32, num_heads=4, phi="max")
    with pytest.raises(nsa.Error, match="cmp_stride"):
        nsa.NativeSparseAttention(32, num_heads=4, config=nsa.Config(cmp_stride=5))
    for bad in (-1, 2.0, "8", None):
        with pytest.raises(nsa.Error, match="gate_hidden"):
            nsa.NativeSparseAttention(32, num_heads=4, gate_hidden=bad)
    m = make_layer()
    with pytest.raises(nsa.Error, match="x.shape"):
        m(torch.randn(3, 31, dtype=torch.float64))


def test_torch_compile_module_cpu():
    """torch.compile (Inductor on the CPU) of a module using NSA: same output and gradients as eager."""
    torch._dynamo.reset()
    m = make_layer(dtype=torch.float32, phi="mlp")
    x = torch.randn(40, HIDDEN)
    compiled = torch.compile(m, fullgraph=True)
    y_eager = m(x)
    y = compiled(x)
    torch.testing.assert_close(y, y_eager, rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    y_eager.square().sum().backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-5)


def test_torch_compile_dynamic_shapes_and_packed_input():
    """One compiled graph serves several lengths (symbolic shapes in the fake implementations)."""
    torch._dynamo.reset()
    m = make_layer(dtype=torch.float32)
    compiled = torch.compile(m, backend="aot_eager", dynamic=True, fullgraph=True)
    for T in (40, 57, 23):
        x = torch.randn(T, HIDDEN)
        torch.testing.assert_close(compiled(x), m(x), rtol=0, atol=0)
    x = torch.randn(30, HIDDEN)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    torch.testing.assert_close(compiled(x, cu_seqlens=cu), m(x, cu_seqlens=cu), rtol=0, atol=0)


def test_capture_keeps_the_selection_lse_and_gates_of_the_last_forward():
    torch.manual_seed(0)
    layer = nsa.NativeSparseAttention(hidden_size=32, num_heads=4, num_kv_heads=2, config=SMALL, phi="mean")
    x = torch.randn(2, 20, 32)
    layer(x)
    assert layer.aux is None  # off by default
    layer.capture = True
    layer(x)
    aux = layer.aux
    T, n = 2 * 20, SMALL.n_selected
    assert aux["indices"].shape == (T, 2, n) and aux["indices"].dtype == torch.int32
    assert aux["lse"].shape == (T, 4, 3) and aux["gates"].shape == (T, 4, 3)
    assert not aux["gates"].requires_grad
    # The first token's only admissible block is block 0: selected, the rest -1.
    assert aux["indices"][0, :, 0].tolist() == [0, 0] and (aux["indices"][0, :, 1:] == -1).all()


def _run(m, x):
    x = x.clone().requires_grad_(True)
    y = m(x)
    y.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("shared_kv", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("gate_hidden", [8, 0, 5])
def test_one_projection_product_equals_one_per_module(shared_kv, bias, gate_hidden):
    """q, k, v and the gate's first layer (the whole gate when it is linear) run as one product of x
    with their stacked weights; a forward hook that changes nothing sends each module through its
    own call instead. With 4 heads the linear gate's 12 columns and an MLP gate's 5 are padded to
    a multiple of 8."""
    m = make_layer(shared_kv=shared_kv, bias=bias, gate_hidden=gate_hidden)
    assert m._fuses(30)
    x = torch.randn(30, HIDDEN, dtype=torch.float64)
    y, dx, grads = _run(m, x)
    hook = m.q_proj.register_forward_hook(lambda module, args, out: None)
    assert not m._fusable()
    y0, dx0, grads0 = _run(m, x)
    hook.remove()
    torch.testing.assert_close(y, y0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, dx0, rtol=1e-12, atol=1e-12)
    for name in grads0:
        torch.testing.assert_close(grads[name], grads0[name], rtol=1e-12, atol=1e-12, msg=lambda s, n=name: f"{n}: {s}")


def test_adapters_and_hooks_on_the_projections_keep_their_effect():
    class LowRank(torch.nn.Linear):  # a LoRA-style adapter: W x + B A x
        def __init__(self, base, rank=2):
            super().__init__(base.in_features, base.out_features, bias=False, dtype=base.weight.dtype)
            with torch.no_grad():
                self.weight.copy_(base.weight)
            self.a = torch.nn.Parameter(torch.randn(rank, base.in_features, dtype=base.weight.dtype))
            self.b = torch.nn.Parameter(torch.randn(base.out_features, rank, dtype=base.weight.dtype))

        def forward(self, x):
            return super().forward(x) + x @ self.a.t() @ self.b.t()

    x = torch.randn(30, HIDDEN, dtype=torch.float64)
    m = make_layer()
    m.q_proj = LowRank(m.q_proj)
    assert not m._fusable()
    y, _, grads = _run(m, x)
    assert grads["q_proj.a"].abs().sum() > 0  # the adapter is trained
    merged = make_layer()  # the same layer with the adapter merged into a plain weight
    with torch.no_grad():
        merged.q_proj.weight.add_(m.q_proj.b @ m.q_proj.a)
    assert merged._fusable()
    torch.testing.assert_close(merged(x), y, rtol=1e-12, atol=1e-12)

    hooked = make_layer()
    hooked.k_proj.register_forward_hook(lambda module, args, out: 2 * out)
    doubled = make_layer()
    with torch.no_grad():
        doubled.k_proj.weight.mul_(2)
    torch.testing.assert_close(hooked(x), doubled(x), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(hooked(x), make_layer()(x))


def test_padding_columns_of_the_product_get_a_zero_gradient():
    """The fused product's padding (the linear gate's 12 columns padded to 16) gets a zero gradient,
    not whatever dy's memory held: torch's deterministic mode fills new memory with NaN, which a
    padding column left unwritten would carry into dx (NaN times the padding's zero weights)."""
    m = make_layer(gate_hidden=0)
    assert m._fuses(30) and sum(mod.out_features for mod in m._projections_of_x()) % 8
    x = torch.randn(30, HIDDEN, dtype=torch.float64, requires_grad=True)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        m(x).square().sum().backward()
    finally:
        torch.use_deterministic_algorithms(was)
    assert torch.isfinite(x.grad).all()


def test_projection_parts_off_the_alignment_run_one_product_per_module():
    m = make_layer(num_heads=2, head_dim=6)  # q's 12 columns would misalign the parts after them
    assert not m._fusable()
    x = torch.randn(20, HIDDEN, dtype=torch.float64, requires_grad=True)
    m(x).sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("fused", [True, False])
def test_linear_gate_is_sigmoid_of_one_product(fused):
    """gate_hidden=0 (the default): the gates are sigmoid(x W^T + b) of the gate's one Linear, fused
    into the projection (its 3 Hq = 12 columns padded to 16) or, with a hook on the gate, not."""
    m = make_layer(gate_hidden=0)
    if not fused:
        m.gate.register_forward_hook(lambda module, args, out: None)
    assert len(m.gate) == 1 and m.gate[0].out_features == 3 * m.num_heads
    assert m._fuses(25) == fused
    assert "gate_hidden=0" in repr(m)
    x = torch.randn(25, HIDDEN, dtype=torch.float64)
    m.capture = True
    m(x)
    expected = torch.sigmoid(torch.nn.functional.linear(x, m.gate[0].weight, m.gate[0].bias))
    torch.testing.assert_close(m.aux["gates"], expected.view(25, m.num_heads, 3), rtol=1e-12, atol=1e-12)
    m.reset_parameters()  # the linear gate is re-drawn with the rest
    m(x)
    assert not torch.allclose(m.aux["gates"], expected.view(25, m.num_heads, 3))


@pytest.mark.parametrize("rotary", [True, False])
@pytest.mark.parametrize("shared_kv", [False, True])
def test_fused_projection_hands_compact_kv_sets(rotary, shared_kv):
    """From the fused product each K and V set reaches the library as its own compact [T, Hkv, D]
    array, sharing no memory with the product's output (views into its rows would keep the whole
    output alive until the backward), with the values of the separate projections."""
    m = make_layer(rotary=rotary, shared_kv=shared_kv)
    x = torch.randn(23, HIDDEN, dtype=torch.float64)
    assert m._fuses(23)
    outputs = []
    fused = m._fused_projection
    m._fused_projection = lambda x: outputs.append(fused(x)) or outputs[-1]
    q, ks, vs, g = m._project(x)
    (y,) = outputs
    with torch.no_grad():
        sep_k = m.k_proj(x).view(23, m.num_kv_sets, m.num_kv_heads, m.head_dim).unbind(1)
        sep_v = m.v_proj(x).view(23, m.num_kv_sets, m.num_kv_heads, m.v_head_dim).unbind(1)
    assert len(ks) == len(vs) == m.num_kv_sets
    for i, (k, v) in enumerate(zip(ks, vs)):
        for t in (k, v):
            assert t.is_contiguous() and t.shape[:2] == (23, m.num_kv_heads)
            assert t.untyped_storage().data_ptr() not in (y.untyped_storage().data_ptr(),
                                                          q.untyped_storage().data_ptr())
        torch.testing.assert_close(v.detach(), sep_v[i], rtol=1e-12, atol=1e-12)
        if not rotary:
            torch.testing.assert_close(k.detach(), sep_k[i], rtol=1e-12, atol=1e-12)


def test_projection_fuses_while_training_and_for_long_inputs_only():
    """One product of x with the stacked weights while autograd records; without it only where x's
    three extra reads would cost more than stacking the weights (3 T > 2 N): a decode step's
    projections read each weight once and copy none. Both paths give the same layer."""
    m = make_layer()
    width = sum(mod.out_features for mod in m._projections_of_x())
    assert m._fuses(1)
    with torch.no_grad():
        assert not m._fuses(2 * width // 3) and m._fuses(2 * width // 3 + 1)
        x = torch.randn(30, HIDDEN, dtype=torch.float64)
        separate = m(x)
    torch.testing.assert_close(m(x).detach(), separate, rtol=1e-12, atol=1e-12)
    m.requires_grad_(False)  # inference with autograd on: nothing records
    assert not m._fuses(30)

    def stacked(*args):
        raise AssertionError("a decode step stacked the projection weights")

    m._fused_projection = stacked
    cache = nsa.NSACache()
    with torch.no_grad():
        m(torch.randn(2, 20, HIDDEN, dtype=torch.float64), cache=cache)  # prefill of 40 tokens: 3 T < 2 N
        m(torch.randn(2, 1, HIDDEN, dtype=torch.float64), cache=cache)
