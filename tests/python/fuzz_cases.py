"""A seeded fuzzer of the Python package: the NumPy functional API, the torch operators and the
torch layer on the CPU.

Each case draws a small problem and either calls the package validly (awkward on purpose: empty
and one-token sequences, n above the block count, l' = 2^31 - 1, a declared max_seqlen far above
the longest sequence, caller indices with repeats, -1 and blocks past the query, float16 and
bfloat16) or breaks exactly one thing a Python user can break: an integer of 2^63 and more, a
float where an integer belongs, None for an array, a dtype, a shape, the offsets, the device.
Every case ends in a result that matches the reference backend (style.md's tolerance) or in an
nsa.Error whose ``parameter`` is the one the case broke. Anything else (another exception, an
accepted invalid input, a wrong result) fails; a crash or a hang stops the run with the case
(faulthandler prints the stack, and the watchdog of ``run`` exits after ``timeout`` seconds).

Case ``i`` of seed ``s`` is the same on every run: ``python fuzz_cases.py --seed s --first i
--cases 1 --verbose`` replays it. ``tests/python/test_fuzz.py`` runs a short run under pytest;
``scripts/fuzz.sh`` a long one.
"""
from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import os
import sys
import time
from typing import Any, Callable, Optional

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

import nsa  # noqa: E402
from conftest import has_torch  # noqa: E402

HUGE_INTS = (2 ** 63, 2 ** 64, -(2 ** 63) - 1, 10 ** 30)
UNIT = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float64": 0.0}


@dataclasses.dataclass
class Case:
    index: int
    text: str
    call: Callable[[], Any]
    expect: Optional[str] = None  # the parameter the case broke; None: success
    check: Optional[Callable[[Any], None]] = None  # compares a successful result with the reference
    mutation: str = "none"


class Mismatch(AssertionError):
    pass


# ---- Comparisons -------------------------------------------------------------------------------


def _f64(x):
    if x is None:
        return None
    if hasattr(x, "detach"):
        return x.detach().double().numpy()
    return np.asarray(x, dtype=np.float64)


def expect_close(what: str, got, truth, dtype: str):
    """style.md: within twice the error of the truth rounded to the storage dtype (widened by an
    ulp of the largest value, as tests/fuzz/fuzz_support.h does), plus a floor of 2e-5 relative."""
    got, truth = _f64(got), _f64(truth)
    if got.shape != truth.shape:
        raise Mismatch(f"{what}: shape {got.shape} instead of {truth.shape}")
    same_nan = np.isnan(got) == np.isnan(truth)
    if not same_nan.all():
        raise Mismatch(f"{what}: NaN where the reference has none (or the reverse)")
    fin = np.isfinite(truth)
    if not (got[~fin] == truth[~fin]).all() and not np.isnan(truth[~fin]).all():
        raise Mismatch(f"{what}: infinities differ")
    if not fin.any():
        return
    g, t = got[fin], truth[fin]
    if dtype == "bfloat16":
        import torch

        rounded = torch.from_numpy(t).to(torch.bfloat16).double().numpy()
    else:
        rounded = t.astype(dtype).astype(np.float64)
    scale = float(np.abs(t).max())
    tol = 2 * float(np.abs(rounded - t).max()) + 4 * UNIT[dtype] * scale + 2e-5 * max(1.0, scale)
    err = float(np.abs(g - t).max())
    if not err <= tol:
        raise Mismatch(f"{what}: max error {err:.3g} above the tolerance {tol:.3g}")


