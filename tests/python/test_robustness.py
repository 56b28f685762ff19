"""Hostile sizes from Python: configuration integers, lengths and scales past the library's bounds
(include/nsa/config.h: kMaxLength = 2^31 - 1, kMaxScale = fp32's largest) are named errors on
every host backend, not crashes, hangs or wrong answers. Each case is one that used to crash, hang
or return garbage (block index x block length wrapping int64, n_init + n_local wrapping, a
workspace size wrapping, an fp32 scale of inf)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import needs_torch

import nsa

BACKENDS = ("cpu", "reference")


def _layer(T=24, hq=2, d=8, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, hq, d)).astype(np.float32)
    k, v = (rng.standard_normal((T, 1, d)).astype(np.float32) for _ in range(2))
    g = rng.random((T, hq, 3)).astype(np.float32)
    return q, k, v, g


def _attention(backend, **fields):
    q, k, v, g = _layer()
    base = dict(cmp_block_len=8, cmp_stride=1, slc_block_len=8, n_selected=3, n_init=1, n_local=1, window=8)
    base.update(fields)
    return nsa.attention(q, k, v, g, backend=backend, **base)


def _backward(backend, **fields):
    q, k, v, g = _layer()
    base = dict(cmp_block_len=8, cmp_stride=1, slc_block_len=8, n_selected=3, n_init=1, n_local=1, window=8)
    o, aux = nsa.attention(q, k, v, g, return_aux=True, **base)
    base.update(fields)
    return nsa.attention_backward(q, k, v, g, None, None, aux.lse, aux.indices, np.ones_like(o), backend=backend,
                                  **base)


def _selected(backend, lp):
    q = np.ones((1, 1, 4), np.float32)
    cfg = nsa.Config(cmp_block_len=4, cmp_stride=4, slc_block_len=lp, n_selected=1, n_init=0, n_local=0, window=4)
    idx = np.full((1, 1, 1), 2 ** 31 - 1, np.int32)
    return nsa.selected_attention(q, q, q, idx, config=cfg, backend=backend)


def _dense(backend, **kw):
    q, k, v = (np.random.default_rng(1).standard_normal((8, 1, 4)).astype(np.float32) for _ in range(3))
    return nsa.dense_attention(q, k, v, backend=backend, num_threads=2, **kw)


CASES = {
    "selected_lp_2_62": (lambda be: _selected(be, 2 ** 62), "slc_block_len (l')"),
    "attention_lp_max": (lambda be: _attention(be, slc_block_len=2 ** 63 - 1), "slc_block_len (l')"),
    "backward_lp_max": (lambda be: _backward(be, slc_block_len=2 ** 63 - 1), "slc_block_len (l')"),
    "backward_window_max": (lambda be: _backward(be, window=2 ** 63 - 1), "window (w)"),
    "n_init_n_local_wrap": (lambda be: _attention(be, n_init=2 ** 62, n_local=2 ** 62), "n_init"),
    "dense_max_seqlen_max": (lambda be: _dense(be, max_seqlen=2 ** 63 - 1), "seqs.max_seqlen"),
    "dense_scale_1e300": (lambda be: _dense(be, scale=1e300), "scale"),
    "attention_scale_1e39": (lambda be: _attention(be, scale=1e39), "scale"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_out_of_range_sizes_are_named_errors(case, backend):
    call, parameter = CASES[case]
    with pytest.raises(nsa.Error) as e:
        call(backend)
    assert e.value.parameter == parameter, str(e.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_bounds_themselves_are_accepted(backend):
    # 2^31 - 1 is allowed where it costs nothing (a window longer than the sequence), and the
    # largest fp32 scale is a finite number in every stage.
    q, k, v, g = _layer()
    base = dict(cmp_block_len=8, cmp_stride=1, slc_block_len=8, n_selected=3, n_init=1, n_local=1)
    wide = nsa.attention(q, k, v, g, window=2 ** 31 - 1, backend=backend, **base)
    whole = nsa.attention(q, k, v, g, window=q.shape[0], backend=backend, **base)
    np.testing.assert_allclose(wide, whole, rtol=0, atol=0)
    o = nsa.dense_attention(q, k, v, scale=3.4e38, backend=backend)
    assert np.isfinite(o).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_treats_an_index_row_as_a_set(backend):
    # A repeated block index adds nothing (api.h), in the backward as in the forward: block 0 twice
    # gives the gradients of block 0 once (the CPU backward used to count it twice in dk and dv).
    T = 16
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((T, 1, 4)).astype(np.float32) for _ in range(3))
    g = rng.random((T, 1, 3)).astype(np.float32)
    cfg = nsa.Config(cmp_block_len=4, cmp_stride=2, slc_block_len=4, n_selected=2, n_init=1, n_local=0, window=2)
    o, aux = nsa.attention(q, k, v, g, config=cfg, return_aux=True)
    once = np.tile(np.array([0, -1], np.int32), (T, 1, 1))
    twice = np.zeros((T, 1, 2), np.int32)
    lse = aux.lse.copy()
    lse[..., 1] = nsa.selected_attention(q, k, v, once, config=cfg)[1]
    d_o = np.ones_like(o)
    a, b = (nsa.attention_backward(q, k, v, g, None, None, lse, i, d_o, config=cfg, backend=backend)
            for i in (once, twice))
    for name in ("dq", "dk", "dv", "dg"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


@needs_torch
def test_torch_offsets_out_of_int32_are_named_errors():
    import torch

    q, k, v = torch.randn(24, 2, 8), torch.randn(24, 1, 8), torch.randn(24, 1, 8)
    with pytest.raises(nsa.Error) as e:  # 2^32 + 10 used to act as 10
        nsa.dense_attention(q, k, v, cu_seqlens=torch.tensor([0, 2 ** 32 + 10, 2 ** 33 + 24]))
    assert e.value.parameter == "cu_seqlens"
    layer = nsa.NativeSparseAttention(32, 4, 2)
    with pytest.raises(nsa.Error) as e:  # used to be torch's "repeats can not be negative"
        layer(torch.randn(20, 32), cu_seqlens=torch.tensor([0, 2 ** 32 + 10, 20]))
    assert e.value.parameter == "cu_seqlens[2]"
    with pytest.raises(nsa.Error) as e:
        layer(torch.randn(20, 32), cu_seqlens=[0, 7, 19])
    assert e.value.parameter == "cu_seqlens[2]"


@needs_torch
def test_a_tensor_on_another_device_is_a_named_error():
    # A meta tensor among CPU ones used to run the fake implementation: uninitialised output.
    import torch

    q, k, v, g = (torch.from_numpy(a) for a in _layer())
    cfg = nsa.Config(cmp_block_len=8, cmp_stride=4, slc_block_len=8, n_selected=3, n_init=1, n_local=1, window=8)
    with pytest.raises(nsa.Error) as e:
        nsa.attention(q, k.to("meta"), v, g, config=cfg)
    assert e.value.parameter == "k_cmp.device"
    with pytest.raises(nsa.Error) as e:
        nsa.dense_attention(q, k, v.to("meta"))
    assert e.value.parameter == "v.device"
    with pytest.raises(nsa.Error) as e:
        nsa.window_attention(q.to("meta"), k, v, config=cfg)
    assert e.value.parameter == "k.device"


# ---- Integers past int64, None arrays, allocations, layer sizes, device offsets -----------------


@pytest.mark.parametrize("value", [2 ** 63, 2 ** 64, -(2 ** 63) - 1, 2.5, "8"])
@pytest.mark.parametrize("field,parameter", [("window", "window (w)"), ("n_local", "n_local"),
                                             ("slc_block_len", "slc_block_len (l')")])
def test_config_integers_beyond_int64_are_named_errors(field, parameter, value):
    # They used to be nanobind's "incompatible function arguments" TypeError with a signature dump.
    q, k, v, g = _layer()
    base = dict(cmp_block_len=8, cmp_stride=1, slc_block_len=8, n_selected=3, n_init=1, n_local=1, window=8)
    base[field] = value
    with pytest.raises(nsa.Error) as e:
        nsa.attention(q, k, v, g, **base)
    assert e.value.parameter == parameter, str(e.value)


@pytest.mark.parametrize("kw,parameter", [
    (dict(max_seqlen=2 ** 63), "seqs.max_seqlen"), (dict(max_seqlen=-1), "seqs.max_seqlen"),
    (dict(num_threads=2 ** 63), "ctx.num_threads"), (dict(num_threads=2 ** 31), "ctx.num_threads"),
    (dict(scale=10 ** 400), "scale"), (dict(backbone_offsets=(2 ** 64,)), "backbone_offsets[0]"),
    (dict(cu_seqlens=[0, 2 ** 63, 24]), "cu_seqlens"), (dict(cu_seqlens=np.array([0.0, 24.0])), "cu_seqlens.dtype"),
])
def test_call_arguments_beyond_their_range_are_named_errors(kw, parameter):
    q, k, v, g = _layer()
    with pytest.raises(nsa.Error) as e:
        nsa.attention(q, k, v, g, cmp_block_len=8, cmp_stride=4, slc_block_len=8, n_selected=3, n_init=1, n_local=1,
                      window=8, **kw)
    assert e.value.parameter == parameter, str(e.value)


def test_none_arrays_are_named_by_the_library():
    q, k, v, g = _layer()
    cfg = nsa.Config(cmp_block_len=8, cmp_stride=4, slc_block_len=8, n_selected=3, n_init=1, n_local=1, window=8)
    calls = {
        "g": lambda: nsa.attention(q, k, v, None, config=cfg),
        "indices": lambda: nsa.selected_attention(q, k, v, None, config=cfg),
        "kc": lambda: nsa.compressed_attention(q, None, v[:6], config=cfg),
        "d_o": lambda: nsa.attention_backward(q, k, v, g, None, None, np.zeros((24, 2, 3), np.float32),
                                              np.zeros((24, 1, 3), np.int32), None, config=cfg),
    }
    for parameter, call in calls.items():
        with pytest.raises(nsa.Error) as e:
            call()
        assert e.value.parameter == parameter, str(e.value)


def test_a_huge_valid_selection_block_needs_no_huge_workspace():
    # l' = 2^31 - 1 is valid (d = 1 divides it): the CPU workspace used to grow with l' (288 GiB,
    # a MemoryError from numpy); it follows the tensors now, and the result is the reference's.
    q, k, v, g = _layer()
    cfg = dict(cmp_block_len=8, cmp_stride=1, slc_block_len=2 ** 31 - 1, n_selected=3, n_init=1, n_local=1, window=8)
    o, aux = nsa.attention(q, k, v, g, backend="cpu", return_aux=True, **cfg)
    want = nsa.attention(*(a.astype(np.float64) for a in (q, k, v, g)), backend="reference", **cfg)
    np.testing.assert_allclose(o, want, rtol=1e-4, atol=1e-5)
    assert nsa._nsa.workspace_size("backward", "cpu", 2, nsa.Config(**cfg).native(), 24, 1, 24, 2, 1, 8, 8, 0,
                                   "f32", "cpu") < 2 ** 24


def test_an_output_too_large_to_allocate_names_its_parameter(monkeypatch):
    # n = 2^31 - 1 is valid; its indices output [T, Hkv, n] (192 GiB at T = 24) cannot be
    # allocated: a named error, not numpy's MemoryError. The bound is lowered here so that the
    # test does not depend on the machine's memory.
    from nsa import _core

    monkeypatch.setattr(_core, "_MAX_ALLOCATION", 2 ** 20)
    q, k, v, g = _layer()
    with pytest.raises(nsa.Error) as e:
        nsa.attention(q, k, v, g, cmp_block_len=8, cmp_stride=4, slc_block_len=8, n_selected=2 ** 31 - 1, n_init=1,
                      n_local=1, window=8)
    assert e.value.parameter == "n_selected (n)", str(e.value)


def test_a_declared_max_seqlen_above_t_counts_as_t():
    # The scores' width follows min(max_seqlen, T); the reference used to allocate per declared
    # position (2^31 - 1) and hang.
    q, k, v, g = _layer()
    cfg = nsa.Config(cmp_block_len=8, cmp_stride=4, slc_block_len=8, n_selected=3, n_init=1, n_local=1, window=8)
    kc, vc = k[:6], v[:6]
    for backend in BACKENDS:
        o, lse, S = nsa.compressed_attention(q, kc, vc, config=cfg, max_seqlen=2 ** 31 - 1, backend=backend)
        o2, lse2, S2 = nsa.compressed_attention(q, kc, vc, config=cfg, backend=backend)
        assert S.shape == S2.shape == (24, 1, 3)
        np.testing.assert_array_equal(o, o2)


@needs_torch
def test_layer_sizes_are_named_errors():
    # num_heads = 0 used to be a ZeroDivisionError (head_dim's default divides by it).
    for kw, parameter in [(dict(num_heads=0), "num_heads"), (dict(num_heads=2 ** 63), "num_heads"),
                          (dict(hidden_size=-4), "hidden_size"), (dict(head_dim=2 ** 64), "head_dim"),
                          (dict(num_kv_heads=1.5), "num_kv_heads")]:
        args = dict(hidden_size=32, num_heads=4, num_kv_heads=2)
        args.update(kw)
        with pytest.raises(nsa.Error) as e:
            nsa.NativeSparseAttention(**args)
        assert e.value.parameter == parameter, str(e.value)


@needs_torch
def test_device_offsets_must_be_int32():
    # Offsets on a GPU are not read (no synchronisation): an int64 tensor there cannot be
    # range-checked, so it is refused; host ones of any integer type are checked and converted.
    import torch

    from nsa import _arrays

    with pytest.raises(nsa.Error) as e:
        _arrays.check_device_offsets(torch.zeros(3, dtype=torch.int64, device="meta"))
    assert e.value.parameter == "cu_seqlens.dtype"
    _arrays.check_device_offsets(torch.zeros(3, dtype=torch.int32, device="meta"))
    _arrays.check_device_offsets(torch.zeros(3, dtype=torch.int64))
