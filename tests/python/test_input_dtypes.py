"""Inputs of a dtype the library does not compute in are nsa.Errors that name the input and list
only the dtypes it takes: an int32 q is "q.dtype = i32: must be f32, bf16, f16 or f64" (never a
list that holds i32), and a float64 x into a float32 layer is an nsa.Error naming x.dtype, not
a raw torch error from the projections."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import SMALL, make_problem, needs_torch

import nsa

FLOATS = "must be f32, bf16, f16 or f64"


def _check(info, parameter, value):
    err = info.value
    assert err.parameter == parameter and err.value == value, str(err)
    assert err.allowed == FLOATS, str(err)
    assert "i32" not in err.allowed


@pytest.mark.parametrize("dtype,name", [(np.int32, "i32"), (np.int64, "int64"), (np.bool_, "bool")])
def test_numpy_integer_q_lists_the_float_dtypes(dtype, name):
    p = make_problem(seed=21).astype(np.float32)
    with pytest.raises(nsa.Error) as info:
        nsa.attention(p.q.astype(dtype), p.k, p.v, p.g, p.phi_k, p.phi_v, config=SMALL)
    _check(info, "q.dtype", name)
    with pytest.raises(nsa.Error) as info:
        nsa.dense_attention(p.q.astype(dtype), p.kv6[0], p.kv6[1])
    _check(info, "q.dtype", name)


def test_numpy_integer_x_of_compress_is_named_x():
    x = np.zeros((32, 2, 8), np.int32)
    with pytest.raises(nsa.Error) as info:
        nsa.compress(x, config=SMALL)
    _check(info, "x.dtype", "i32")


@needs_torch
def test_torch_int32_q_lists_the_float_dtypes():
    import torch

    from nsa import torch_ops  # noqa: F401  (registers torch.ops.nsa.*)

    p = make_problem(seed=22, phi="mean", shared=True).astype(np.float32)
    q, k, v, g = (torch.from_numpy(a) for a in (p.q, p.kv6[0], p.kv6[1], p.g))
    with pytest.raises(nsa.Error) as info:
        nsa.attention(q.to(torch.int32), k, v, g, config=SMALL)
    _check(info, "q.dtype", "i32")
    with pytest.raises(nsa.Error) as info:
        torch.ops.nsa.dense_attention(q.to(torch.int32), k, v, None, 0, 0.0, "auto", 0)
    _check(info, "q.dtype", "i32")


@needs_torch
@pytest.mark.parametrize("x_dtype", ["float64", "float16", "int32"])
def test_layer_input_of_another_dtype_is_a_named_error(x_dtype):
    import torch

    layer = nsa.NativeSparseAttention(hidden_size=32, num_heads=4, num_kv_heads=2, config=SMALL)  # float32
    x = torch.randn(2, 20, 32).to(getattr(torch, x_dtype))
    with pytest.raises(nsa.Error) as info:
        layer(x)
    err = info.value
    assert err.parameter == "x.dtype" and err.value == {"float64": "f64", "float16": "f16", "int32": "i32"}[x_dtype]
    assert "f32" in err.allowed, str(err)
    # The same input in the layer's dtype runs.
    assert layer(x.float()).shape == (2, 20, 32)


@needs_torch
def test_layer_under_autocast_takes_the_autocast_dtype():
    import torch

    layer = nsa.NativeSparseAttention(hidden_size=32, num_heads=4, num_kv_heads=2, config=SMALL, phi="mean")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(torch.randn(2, 20, 32).to(torch.bfloat16))
    assert y.shape == (2, 20, 32) and torch.isfinite(y.float()).all()


@needs_torch
@pytest.mark.parametrize("phi", ["linear", "mlp"])
def test_layer_under_autocast_casts_phi_and_trains_its_fp32_parameters(phi):
    # The projections give bf16 under autocast while phi's parameters stay fp32: the layer casts
    # them for the call, and their gradients reach the fp32 parameters.
    import torch

    torch.manual_seed(0)
    layer = nsa.NativeSparseAttention(hidden_size=32, num_heads=4, num_kv_heads=2, config=SMALL, phi=phi)
    x = torch.randn(2, 20, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()
    y.float().square().mean().backward()
    for name, p in layer.phi_k.items():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, name
    assert any(p.grad.abs().sum() > 0 for p in layer.phi_k.values())