def expect_indices_close(got, truth, T: int, hkv: int):
    """Rows of selected blocks: nearly all equal (fp32 scores may break a near-tie another way)."""
    got, truth = np.asarray(got), np.asarray(truth)
    if got.shape != truth.shape:
        raise Mismatch(f"indices: shape {got.shape} instead of {truth.shape}")
    rows = (got != truth).reshape(T * hkv, -1).any(axis=1) if got.size else np.zeros(T * hkv, bool)
    if rows.sum() > max(1, T * hkv // 100):
        raise Mismatch(f"indices: {int(rows.sum())} rows select other blocks than the reference")
    return ~rows


# ---- Problems ----------------------------------------------------------------------------------


def draw_config(r: np.random.Generator, cache: bool = False) -> nsa.Config:
    d = int(r.choice([1, 2, 4, 8]))
    l = d * int(r.choice([1, 2, 3, 4]))
    lp = d * int(r.choice([1, 2, 3, 4, 8]))
    if not cache and r.random() < 0.08:
        d, l, lp = 1, int(r.choice([1, 2, 5])), int(r.choice([2 ** 31 - 1, 2 ** 30]))
    n = int(r.choice([0, 1, 2, 3, 5, 20]))
    n_init = int(r.integers(0, min(n, 2) + 1)) if n else 0
    n_local = int(r.integers(0, min(n - n_init, 2) + 1)) if n else 0
    backbone = ()
    if n - n_init - n_local >= 1 and r.random() < 0.3:
        backbone = (int(r.integers(1, 5)),)
    w = int(r.choice([0, 1, 3, 12, 40, 2 ** 31 - 1]))
    scale = float(r.choice([0.0, 0.0, 0.05, 0.3, 1.5]))
    return nsa.Config(cmp_block_len=l, cmp_stride=d, slc_block_len=lp, n_selected=n, n_init=n_init,
                      n_local=n_local, window=w, scale=scale, backbone_offsets=backbone)


@dataclasses.dataclass
class Problem:
    cfg: nsa.Config
    seqlens: list
    hq: int
    hkv: int
    dqk: int
    dv: int
    phi: str
    shared: bool
    q: np.ndarray
    k: tuple
    v: tuple
    g: np.ndarray
    phi_k: Optional[nsa.Phi]
    phi_v: Optional[nsa.Phi]
    cu: Optional[np.ndarray]

    @property
    def T(self) -> int:
        return int(sum(self.seqlens))

    def kv(self, dtype=None):
        conv = (lambda a: a) if dtype is None else (lambda a: a.astype(dtype))
        if self.shared:
            return conv(self.k[0]), conv(self.v[0])
        return tuple(conv(a) for a in self.k), tuple(conv(a) for a in self.v)

    def phis(self, dtype=None):
        def conv(p):
            if p is None or dtype is None:
                return p
            return nsa.Phi(*[None if a is None else a.astype(dtype) for a in p])

        return conv(self.phi_k), conv(self.phi_v)


def make_phi(r, kind: str, l: int, D: int, F: int):
    if kind == "mean":
        return None
    pe = r.uniform(-0.5, 0.5, (l, D))
    w = 1.0 / np.sqrt(l * D)
    if kind == "linear":
        return nsa.Phi(w1=r.uniform(-2 * w, 2 * w, (D, l * D)), pe=pe)
    return nsa.Phi(w1=r.uniform(-2 * w, 2 * w, (F, l * D)), b1=r.uniform(-0.5, 0.5, F),
                   w2=r.uniform(-1.5, 1.5, (D, F)) / np.sqrt(F), b2=r.uniform(-0.5, 0.5, D), pe=pe)


def draw_problem(r: np.random.Generator, cache: bool = False) -> Problem:
    cfg = draw_config(r, cache)
    B = int(r.integers(1, 4))
    seqlens = [int(r.choice([0, 1, 2, 7, int(r.integers(3, 40)), int(r.integers(40, 70))])) for _ in range(B)]
    hkv = int(r.integers(1, 3))
    hq = hkv * int(r.choice([1, 2, 3]))
    dqk, dv = int(r.choice([1, 3, 8])), int(r.choice([1, 5, 8]))
    phi = str(r.choice(["mean", "linear", "mlp"]))
    shared = bool(r.random() < 0.3)
    F = int(r.choice([1, 4]))
    T = sum(seqlens)
    q = r.uniform(-1, 1, (T, hq, dqk))
    sets = 1 if shared else 3
    k = tuple(r.uniform(-1, 1, (T, hkv, dqk)) for _ in range(sets))
    v = tuple(r.uniform(-1, 1, (T, hkv, dv)) for _ in range(sets))
    g = r.uniform(0, 1, (T, hq, 3))
    l = cfg.cmp_block_len if cfg.cmp_block_len <= 64 else 1
    phi_k, phi_v = make_phi(r, phi, l, dqk, F), make_phi(r, phi, l, dv, F)
    cu = None if B == 1 else np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int32)
    return Problem(cfg, seqlens, hq, hkv, dqk, dv, phi, shared, q, k, v, g, phi_k, phi_v, cu)


def describe(p: Problem, dtype: str) -> str:
    c = p.cfg
    return (f"dtype={dtype} l={c.cmp_block_len} d={c.cmp_stride} l'={c.slc_block_len} n={c.n_selected} "
            f"n_init={c.n_init} n_local={c.n_local} w={c.window} scale={c.scale} backbone={c.backbone_offsets} "
            f"phi={p.phi} shared={p.shared} seqlens={p.seqlens} hq={p.hq} hkv={p.hkv} dqk={p.dqk} dv={p.dv}")


def awkward_indices(r, p: Problem) -> np.ndarray:
    """Caller indices [T, Hkv, n]: valid blocks, repeats, -1 and other negatives, blocks past the
    query and the sequence, INT32_MAX (api.h: a row is a set; those past the query add nothing)."""
    n, lp = p.cfg.n_selected, p.cfg.slc_block_len
    idx = np.zeros((p.T, p.hkv, n), np.int32)
    s0 = 0
    for length in p.seqlens:
        for t in range(length):
            Jt = t // lp
            for h in range(p.hkv):
                for k in range(n):
                    kind = int(r.integers(0, 8))
                    if kind == 0:
                        val = -1
                    elif kind == 1:
                        val = int(r.choice([-2, -(2 ** 31)]))
                    elif kind == 2 and k > 0:
                        val = int(idx[s0 + t, h, int(r.integers(0, k))])
                    elif kind == 3:
                        val = Jt + int(r.integers(1, 4))
                    elif kind == 4:
                        val = int(r.choice([2 ** 31 - 1, (length + lp - 1) // lp]))
                    else:
                        val = int(r.integers(0, Jt + 1))
                    idx[s0 + t, h, k] = min(max(val, -(2 ** 31)), 2 ** 31 - 1)
        s0 += length
    return idx


# ---- NumPy cases -------------------------------------------------------------------------------


def numpy_dtype(r) -> str:
    return str(r.choice(["float32", "float32", "float16"]))


def case_numpy_forward(r, index: int) -> Case:
    p = draw_problem(r)
    dt = numpy_dtype(r)
    k, v = p.kv(dt)
    phi_k, phi_v = p.phis(dt)
    kw: dict = dict(cu_seqlens=p.cu, config=p.cfg, backend="cpu", num_threads=int(r.choice([0, 1, 2])))
    args = [p.q.astype(dt), k, v, p.g.astype(dt), phi_k, phi_v]
    case = Case(index, "numpy attention " + describe(p, dt), lambda: None)
    mutate(r, case, p, args, kw, main="q", arrays=("g",), kv_names=("k_cmp", "v_cmp"))

    def call():
        return nsa.attention(*args, return_aux=True, **kw)

    def check(result):
        o, aux = result
        truth_kw = dict(kw, backend="reference")
        t_o, t_aux = nsa.attention(p.q.astype(dt).astype(np.float64), _as64(k), _as64(v),
                                   p.g.astype(dt).astype(np.float64), _phi64(phi_k), _phi64(phi_v), return_aux=True,
                                   **truth_kw)
        agree = expect_indices_close(aux.indices, t_aux.indices, p.T, p.hkv)
        G = p.hq // p.hkv
        heads = np.repeat(agree.reshape(p.T, p.hkv), G, axis=1)
        expect_close("o", o[heads], t_o[heads], dt)
        expect_close("lse", aux.lse[heads], t_aux.lse[heads], "float32")

    case.call, case.check = call, (check if case.expect is None else None)
    return case


def _as64(x):
    if isinstance(x, tuple):
        return tuple(a.astype(np.float64) for a in x)
    return x.astype(np.float64)


def _phi64(phi):
    return None if phi is None else nsa.Phi(*[None if a is None else a.astype(np.float64) for a in phi])


def case_numpy_backward(r, index: int) -> Case:
    p = draw_problem(r)
    dt = numpy_dtype(r)
    k, v = p.kv(dt)
    phi_k, phi_v = p.phis(dt)
    q, g = p.q.astype(dt), p.g.astype(dt)
    kw: dict = dict(cu_seqlens=p.cu, config=p.cfg, num_threads=int(r.choice([0, 1, 2])))
    # The saved state of a reference forward in float64, or caller indices with their lse.
    o64, aux = nsa.attention(q.astype(np.float64), _as64(k), _as64(v), g.astype(np.float64), _phi64(phi_k),
                             _phi64(phi_v), return_aux=True, backend="reference", **kw)
    lse, idx = aux.lse.copy(), aux.indices
    if p.cfg.n_selected and r.random() < 0.5:
        idx = awkward_indices(r, p)
        ks = k if p.shared else k[1]
        vs = v if p.shared else v[1]
        lse[..., 1] = nsa.selected_attention(q.astype(np.float64), ks.astype(np.float64), vs.astype(np.float64), idx,
                                             backend="reference", **kw)[1]
    d_o = r.uniform(-1, 1, o64.shape).astype(dt)
    args = [q, k, v, g, phi_k, phi_v, lse, idx, d_o]
    kw["backend"] = "cpu"
    case = Case(index, "numpy attention_backward " + describe(p, dt), lambda: None)
    mutate(r, case, p, args, kw, main="q", arrays=("g", "lse", "indices", "d_o"), kv_names=("k_cmp", "v_cmp"))

    def call():
        return nsa.attention_backward(*args, **kw)

    def check(got):
        t = nsa.attention_backward(q.astype(np.float64), _as64(k), _as64(v), g.astype(np.float64), _phi64(phi_k),
                                   _phi64(phi_v), lse, idx, d_o.astype(np.float64), **dict(kw, backend="reference"))
        expect_close("dq", got.dq, t.dq, dt)
        expect_close("dg", got.dg, t.dg, dt)
        for name in ("dk", "dv"):
            a, b = getattr(got, name), getattr(t, name)
            for i, (x, y) in enumerate(zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,))):
                expect_close(f"{name}[{i}]", x, y, dt)
        if got.dphi_k is not None:
            for i, (x, y) in enumerate(zip(got.dphi_k, t.dphi_k)):
                if x is not None:
                    expect_close(f"dphi_k[{i}]", x, y, dt)

    case.call, case.check = call, (check if case.expect is None else None)
    return case


def case_numpy_stage(r, index: int) -> Case:
    p = draw_problem(r)
    dt = numpy_dtype(r)
    op = str(r.choice(["selected_attention", "window_attention", "dense_attention", "compress",
                       "compressed_attention", "select_topn"]))
    kw: dict = dict(cu_seqlens=p.cu, backend="cpu", num_threads=int(r.choice([0, 1, 2])))
    q, k, v = p.q.astype(dt), p.k[0].astype(dt), p.v[0].astype(dt)
    if op == "selected_attention":
        idx = awkward_indices(r, p) if p.cfg.n_selected else np.zeros((p.T, p.hkv, 0), np.int32)
        args, names = [q, k, v, idx], ("k", "v", "indices")
        fn = nsa.selected_attention
    elif op == "window_attention":
        args, names, fn = [q, k, v], ("k", "v"), nsa.window_attention
    elif op == "dense_attention":
        args, names, fn = [q, k, v], ("k", "v"), nsa.dense_attention
        kw["return_lse"] = True
    elif op == "compress":
        phi = p.phis(dt)[0]
        args, names, fn = [k, phi], (), nsa.compress
    elif op == "compressed_attention":
        d = p.cfg.cmp_stride
        kc = r.uniform(-1, 1, (p.T // d, p.hkv, p.dqk)).astype(dt)
        vc = r.uniform(-1, 1, (p.T // d, p.hkv, p.dv)).astype(dt)
        args, names, fn = [q, kc, vc], ("kc", "vc"), nsa.compressed_attention
    else:
        ns = -(-max(p.seqlens) // p.cfg.slc_block_len)
        args = [r.integers(0, 4, (p.T, p.hkv, max(ns, 1))).astype(np.float32)]
        names, fn = (), nsa.select_topn
    if op != "dense_attention":
        kw["config"] = p.cfg
    elif p.cfg.scale:
        kw["scale"] = p.cfg.scale
    main = {"compress": "x", "select_topn": "scores"}.get(op, "q")
    case = Case(index, f"numpy {op} " + describe(p, dt), lambda: None)
    mutate(r, case, p, args, kw, main=main, arrays=names, dense=op == "dense_attention")

    def call():
        return fn(*args, **kw)

    def check(got):
        ref_args = [a.astype(np.float64) if isinstance(a, np.ndarray) and a.dtype.kind == "f" and op != "select_topn"
                    else a for a in args]
        if op == "compress":
            ref_args[1] = _phi64(args[1])
        want = fn(*ref_args, **dict(kw, backend="reference"))
        if op == "select_topn":
            np.testing.assert_array_equal(got, want)
            return
        if op == "compress":
            expect_close("xc", got, want, dt)
            return
        gots, wants = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for i, (a, b) in enumerate(zip(gots, wants)):
            if a is None:
                continue
            expect_close(f"output {i}", a, b, dt if (a.dtype != np.float32 or dt == "float32") else "float32")

    case.call, case.check = call, (check if case.expect is None else None)
    return case


def case_numpy_decode(r, index: int) -> Case:
    p = draw_problem(r, cache=True)
    dt = "float32"
    cfg = p.cfg
    if cfg.slc_block_len > 64:
        cfg = dataclasses.replace(cfg, slc_block_len=cfg.cmp_stride * 2)
        p.cfg = cfg
    page = cfg.slc_block_len * int(r.choice([1, 2]))
    B, T = len(p.seqlens), p.T
    capacity = max(max(p.seqlens), 1) + int(r.integers(0, 5))
    max_pages = -(-capacity // page)
    P = B * max_pages + 2
    sets = 1 if p.shared else 3
    pools = []
    for s in range(3):
        if s < sets:
            pools += [np.zeros((P, page, p.hkv, p.dqk), dt), np.zeros((P, page, p.hkv, p.dv), dt)]
        else:
            pools += [None, None]
    slots = page // cfg.cmp_stride
    pools += [np.zeros((P, slots, p.hkv, p.dqk), dt), np.zeros((P, slots, p.hkv, p.dv), dt)]
    table = r.permutation(P)[:B * max_pages].reshape(B, max_pages).astype(np.int32)
    seq_lens = np.array(p.seqlens, np.int32)
    cache_kw: dict = dict(config=cfg, backend="cpu")
    k, v = p.kv(dt)
    phi_k, phi_v = p.phis(dt)
    q, g = p.q.astype(dt), p.g.astype(dt)
    cu = np.concatenate([[0], np.cumsum(p.seqlens)]).astype(np.int32)
    case = Case(index, "numpy cache_append+decode " + describe(p, dt) + f" page={page}", lambda: None)
    max_cache_len: Any = 0
    u = r.random()
    if u < 0.15:
        max_cache_len = r.choice(HUGE_INTS + (-1, max_pages * page + 1))
        case.mutation, case.expect = f"max_cache_len = {max_cache_len}", "pages.max_seqlen"
    elif u < 0.3 and B > 0 and T > 0:
        b = int(np.argmax(seq_lens))
        table[b, 0] = int(r.choice([-1, P, 2 ** 31 - 1]))
        case.mutation, case.expect = f"block_table[{b}][0] out of range", f"pages.block_table[{b}][0]"
    elif u < 0.4:
        b = int(r.integers(0, B))
        seq_lens[b] = max_pages * page + 1
        case.mutation, case.expect = f"seq_lens[{b}] past the capacity", f"pages.seq_lens[{b}]"
    elif u < 0.5:
        cache_kw["max_new"] = r.choice(HUGE_INTS)
        case.mutation, case.expect = f"max_new = {cache_kw['max_new']}", "seqs.max_seqlen"
    elif u < 0.6:
        cache_kw["num_threads"] = r.choice(HUGE_INTS + (-1, 2 ** 31))
        case.mutation, case.expect = f"num_threads = {cache_kw['num_threads']}", "ctx.num_threads"
    elif u < 0.65:
        table = None
        case.mutation, case.expect = "block_table = None", "pages.block_table"

    def arrays():
        return nsa.CacheArrays(tuple(pools), table, seq_lens, None, max_cache_len)

    def call():
        nsa.cache_append(arrays(), k, v, phi_k, phi_v, cu_seqlens=cu, **cache_kw)
        return nsa.decode(arrays(), q, g, cu_seqlens=cu, return_aux=True, **cache_kw)

    def check(result):
        o, aux = result
        t_o, t_aux = nsa.attention(q.astype(np.float64), _as64(k), _as64(v), g.astype(np.float64), _phi64(phi_k),
                                   _phi64(phi_v), cu_seqlens=cu, config=cfg, backend="reference", return_aux=True)
        agree = expect_indices_close(aux.indices, t_aux.indices, T, p.hkv)
        heads = np.repeat(agree.reshape(T, p.hkv), p.hq // p.hkv, axis=1)
        expect_close("decode o", o[heads], t_o[heads], dt)

    case.call, case.check = call, (check if case.expect is None else None)
    return case


def mutate(r, case: Case, p: Problem, args: list, kw: dict, main: str, arrays=(), kv_names=(), dense=False):
    # kv_names: the call is the layer's (k and v are tuples, never mutated here).
    """Breaks one thing of a call (or nothing: about 40% stay valid, some with valid extremes)."""
    u = r.random()
    cfg = kw.get("config")
    if u < 0.40:
        # (select_topn excluded: its scores, sized by the longest sequence, would be too narrow.)
        if r.random() < 0.25 and "config" in kw and kw.get("cu_seqlens") is not None and main != "scores":
            kw["max_seqlen"] = int(r.choice([max(p.seqlens), max(p.seqlens) + 7, 2 ** 31 - 1]))
            case.mutation = f"max_seqlen = {kw['max_seqlen']}"
        return
    if u < 0.55 and cfg is not None:
        field = str(r.choice(["cmp_block_len", "cmp_stride", "slc_block_len", "n_selected", "n_init", "n_local",
                              "window", "scale", "backbone_offsets"]))
        names = {"cmp_block_len": "cmp_block_len (l)", "cmp_stride": "cmp_stride (d)",
                 "slc_block_len": "slc_block_len (l')", "n_selected": "n_selected (n)", "window": "window (w)"}
        if field == "scale":
            value = r.choice([10 ** 400, float("nan"), -1.0, float("inf"), 1e39, "large"])
            expect = "scale"
        elif field == "backbone_offsets":
            value = (r.choice(list(HUGE_INTS) + [0, -3]),)
            expect = "backbone_offsets[0]"
        elif field == "n_selected":
            value = r.choice([2 ** 31, 2 ** 40, 2 ** 62, 2 ** 63 - 1, 2 ** 63, -1, 1.5])
            expect = names[field]
        else:
            value = r.choice(list(HUGE_INTS) + [2 ** 31, -1, 2.5, "8"])
            expect = names.get(field, field)
        kw["config"] = dataclasses.replace(cfg, **{field: value})
        case.mutation, case.expect = f"config.{field} = {value!r}", expect
        return
    if u < 0.60 and dense:
        kw["scale"] = r.choice([10 ** 400, float("nan"), -1.0, "x"])
        case.mutation, case.expect = f"scale = {kw['scale']!r}", "scale"
        return
    if u < 0.70:
        which = str(r.choice(["max_seqlen", "num_threads", "backend"]))
        if which == "max_seqlen":
            kw["max_seqlen"] = r.choice(list(HUGE_INTS) + [-1, 2 ** 31, 1.5])
            case.mutation, case.expect = f"max_seqlen = {kw['max_seqlen']!r}", "seqs.max_seqlen"
        elif which == "num_threads":
            kw["num_threads"] = r.choice(list(HUGE_INTS) + [-1, 2 ** 31, 2.0])
            case.mutation, case.expect = f"num_threads = {kw['num_threads']!r}", "ctx.num_threads"
        else:
            kw["backend"] = r.choice([3, "tpu", None])
            case.mutation, case.expect = f"backend = {kw['backend']!r}", "backend"
        return
    if u < 0.80 and p.cu is not None:
        cu = p.cu.astype(np.int64).copy()
        B = len(cu) - 1
        kind = int(r.integers(0, 4))
        if kind == 0:
            cu[0] = 1
            case.expect = "cu_seqlens[0]"
        elif kind == 1:
            cu[B] = p.T + 1
            case.expect = f"cu_seqlens[{B}]"
        elif kind == 2:
            kw["cu_seqlens"] = [int(c) for c in cu]
            kw["cu_seqlens"][1] = int(r.choice([2 ** 32 + 10, 2 ** 63, 2 ** 70, -5]))
            case.mutation, case.expect = f"cu_seqlens[1] = {kw['cu_seqlens'][1]}", "cu_seqlens"
            return
        else:
            kw["cu_seqlens"] = cu.astype(np.float64)
            case.mutation, case.expect = "cu_seqlens float64", "cu_seqlens.dtype"
            return
        kw["cu_seqlens"] = cu
        case.mutation = f"cu_seqlens = {cu.tolist()}"
        return
    # An array: None, another dtype, a shape off by one, another rank. Positions in args: the
    # layer's (q, k, v, g, phi_k, phi_v, then lse, indices, d_o) or a stage's (main, then arrays).
    if kv_names:
        positions = {main: 0, "g": 3}
        for i, name in enumerate(a for a in arrays if a != "g"):
            positions[name] = 6 + i
    else:
        positions = {main: 0}
        for i, name in enumerate(arrays):
            positions[name] = 1 + i
    name = str(r.choice(list(positions)))
    pos = positions[name]
    arr = args[pos]
    kind = int(r.integers(0, 4))
    if kind == 0 or arr is None or isinstance(arr, tuple):
        args[pos] = None
        case.mutation, case.expect = f"{name} = None", name
    elif kind == 1:
        want = "int32" if name == "indices" else None
        bad = str(r.choice([t for t in ("int64", "bool", "complex64", "int32", "uint8") if t != want]))
        with np.errstate(invalid="ignore"):  # -inf in lse does not fit an integer: any value does
            args[pos] = arr.astype(bad)
        case.mutation, case.expect = f"{name}.dtype = {bad}", f"{name}.dtype"
    elif kind == 2 and arr.ndim == 3 and name not in (main, "v", "vc"):  # v's last dim defines Dv
        shape = list(arr.shape)
        shape[2] += 1
        args[pos] = np.zeros(shape, arr.dtype)
        case.mutation, case.expect = f"{name}.shape[2] + 1", f"{name}.shape[2]"
    else:
        args[pos] = np.zeros(arr.shape[:-1] if arr.ndim > 1 else (1,) + arr.shape, arr.dtype)
        case.mutation, case.expect = f"{name} of rank {args[pos].ndim}", f"{name}.ndim"


# ---- torch cases -------------------------------------------------------------------------------


def case_torch_layer(r, index: int) -> Case:
    import torch

    hidden = int(r.choice([8, 16, 24]))
    heads = int(r.choice([1, 2, 4]))
    kv_heads = heads // int(r.choice([1, heads])) if heads > 1 else 1
    cfg = nsa.Config(cmp_block_len=4, cmp_stride=2, slc_block_len=4, n_selected=3, n_init=1, n_local=1, window=5)
    phi = str(r.choice(["mean", "linear", "mlp"]))
    kwargs: dict = dict(hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, config=cfg, phi=phi, phi_hidden=3,
                        rotary=False)
    seqlens = [int(r.choice([0, 1, 5, int(r.integers(2, 30))])) for _ in range(int(r.integers(1, 3)))]
    T = sum(seqlens)
    cu = torch.tensor([0, *np.cumsum(seqlens).tolist()], dtype=torch.int64)
    case = Case(index, f"torch layer hidden={hidden} heads={heads}/{kv_heads} phi={phi} seqlens={seqlens}",
                lambda: None)
    u = r.random()
    forward_kw: dict = dict(cu_seqlens=cu)
    if u < 0.2:
        field = str(r.choice(["num_heads", "hidden_size", "head_dim", "num_kv_heads"]))
        value = r.choice([0, -1, 2 ** 63, 2 ** 64, 1.5]) if field != "num_kv_heads" else r.choice([2 ** 63, 1.5])
        kwargs[field] = value
        case.mutation, case.expect = f"{field} = {value!r}", field
    elif u < 0.3:
        kwargs["config"] = dataclasses.replace(cfg, window=r.choice(HUGE_INTS))
        case.mutation, case.expect = "config.window huge", "window (w)"
    elif u < 0.4 and len(seqlens) > 1:
        bad = cu.clone()
        bad[1] = int(r.choice([2 ** 32 + 10, -1]))
        forward_kw["cu_seqlens"] = bad
        case.mutation = f"cu_seqlens[1] = {int(bad[1])}"
        case.expect = "cu_seqlens[1]" if int(bad[1]) < 0 else "cu_seqlens[2]"
        if int(bad[1]) > T and len(seqlens) == 2:
            case.expect = "cu_seqlens[2]"
    elif u < 0.5:
        kwargs["num_threads"] = r.choice(HUGE_INTS)
        case.mutation, case.expect = "num_threads huge", "ctx.num_threads"

    def call():
        torch.manual_seed(index)
        layer = nsa.NativeSparseAttention(backend="cpu", dtype=torch.float32, **kwargs)
        x = torch.randn(T, hidden)
        return layer, x, layer(x, **forward_kw)

    def check(result):
        layer, x, y = result
        ref = nsa.NativeSparseAttention(backend="reference", dtype=torch.float64, **kwargs)
        ref.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
        with torch.no_grad():
            want = ref(x.double(), **forward_kw)
        # The layer's selection runs on scores computed from f32 projections: compare rows whose
        # output agrees closely, all but a percent of them.
        if T == 0:
            if y.shape != want.shape:
                raise Mismatch(f"layer: shape {tuple(y.shape)} instead of {tuple(want.shape)}")
            return
        diff = (y.double() - want).abs().amax(dim=-1)
        tol = 1e-4 * max(1.0, float(want.abs().max()))
        if int((diff > tol).sum()) > max(1, T // 100):
            raise Mismatch(f"layer: {int((diff > tol).sum())} of {T} rows differ from the reference")

    case.call, case.check = call, (check if case.expect is None else None)
    return case


def case_torch_ops(r, index: int) -> Case:
    import torch

    p = draw_problem(r)
    dt = str(r.choice(["float32", "bfloat16"]))
    tdt = getattr(torch, dt)
    k, v = p.kv()
    tk = tuple(torch.from_numpy(a).to(tdt) for a in k) if isinstance(k, tuple) else torch.from_numpy(k).to(tdt)
    tv = tuple(torch.from_numpy(a).to(tdt) for a in v) if isinstance(v, tuple) else torch.from_numpy(v).to(tdt)
    q, g = torch.from_numpy(p.q).to(tdt), torch.from_numpy(p.g).to(tdt)
    phi_k, phi_v = (None if ph is None else nsa.Phi(*[None if a is None else torch.from_numpy(a).to(tdt) for a in ph])
                    for ph in (p.phi_k, p.phi_v))
    cu = None if p.cu is None else torch.from_numpy(p.cu.astype(np.int64))
    kw: dict = dict(cu_seqlens=cu, config=p.cfg, backend="cpu")
    case = Case(index, "torch attention " + describe(p, dt), lambda: None)
    u = r.random()
    if u < 0.15 and cu is not None:
        bad = cu.clone()
        bad[-1] = 2 ** 32 + p.T
        kw["cu_seqlens"] = bad
        case.mutation, case.expect = "cu_seqlens int64 past int32", "cu_seqlens"
    elif u < 0.25:
        kw["config"] = dataclasses.replace(p.cfg, n_local=r.choice(HUGE_INTS))
        case.mutation, case.expect = "config.n_local huge", "n_local"
    elif u < 0.35:
        kw["max_seqlen"] = r.choice(HUGE_INTS)
        case.mutation, case.expect = "max_seqlen huge", "seqs.max_seqlen"
    elif u < 0.45:
        q = q.to(torch.int64)
        case.mutation, case.expect = "q int64", "q.dtype"
    elif u < 0.55:
        g = g.to("meta")
        case.mutation, case.expect = "g on meta", "g.device"
    elif u < 0.6:
        kw["num_threads"] = r.choice(HUGE_INTS)
        case.mutation, case.expect = "num_threads huge", "ctx.num_threads"

    def call():
        return nsa.attention(q, tk, tv, g, phi_k, phi_v, return_aux=True, **kw)

    def check(result):
        o, aux = result
        def f64(x):
            return None if x is None else x.double().numpy()
        t_o, t_aux = nsa.attention(f64(q), tuple(f64(a) for a in tk) if isinstance(tk, tuple) else f64(tk),
                                   tuple(f64(a) for a in tv) if isinstance(tv, tuple) else f64(tv), f64(g),
                                   None if phi_k is None else nsa.Phi(*[f64(a) for a in phi_k]),
                                   None if phi_v is None else nsa.Phi(*[f64(a) for a in phi_v]),
                                   cu_seqlens=p.cu, config=p.cfg, backend="reference", return_aux=True)
        agree = expect_indices_close(aux.indices.numpy(), t_aux.indices, p.T, p.hkv)
        heads = np.repeat(agree.reshape(p.T, p.hkv), p.hq // p.hkv, axis=1)
        expect_close("o", o.double().numpy()[heads], t_o[heads], dt)

    case.call, case.check = call, (check if case.expect is None else None)
    return case


# ---- The driver --------------------------------------------------------------------------------

KINDS = (case_numpy_forward, case_numpy_forward, case_numpy_backward, case_numpy_stage, case_numpy_stage,
         case_numpy_stage, case_numpy_decode)
TORCH_KINDS = (case_torch_layer, case_torch_ops)


def make_case(seed: int, index: int) -> Case:
    r = np.random.default_rng([seed, index])
    kinds = KINDS + (TORCH_KINDS if has_torch() else ())
    kind = kinds[int(r.integers(0, len(kinds)))]
    case = kind(r, index)
    case.text = f"case {index} (seed {seed}): {case.text}"
    return case


def run_case(case: Case) -> str:
    """'ok' or 'error' when the case ends as it must; raises AssertionError (Mismatch) otherwise."""
    try:
        result = case.call()
    except nsa.Error as e:
        if case.expect is None:
            raise AssertionError(f"a valid call was rejected: {e}") from None
        if e.parameter != case.expect:
            raise AssertionError(f"the error names {e.parameter!r}, expected {case.expect!r}: {e}") from None
        if e.parameter not in str(e) or not e.allowed:
            raise AssertionError(f"an nsa.Error that does not name its parameter or what is allowed: {e}")
        return "error"
    except Exception as e:  # noqa: BLE001 - anything but nsa.Error is a failure of the case
        raise AssertionError(f"{type(e).__name__} instead of nsa.Error or a result: {e}") from e
    if case.expect is not None:
        raise AssertionError(f"an invalid call was accepted (expected an error naming {case.expect!r})")
    if case.check is not None:
        try:
            case.check(result)
        except Mismatch:
            raise
        except Exception as e:  # noqa: BLE001 - the harness's own failure, reported with the case
            raise AssertionError(f"comparison failed: {type(e).__name__}: {e}") from e
    return "ok"


def run(seed: int, first: int, cases: int, timeout: float = 60.0, verbose: bool = False) -> list:
    """Runs cases [first, first + cases) of `seed`; returns the failures (text, message)."""
    faulthandler.enable()
    failures = []
    counts = {"ok": 0, "error": 0}
    start = time.time()
    for i in range(first, first + cases):
        case = make_case(seed, i)
        if verbose:
            print(f"{case.text} | mutation: {case.mutation} | expect: {case.expect or 'success'}", flush=True)
        # The watchdog: a case past the timeout dumps every thread's stack and exits the process.
        faulthandler.dump_traceback_later(timeout, exit=True)
        try:
            counts[run_case(case)] += 1
        except AssertionError as e:
            failures.append((f"{case.text} | mutation: {case.mutation}", str(e)))
        finally:
            faulthandler.cancel_dump_traceback_later()
    print(f"fuzz_cases: seed {seed}, cases {first}..{first + cases - 1} in {time.time() - start:.1f} s: "
          f"{counts['ok']} matched the reference, {counts['error']} named errors, {len(failures)} failures")
    for text, message in failures:
        print(f"FAIL {text}\n    {message}")
    return failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--case-timeout", type=float, default=60.0)
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    return 1 if run(a.seed, a.first, a.cases, a.case_timeout, a.verbose) else 0


if __name__ == "__main__":
    sys.exit(main())
