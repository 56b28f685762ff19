"""Framework-neutral calls into the extension: output and workspace allocation, then one library call.

Every function here takes arrays of one framework (numpy or torch, described by an ``_Arrays``
object), allocates the outputs with that framework on the inputs' device, asks the library how
much workspace the call needs and allocates that too, then calls ``nsa._nsa``. Shapes follow
include/nsa/api.h: T packed tokens, Hq/Hkv heads, Dqk/Dv head dims, n = n_selected.
The library validates every argument; errors arrive as ``nsa.Error`` (a ValueError).
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, NamedTuple, Optional, Sequence

from . import _nsa

Error = _nsa.Error

# Names of the 5 phi parameters, in the order the extension takes them.
PHI_FIELDS = ("w1", "b1", "w2", "b2", "pe")
# Names of the six raw K/V arrays, in the order the extension takes them.
KV_NAMES = ("k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win")


def error(parameter: str, value: Any, allowed: str) -> Error:
    """An nsa.Error in the library's own format (``nsa: invalid P = V: allowed``)."""
    err = Error(f"nsa: invalid {parameter} = {value}: {allowed}")
    err.parameter, err.value, err.allowed = parameter, str(value), allowed
    return err


_INT64_MIN, _INT64_MAX = -2 ** 63, 2 ** 63 - 1


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_int(value: Any, parameter: str, lo: int = _INT64_MIN, hi: int = _INT64_MAX,
              allowed: Optional[str] = None) -> int:
    """value as a Python int (ints, numpy and torch integers; not floats or strings) in [lo, hi],
    else an nsa.Error naming `parameter`. The extension takes int64 (int for threads): a Python int
    past that range would otherwise be a bare TypeError from the binding."""
    if type(value).__name__ == "SymInt":  # a symbolic size while torch.compile traces: checked when it runs
        return value
    try:
        v = operator.index(value)
    except TypeError:
        raise error(parameter, _shown(value), "must be an integer") from None
    if not lo <= v <= hi:
        raise error(parameter, v, allowed or f"must be in [{lo}, {hi}]")
    return v


def check_float(value: Any, parameter: str) -> float:
    """value as a float (NaN and infinities pass: the library names them), else an nsa.Error."""
    try:
        return value if type(value).__name__ == "SymFloat" else float(value)
    except (TypeError, ValueError, OverflowError):
        raise error(parameter, _shown(value), "must be a real number that fits a double") from None


# The largest array the package allocates for a call (an output or a workspace) without trying:
# 2^48 bytes. Larger ones, and ones the framework fails to allocate, are an nsa.Error naming the
# parameter that sized them (e.g. n_selected for the indices [T, Hkv, n]), not a MemoryError.
_MAX_ALLOCATION = 2 ** 48


def allocate(make, shape, itemsize: int, parameter: str, value: Any, what: str):
    """make() (an allocation of `shape` with `itemsize` bytes an element), checked first."""
    nbytes = itemsize
    for n in shape:
        nbytes *= max(int(n), 0)  # Python ints: no overflow
    if nbytes > _MAX_ALLOCATION:
        raise error(parameter, value, f"gives {what} of {nbytes} bytes, above the 2^48 bytes nsa allocates")
    try:
        return make()
    except (MemoryError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and "memory" not in str(e).lower() and "alloc" not in str(e).lower():
            raise
        raise error(parameter, value, f"gives {what} of {nbytes} bytes, which could not be allocated") from None


@dataclasses.dataclass(frozen=True)
class Config:
    """NSA's configuration (spec §1); the defaults are the paper's.

    ``scale = 0`` means 1/sqrt(Dqk). The compression function phi is not part of it: it follows
    from the phi parameters a call receives (none: mean; w1 and pe: linear; all five: mlp).
    """

    cmp_block_len: int = 32  # l
    cmp_stride: int = 16  # d, divides l and l'
    slc_block_len: int = 64  # l'
    n_selected: int = 16  # n, forced blocks included; 0 turns selection off
    n_init: int = 1
    n_local: int = 2
    window: int = 512  # w, the query's own token included; 0 turns the window off
    scale: float = 0.0
    # The reach backbone (spec §11): block offsets every query also forces (J_t - o); at most 8,
    # distinct, >= 1; n_init + n_local + len(backbone_offsets) <= n. Empty: plain NSA.
    backbone_offsets: tuple = ()

    def checked(self) -> "Config":
        """The same Config with every field a Python int (or float for scale) that the extension
        can take: a non-integer, or an integer past int64, is an nsa.Error under the library's name
        for the field (the library itself bounds the fields at 2^31 - 1)."""
        fields = {f: check_int(getattr(self, f), name) for f, name in _CONFIG_NAMES.items()}
        if not isinstance(self.backbone_offsets, (tuple, list)):
            raise error("backbone_offsets", _shown(self.backbone_offsets), "must be a tuple of block offsets")
        offsets = tuple(check_int(o, f"backbone_offsets[{k}]") for k, o in enumerate(self.backbone_offsets))
        return Config(**fields, scale=check_float(self.scale, "scale"), backbone_offsets=offsets)

    def native(self, phi: str = "mean", shared_kv: bool = False) -> "_nsa.Config":
        v = self.checked()
        c = _nsa.Config()
        c.cmp_block_len = v.cmp_block_len
        c.cmp_stride = v.cmp_stride
        c.slc_block_len = v.slc_block_len
        c.n_selected = v.n_selected
        c.n_init = v.n_init
        c.n_local = v.n_local
        c.window = v.window
        c.scale = v.scale
        c.backbone_offsets = list(v.backbone_offsets)
        c.phi = _nsa.parse_phi_kind(phi)
        c.shared_kv = bool(shared_kv)
        return c

    def ints(self) -> list:
        """The integer fields, in declaration order, then the backbone's offsets (how the torch
        operators receive a Config)."""
        v = self.checked()
        return [v.cmp_block_len, v.cmp_stride, v.slc_block_len, v.n_selected, v.n_init, v.n_local, v.window,
                *v.backbone_offsets]

    @staticmethod
    def from_ints(ints: Sequence[int], scale: float) -> "Config":
        if len(ints) < 7:
            raise error("config", list(ints), "must hold 7 integers (l, d, l', n, n_init, n_local, w) and the "
                                               "backbone's offsets")
        return Config(*[int(i) for i in ints[:7]], scale=float(scale), backbone_offsets=tuple(int(i) for i in ints[7:]))


# The library's names for the integer fields (src/common/core.cpp Config::validate).
_CONFIG_NAMES = {"cmp_block_len": "cmp_block_len (l)", "cmp_stride": "cmp_stride (d)",
                 "slc_block_len": "slc_block_len (l')", "n_selected": "n_selected (n)", "n_init": "n_init",
                 "n_local": "n_local", "window": "window (w)"}


def make_config(config: Optional[Config], overrides: dict) -> Config:
    cfg = config if config is not None else Config()
    if not isinstance(cfg, Config):
        raise error("config", type(cfg).__name__, "must be an nsa.Config or None")
    if overrides:
        fields = {f.name for f in dataclasses.fields(Config)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise error("keyword " + unknown[0], overrides[unknown[0]],
                        "is not a Config field (" + ", ".join(sorted(fields)) + ")")
        cfg = dataclasses.replace(cfg, **overrides)
    return cfg


class Phi(NamedTuple):
    """Parameters of one compression function phi (spec §2), shared by all KV heads.

    mean: none (pass ``None`` instead of a Phi); linear: ``w1 = W [D, l*D]`` and ``pe [l, D]``;
    mlp: ``w1 [F, l*D], b1 [F], w2 [D, F], b2 [D], pe [l, D]``.
    """

    w1: Any = None
    b1: Any = None
    w2: Any = None
    b2: Any = None
    pe: Any = None


def phi_kind(phi: Optional[Phi]) -> str:
    if phi is None or all(p is None for p in phi):
        return "mean"
    return "linear" if phi.w2 is None and phi.b1 is None and phi.b2 is None else "mlp"


def as_phi(phi: Any, name: str) -> Optional[Phi]:
    if phi is None:
        return None
    if isinstance(phi, dict):
        unknown = sorted(set(phi) - set(PHI_FIELDS))
        if unknown:
            raise error(name + "." + unknown[0], "given", "is not a phi parameter (w1, b1, w2, b2, pe)")
        return Phi(**phi)
    if isinstance(phi, (tuple, list)) and len(phi) == 5:
        return Phi(*phi)
    raise error(name, type(phi).__name__, "must be None (mean), an nsa.Phi, a dict or a 5-tuple (w1, b1, w2, b2, pe)")


def phi_pair_kind(phi_k: Optional[Phi], phi_v: Optional[Phi]) -> str:
    kind_k, kind_v = phi_kind(phi_k), phi_kind(phi_v)
    if kind_k != kind_v:
        raise error("phi_v", f"a {kind_v} phi", f"must be of the same kind as phi_k ({kind_k})")
    return kind_k


def phi_hidden(phi: Optional[Phi]) -> int:
    return int(phi.w1.shape[0]) if phi is not None and phi.w1 is not None and phi.w2 is not None else 0


def dims(x: Any, name: str, ndim: int, names: str) -> tuple:
    if x is None:
        raise error(name, "absent", "required, shape " + names)
    if len(x.shape) != ndim:
        raise error(name + ".ndim", len(x.shape), f"must be {ndim} (shape {names}, got {list(x.shape)})")
    return tuple(int(s) for s in x.shape)


# ---- Calls ------------------------------------------------------------------------------------


# The dtypes a call's main array (q, x, ...) may have; the library's own words (validate.cpp).
_FLOAT_DTYPES = ("f32", "bf16", "f16", "f64")


class Call:
    """What every call shares: framework, context, sequences and the workspace request.

    ``main`` is the array that decides the backend, dtype and device (``main_name`` in messages).
    Its dtype is checked here, before the workspace query, so that a wrong one is reported under
    its own name (``q.dtype = i32``) rather than as the workspace query's ``dtype`` argument.
    """

    def __init__(self, fw, main, backend: str, num_threads: int, cu_seqlens, max_seqlen: Optional[int],
                 main_name: str = "q"):
        if not isinstance(backend, str):
            raise error("backend", repr(backend), "must be one of 'auto', 'reference', 'cpu', 'cuda'")
        if main is not None and fw.dtype_name(main) not in _FLOAT_DTYPES:
            raise error(main_name + ".dtype", fw.dtype_name(main), "must be f32, bf16, f16 or f64")
        self.fw = fw
        self.main = main
        self.backend = backend
        self.num_threads = threads(num_threads)
        self.cu = fw.to_int32(cu_seqlens) if cu_seqlens is not None else None
        self.max_seqlen = (check_int(max_seqlen, "seqs.max_seqlen", 0, allowed="must be >= 0 (0: derive it)")
                           if max_seqlen is not None else 0)
        self.stream = fw.stream(main)
        self.ctx = (backend, self.stream, self.num_threads)

    def batch(self) -> int:
        # An empty or malformed table sizes nothing here; the library names it (cu_seqlens.shape[0]).
        return max(int(self.cu.shape[0]) - 1, 0) if self.cu is not None and len(self.cu.shape) == 1 else 1

    def longest(self, T: int) -> int:
        """max_seqlen for workspace sizes and score widths; host cu_seqlens are read here. A
        declared bound above T counts as T (no sequence is longer), as in the library."""
        if self.max_seqlen:
            return min(self.max_seqlen, T) if self.max_seqlen > 0 else self.max_seqlen
        if self.cu is None:
            return T
        if self.fw.device(self.cu) != "cpu":
            raise error("max_seqlen", 0, "must be given (>= the longest sequence) when cu_seqlens is on the GPU")
        c = [int(v) for v in self.cu.tolist()] if len(self.cu.shape) == 1 else []
        return max([b - a for a, b in zip(c, c[1:])] + [0])

    def workspace(self, op: str, cfg, T: int, hq: int, hkv: int, dqk: int, dv: int, hidden: int = 0):
        nbytes = _nsa.workspace_size(op, self.backend, self.num_threads, cfg, T, self.batch(),
                                     self.longest(T), hq, hkv, dqk, dv, hidden,
                                     self.fw.dtype_name(self.main), self.fw.device(self.main))
        return workspace(self.fw, nbytes, self.main)


def threads(num_threads: Any) -> int:
    """num_threads as the extension's int: 0 (the default) or a thread count."""
    return check_int(num_threads, "ctx.num_threads", 0, 2 ** 31 - 1, "must be in [0, 2^31 - 1] (0: the default)")


def workspace(fw, nbytes: int, like):
    """The workspace a call asked for (None for 0 bytes), allocated through `allocate`."""
    if not nbytes:
        return None
    return allocate(lambda: fw.workspace(nbytes, like), (nbytes,), 1, "workspace", nbytes, "a workspace")


def indices_like(fw, T: int, Hkv: int, n: int, like):
    """An indices output [T, Hkv, n] int32: its size is the configuration's n times the rows (a
    negative n allocates nothing here; the library names it)."""
    n = max(n, 0)
    return allocate(lambda: fw.empty((T, Hkv, n), fw.i32, like), (T, Hkv, n), 4, "n_selected (n)", n,
                    f"an indices output [{T}, {Hkv}, {n}] int32")


def _phi_tuple(fw, phi: Optional[Phi]):
    return None if phi is None else tuple(fw.prepare(p) for p in phi)


def compress(fw, cfg: Config, phi: Optional[Phi], x, cu_seqlens=None, max_seqlen=None,
             backend="auto", num_threads=0):
    """xc [T/d, Hkv, D] = phi(x [T, Hkv, D]); rows no compressed block uses are zero."""
    x = fw.prepare(x)
    T, H, D = dims(x, "x", 3, "[T, Hkv, D]")
    call = Call(fw, x, backend, num_threads, cu_seqlens, max_seqlen, "x")
    kind = phi_kind(phi)
    c = cfg.native(kind)
    xc = fw.zeros((T // max(c.cmp_stride, 1), H, D), x.dtype, x)
    ws = call.workspace("compress_fwd", c, T, H, H, D, D, phi_hidden(phi))
    with fw.device_guard(x):
        _nsa.compress_fwd(*call.ctx, c, _phi_tuple(fw, phi), x, call.cu, call.max_seqlen, xc, ws)
    return xc


def compress_backward(fw, cfg: Config, phi: Optional[Phi], x, dxc, cu_seqlens=None, max_seqlen=None,
                      backend="auto", num_threads=0):
    """(dx [T, Hkv, D], dphi: Phi of gradients or None for mean) from dxc [T/d, Hkv, D]."""
    x, dxc = fw.prepare(x), fw.prepare(dxc)
    T, H, D = dims(x, "x", 3, "[T, Hkv, D]")
    call = Call(fw, x, backend, num_threads, cu_seqlens, max_seqlen, "x")
    kind = phi_kind(phi)
    c = cfg.native(kind)
    dx = fw.empty((T, H, D), x.dtype, x)
    dphi = None if kind == "mean" else Phi(*[None if p is None else fw.empty(tuple(p.shape), x.dtype, x) for p in phi])
    ws = call.workspace("compress_bwd", c, T, H, H, D, D, phi_hidden(phi))
    with fw.device_guard(x):
        _nsa.compress_bwd(*call.ctx, c, _phi_tuple(fw, phi), x, call.cu, call.max_seqlen, dxc, dx,
                          None if dphi is None else tuple(dphi), ws)
    return dx, dphi


def compressed_attention(fw, cfg: Config, q, kc, vc, cu_seqlens=None, max_seqlen=None, scores=True,
                         backend="auto", num_threads=0):
    """(o [T, Hq, Dv], lse [T, Hq] f32, scores [T, Hkv, Ns] f32 or None), Ns = ceil(max_seqlen / l')."""
    q, kc, vc = fw.prepare(q), fw.prepare(kc), fw.prepare(vc)
    T, Hq, Dqk = dims(q, "q", 3, "[T, Hq, Dqk]")
    _, Hkv, _ = dims(kc, "kc", 3, "[T/d, Hkv, Dqk]")
    Dv = dims(vc, "vc", 3, "[T/d, Hkv, Dv]")[2]
    call = Call(fw, q, backend, num_threads, cu_seqlens, max_seqlen)
    c = cfg.native()
    o = fw.empty((T, Hq, Dv), q.dtype, q)
    lse = fw.empty((T, Hq), fw.f32, q)
    S = None
    if scores:
        ns = -(-call.longest(T) // max(c.slc_block_len, 1))
        S = fw.empty((T, Hkv, ns), fw.f32, q)
    ws = call.workspace("compressed_attention_fwd", c, T, Hq, Hkv, Dqk, Dv)
    with fw.device_guard(q):
        _nsa.compressed_attention_fwd(*call.ctx, c, q, kc, vc, call.cu, call.max_seqlen, o, lse, S, ws)
    return o, lse, S


def select_topn(fw, cfg: Config, scores, cu_seqlens=None, max_seqlen=None, backend="auto", num_threads=0):
    """indices [T, Hkv, n] int32 (ascending, padded with -1) from scores [T, Hkv, Ns] f32."""
    scores = fw.prepare(scores)
    T, Hkv, _ = dims(scores, "scores", 3, "[T, Hkv, Ns]")
    call = Call(fw, scores, backend, num_threads, cu_seqlens, max_seqlen, "scores")
    c = cfg.native()
    idx = indices_like(fw, T, Hkv, c.n_selected, scores)
    ws = call.workspace("select_topn", c, T, Hkv, Hkv, 1, 1)
    with fw.device_guard(scores):
        _nsa.select_topn(*call.ctx, c, scores, call.cu, call.max_seqlen, idx, ws)
    return idx


def _branch_attention(fw, op: str, cfg: Config, q, k, v, indices, cu_seqlens, max_seqlen, backend,
                      num_threads):
    """(o, lse) of one branch through the native op `op`; indices only for the selection branch."""
    q, k, v = fw.prepare(q), fw.prepare(k), fw.prepare(v)
    # The selection's indices (None too: the library names an absent one); no argument for the window.
    extra = (fw.prepare(indices),) if op == "selected_attention_fwd" else ()
    T, Hq, Dqk = dims(q, "q", 3, "[T, Hq, Dqk]")
    Hkv = dims(k, "k", 3, "[T, Hkv, Dqk]")[1]
    Dv = dims(v, "v", 3, "[T, Hkv, Dv]")[2]
    call = Call(fw, q, backend, num_threads, cu_seqlens, max_seqlen)
    c = cfg.native()
    o = fw.empty((T, Hq, Dv), q.dtype, q)
    lse = fw.empty((T, Hq), fw.f32, q)
    ws = call.workspace(op, c, T, Hq, Hkv, Dqk, Dv)
    with fw.device_guard(q):
        getattr(_nsa, op)(*call.ctx, c, q, k, v, *extra, call.cu, call.max_seqlen, o, lse, ws)
    return o, lse


def selected_attention(fw, cfg: Config, q, k, v, indices, cu_seqlens=None, max_seqlen=None,
                       backend="auto", num_threads=0):
    """(o [T, Hq, Dv], lse [T, Hq] f32): attention over the blocks in indices [T, Hkv, n]."""
    return _branch_attention(fw, "selected_attention_fwd", cfg, q, k, v, indices, cu_seqlens, max_seqlen,
                             backend, num_threads)


def window_attention(fw, cfg: Config, q, k, v, cu_seqlens=None, max_seqlen=None, backend="auto",
                     num_threads=0):
    """(o [T, Hq, Dv], lse [T, Hq] f32): sliding-window attention over the last w positions."""
    return _branch_attention(fw, "window_attention_fwd", cfg, q, k, v, None, cu_seqlens, max_seqlen, backend,
                             num_threads)


def split_kv(k, v):
    """The six raw K/V arrays and shared_kv from k, v: arrays (shared) or 3-sequences (per branch)."""
    k_seq, v_seq = isinstance(k, (tuple, list)), isinstance(v, (tuple, list))
    if k_seq != v_seq:
        raise error("v" if k_seq else "k", "an array" if k_seq else "a sequence",
                    "must match k: both arrays (shared K/V) or both (cmp, slc, win) sequences")
    if not k_seq:
        return (k, v, None, None, None, None), True
    if len(k) != 3 or len(v) != 3:
        raise error("k" if len(k) != 3 else "v", f"a sequence of {len(k) if len(k) != 3 else len(v)}",
                    "must hold 3 arrays (cmp, slc, win) or be one array shared by all branches")
    return (k[0], v[0], k[1], v[1], k[2], v[2]), False


class ForwardResult(NamedTuple):
    o: Any  # [T, Hq, Dv]
    lse: Any  # [T, Hq, 3] f32, per branch, -inf where a branch is empty
    indices: Any  # [T, Hkv, n] int32
    o_branch: Any  # [3, T, Hq, Dv] or None


def _layer_kv(fw, q, kv6):
    """What forward and backward read off the layer's inputs: the six raw K/V arrays prepared,
    whether they are shared (no slc and win arrays) and the sizes (Tq, Tk, Hq, Hkv, Dqk, Dv):
    Tq the query rows (q's), Tk the key rows (k_cmp's; Tq without a query packing)."""
    kv6 = tuple(fw.prepare(x) for x in kv6)
    shared = kv6[2] is None and kv6[3] is None and kv6[4] is None and kv6[5] is None
    T, Hq, Dqk = dims(q, "q", 3, "[T, Hq, Dqk]")
    Tk, Hkv, _ = dims(kv6[0], "k_cmp", 3, "[T, Hkv, Dqk]")
    Dv = dims(kv6[1], "v_cmp", 3, "[T, Hkv, Dv]")[2]
    return kv6, shared, (T, Tk, Hq, Hkv, Dqk, Dv)


def _query_packing(fw, cu_seqlens_q, max_seqlen_q):
    """(cu_seqlens_q as int32 or None, max_seqlen_q as the extension's int) of a layer call."""
    ms = (check_int(max_seqlen_q, "seqs_q.max_seqlen", 0, allowed="must be >= 0 (0: derive it)")
          if max_seqlen_q is not None else 0)
    return (None if cu_seqlens_q is None else fw.to_int32(cu_seqlens_q)), ms


def forward(fw, cfg: Config, q, kv6, g, phi_k: Optional[Phi], phi_v: Optional[Phi], cu_seqlens=None,
            max_seqlen=None, backend="auto", num_threads=0, branches=False, cu_seqlens_q=None,
            max_seqlen_q=None, o_cmp=None, o_win=None) -> ForwardResult:
    """cu_seqlens_q: the query packing (api.h Inputs::seqs_q): sequence b's queries are its last
    cu_seqlens_q[b+1] - cu_seqlens_q[b] positions, q and the outputs have cu_seqlens_q[-1] rows.
    None: every position is a query. o_cmp, o_win: arrays [T, Hq, Dv] of q's dtype to write the
    compressed and the window branch's output into (kept for the backward; not with branches)."""
    q, g = fw.prepare(q), fw.prepare(g)
    kv6, shared, (T, Tk, Hq, Hkv, Dqk, Dv) = _layer_kv(fw, q, kv6)
    cu_q, ms_q = _query_packing(fw, cu_seqlens_q, max_seqlen_q)
    Tk = Tk if cu_q is not None else T
    call = Call(fw, q, backend, num_threads, cu_seqlens, max_seqlen)
    c = cfg.native(phi_pair_kind(phi_k, phi_v), shared)
    o = fw.empty((T, Hq, Dv), q.dtype, q)
    lse = fw.empty((T, Hq, 3), fw.f32, q)
    idx = indices_like(fw, T, Hkv, c.n_selected, q)
    ob = fw.empty((3, T, Hq, Dv), q.dtype, q) if branches else None
    ws = call.workspace("forward", c, Tk, Hq, Hkv, Dqk, Dv, max(phi_hidden(phi_k), phi_hidden(phi_v)))
    with fw.device_guard(q):
        _nsa.forward(*call.ctx, c, q, kv6, g, _phi_tuple(fw, phi_k), _phi_tuple(fw, phi_v), call.cu,
                     call.max_seqlen, o, lse, idx, ob, ws, cu_q, ms_q, o_cmp, o_win)
    return ForwardResult(o, lse, idx, ob)


class Gradients(NamedTuple):
    dq: Any  # [T, Hq, Dqk]
    dkv: tuple  # six entries like the raw K/V; shared K/V: the sum over branches in dk_cmp/dv_cmp
    dg: Any  # [T, Hq, 3]
    dphi_k: Optional[Phi]
    dphi_v: Optional[Phi]


def backward(fw, cfg: Config, q, kv6, g, phi_k: Optional[Phi], phi_v: Optional[Phi], lse, indices, d_o,
             cu_seqlens=None, max_seqlen=None, backend="auto", num_threads=0, o_branch=None,
             o=None, cu_seqlens_q=None, max_seqlen_q=None, o_cmp=None, o_win=None) -> Gradients:
    """o_branch: the forward's per-branch outputs [3, T, Hq, Dv] if they were kept (optional; the
    CUDA backend then takes dg from them instead of recomputing each branch's output). o: the
    forward's output [T, Hq, Dv] (optional; without o_branch the CUDA backend then takes the
    selection branch's part from it instead of recomputing that branch's output). o_cmp: the
    forward's compressed branch output [T, Hq, Dv] (optional, not with o_branch; the CUDA backend
    then takes that branch's dg from it); o_win the same for the window branch. cu_seqlens_q: the query packing, as for forward (dk, dv
    have the keys' rows, the others the queries')."""
    q, g, lse, indices, d_o = (fw.prepare(x) for x in (q, g, lse, indices, d_o))
    o_branch = None if o_branch is None else fw.prepare(o_branch)
    o = None if o is None else fw.prepare(o)
    o_cmp = None if o_cmp is None else fw.prepare(o_cmp)
    o_win = None if o_win is None else fw.prepare(o_win)
    kv6, shared, (T, Tk, Hq, Hkv, Dqk, Dv) = _layer_kv(fw, q, kv6)
    cu_q, ms_q = _query_packing(fw, cu_seqlens_q, max_seqlen_q)
    Tk = Tk if cu_q is not None else T
    call = Call(fw, q, backend, num_threads, cu_seqlens, max_seqlen)
    kind = phi_pair_kind(phi_k, phi_v)
    c = cfg.native(kind, shared)

    def like(x):
        return None if x is None else fw.empty(tuple(x.shape), q.dtype, q)

    dq = like(q)
    dkv = tuple(like(x) for x in kv6)
    dg = like(g)
    dphi_k = None if phi_k is None else Phi(*[like(p) for p in phi_k])
    dphi_v = None if phi_v is None else Phi(*[like(p) for p in phi_v])
    ws = call.workspace("backward", c, Tk, Hq, Hkv, Dqk, Dv, max(phi_hidden(phi_k), phi_hidden(phi_v)))
    with fw.device_guard(q):
        _nsa.backward(*call.ctx, c, q, kv6, g, _phi_tuple(fw, phi_k), _phi_tuple(fw, phi_v), call.cu,
                      call.max_seqlen, o, lse, indices, o_branch, d_o, dq, dkv, dg,
                      None if dphi_k is None else tuple(dphi_k), None if dphi_v is None else tuple(dphi_v), ws,
                      cu_q, ms_q, o_cmp, o_win)
    return Gradients(dq, dkv, dg, dphi_k, dphi_v)


def dense_attention(fw, scale: float, q, k, v, cu_seqlens=None, max_seqlen=None, backend="auto",
                    num_threads=0):
    """(o [T, Hq, Dv], lse [T, Hq] f32): dense causal attention with GQA, per sequence."""
    q, k, v = fw.prepare(q), fw.prepare(k), fw.prepare(v)
    T, Hq, Dqk = dims(q, "q", 3, "[T, Hq, Dqk]")
    Hkv = dims(k, "k", 3, "[T, Hkv, Dqk]")[1]
    Dv = dims(v, "v", 3, "[T, Hkv, Dv]")[2]
    call = Call(fw, q, backend, num_threads, cu_seqlens, max_seqlen)
    o = fw.empty((T, Hq, Dv), q.dtype, q)
    lse = fw.empty((T, Hq), fw.f32, q)
    ws = call.workspace("dense_attention_fwd", Config(scale=scale).native(), T, Hq, Hkv, Dqk, Dv)
    with fw.device_guard(q):
        _nsa.dense_attention_fwd(*call.ctx, float(scale), q, k, v, call.cu, call.max_seqlen, o, lse, ws)
    return o, lse


def dense_attention_backward(fw, scale: float, q, k, v, o, lse, d_o, cu_seqlens=None, max_seqlen=None,
                             backend="auto", num_threads=0):
    """(dq, dk, dv) of dense_attention, given its o and lse."""
    q, k, v, o, lse, d_o = (fw.prepare(x) for x in (q, k, v, o, lse, d_o))
    T, Hq, Dqk = dims(q, "q", 3, "[T, Hq, Dqk]")
    Hkv = dims(k, "k", 3, "[T, Hkv, Dqk]")[1]
    Dv = dims(v, "v", 3, "[T, Hkv, Dv]")[2]
    call = Call(fw, q, backend, num_threads, cu_seqlens, max_seqlen)
    dq = fw.empty(tuple(q.shape), q.dtype, q)
    dk = fw.empty(tuple(k.shape), q.dtype, q)
    dv = fw.empty(tuple(v.shape), q.dtype, q)
    ws = call.workspace("dense_attention_bwd", Config(scale=scale).native(), T, Hq, Hkv, Dqk, Dv)
    with fw.device_guard(q):
        _nsa.dense_attention_bwd(*call.ctx, float(scale), q, k, v, call.cu, call.max_seqlen, o, lse, d_o,
                                 dq, dk, dv, ws)
    return dq, dk, dv


def rotary(fw, x, inv_freq, positions=None, cu_seqlens=None, max_seqlen=None, inverse=False, backend="auto",
           num_threads=0, out=None):
    """x [T, H, D] rotated by its tokens' positions (include/nsa/api.h rotary: GPT-NeoX pairs (i,
    i + D/2), angles float(pos) * inv_freq [D/2] f32), into a new array, or into out (any strides,
    x itself or no memory shared with it; the library checks). positions: int32 [T]
    (fw.to_positions) or None: each token's place in its sequence of cu_seqlens. inverse rotates
    back (the transpose: the gradient)."""
    x, inv_freq, positions = fw.prepare(x), fw.prepare(inv_freq), fw.prepare(positions)
    dims(x, "x", 3, "[T, H, D]")
    call = Call(fw, x, backend, num_threads, cu_seqlens, max_seqlen, "x")
    if out is None:
        out = fw.empty(tuple(x.shape), x.dtype, x)
    with fw.device_guard(x):
        _nsa.rotary(*call.ctx, x, inv_freq, call.cu, call.max_seqlen, positions, out, bool(inverse))
    return out


def default_scale(dqk: int) -> float:
    return 1.0 / math.sqrt(dqk)


# ---- Decoding (nsa/cache.h) -------------------------------------------------------------------


class CacheArrays(NamedTuple):
    """A paged cache as arrays (nsa/cache.h): pools [P, page_size, Hkv, D] per branch (None where
    shared K/V has none), compressed pools [P, page_size / d, Hkv, D], the block table
    [B, max_pages] int32, seq_lens [B] int32 (the call's new rows included), status [B] int32
    (written on the device; may be None on the host) and a bound on seq_lens (0: the capacity)."""

    pools: tuple  # (k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, kc, vc)
    block_table: Any
    seq_lens: Any
    status: Any
    max_cache_len: int = 0


def _cache_bound(cache: CacheArrays) -> int:
    if cache.max_cache_len:
        return check_int(cache.max_cache_len, "pages.max_seqlen", 0)
    return int(cache.block_table.shape[1]) * int(cache.pools[0].shape[1])


def _rows_per_sequence(fw, cu, rows: int, batch: int, max_new) -> int:
    """The most new rows of one sequence: given, or read off host cu_seqlens, or rows / B."""
    if max_new:
        return check_int(max_new, "seqs.max_seqlen", 0)
    if cu is None:
        return rows // batch if batch else 0
    if fw.device(cu) != "cpu":
        raise error("max_new", 0, "must be given (>= the most new rows of one sequence) when cu_seqlens is on the GPU")
    c = [int(v) for v in cu.tolist()] if len(cu.shape) == 1 else []
    return max([b - a for a, b in zip(c, c[1:])] + [0])


def _prepare_cache(fw, cache: CacheArrays) -> CacheArrays:
    """The cache's arrays as the library takes them; the shapes this package reads first (the
    pools' and the block table's) are checked here with the library's names."""
    if not isinstance(cache.pools, (tuple, list)) or len(cache.pools) != 8:
        raise error("pools", _shown(cache.pools), "must be (k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, kc, vc)")
    pools = tuple(fw.prepare(p) if p is not None else None for p in cache.pools)
    dims(pools[0], "cache.k_cmp", 4, "[P, page_size, Hkv, Dqk]")
    dims(pools[1], "cache.v_cmp", 4, "[P, page_size, Hkv, Dv]")
    dims(cache.block_table, "pages.block_table", 2, "[B, max_pages]")
    return CacheArrays(pools, fw.prepare(cache.block_table), fw.prepare(cache.seq_lens),
                       cache.status, check_int(cache.max_cache_len or 0, "pages.max_seqlen", 0))


def cache_append(fw, cfg: Config, cache: CacheArrays, kv6, phi_k: Optional[Phi], phi_v: Optional[Phi],
                 cu_seqlens=None, max_new=None, backend="auto", num_threads=0) -> None:
    """Appends the new tokens kv6 (k_cmp, v_cmp, k_slc, v_slc, k_win, v_win; [Tn, Hkv, D], the
    last four None with shared K/V) to the cache's sequences; completed compressed blocks are
    computed by phi. cache.seq_lens must already count the new tokens."""
    kv6 = tuple(fw.prepare(x) for x in kv6)
    shared = kv6[2] is None and kv6[3] is None and kv6[4] is None and kv6[5] is None
    cache = _prepare_cache(fw, cache)
    rows, Hkv, Dqk = dims(kv6[0], "k_cmp", 3, "[Tn, Hkv, Dqk]")
    Dv = dims(kv6[1], "v_cmp", 3, "[Tn, Hkv, Dv]")[2]
    call = Call(fw, kv6[0], backend, num_threads, cu_seqlens, None, "k_cmp")
    kind = phi_pair_kind(phi_k, phi_v)
    c = cfg.native(kind, shared)
    B = int(cache.block_table.shape[0])
    m = _rows_per_sequence(fw, call.cu, rows, B, max_new)
    nbytes = _nsa.workspace_size("cache_append", backend, call.num_threads, c, rows, B, _cache_bound(cache), Hkv, Hkv,
                                 Dqk, Dv, max(phi_hidden(phi_k), phi_hidden(phi_v)), fw.dtype_name(kv6[0]),
                                 fw.device(kv6[0]), m)
    ws = workspace(fw, nbytes, kv6[0])
    with fw.device_guard(kv6[0]):
        _nsa.cache_append(*call.ctx, c, cache.pools, cache.block_table, cache.seq_lens, cache.status,
                          cache.max_cache_len, kv6, _phi_tuple(fw, phi_k), _phi_tuple(fw, phi_v), call.cu, m, ws)


def decode(fw, cfg: Config, cache: CacheArrays, q, g, cu_seqlens=None, max_new=None, shared_kv: bool = False,
           backend="auto", num_threads=0, branches=False) -> ForwardResult:
    """The prefill rows of the queries q [Tq, Hq, Dqk] at the end of their sequences (spec §10),
    gated by g [Tq, Hq, 3]: o [Tq, Hq, Dv], lse [Tq, Hq, 3], indices [Tq, Hkv, n] and, with
    ``branches``, o_branch [3, Tq, Hq, Dv]."""
    q, g = fw.prepare(q), fw.prepare(g)
    cache = _prepare_cache(fw, cache)
    rows, Hq, Dqk = dims(q, "q", 3, "[Tq, Hq, Dqk]")
    Hkv, Dv = int(cache.pools[0].shape[2]), int(cache.pools[1].shape[3])
    call = Call(fw, q, backend, num_threads, cu_seqlens, None)
    c = cfg.native("mean", shared_kv)
    B = int(cache.block_table.shape[0])
    m = _rows_per_sequence(fw, call.cu, rows, B, max_new)
    o = fw.empty((rows, Hq, Dv), q.dtype, q)
    lse = fw.empty((rows, Hq, 3), fw.f32, q)
    idx = indices_like(fw, rows, Hkv, c.n_selected, q)
    ob = fw.empty((3, rows, Hq, Dv), q.dtype, q) if branches else None
    nbytes = _nsa.workspace_size("decode", backend, call.num_threads, c, rows, B, _cache_bound(cache), Hq, Hkv, Dqk,
                                 Dv, 0, fw.dtype_name(q), fw.device(q), m)
    ws = workspace(fw, nbytes, q)
    with fw.device_guard(q):
        _nsa.decode(*call.ctx, c, cache.pools, cache.block_table, cache.seq_lens, cache.status, cache.max_cache_len,
                    q, g, call.cu, m, o, lse, idx, ob, ws)
    return ForwardResult(o, lse, idx, ob)


def dense_decode(fw, scale: float, k_pages, v_pages, block_table, seq_lens, status, q, cu_seqlens=None,
                 max_new=None, max_cache_len=0, backend="auto", num_threads=0):
    """(o [Tq, Hq, Dv], lse [Tq, Hq]): dense causal attention of the queries over every cached
    token of the pools k_pages, v_pages [P, page_size, Hkv, D]."""
    q, k_pages, v_pages = fw.prepare(q), fw.prepare(k_pages), fw.prepare(v_pages)
    block_table, seq_lens = fw.prepare(block_table), fw.prepare(seq_lens)
    rows, Hq, Dqk = dims(q, "q", 3, "[Tq, Hq, Dqk]")
    Hkv = dims(k_pages, "pages_k", 4, "[P, page_size, Hkv, Dqk]")[2]
    Dv = dims(v_pages, "pages_v", 4, "[P, page_size, Hkv, Dv]")[3]
    dims(block_table, "pages.block_table", 2, "[B, max_pages]")
    call = Call(fw, q, backend, num_threads, cu_seqlens, None)
    B = int(block_table.shape[0])
    m = _rows_per_sequence(fw, call.cu, rows, B, max_new)
    max_cache_len = check_int(max_cache_len or 0, "pages.max_seqlen", 0)
    bound = max_cache_len or int(block_table.shape[1]) * int(k_pages.shape[1])
    o = fw.empty((rows, Hq, Dv), q.dtype, q)
    lse = fw.empty((rows, Hq), fw.f32, q)
    nbytes = _nsa.workspace_size("dense_decode", backend, call.num_threads, Config(scale=scale).native(), rows, B,
                                 bound, Hq, Hkv, Dqk, Dv, 0, fw.dtype_name(q), fw.device(q), m)
    ws = workspace(fw, nbytes, q)
    with fw.device_guard(q):
        _nsa.dense_decode(*call.ctx, check_float(scale, "scale"), k_pages, v_pages, block_table, seq_lens, status,
                          max_cache_len, q, call.cu, m, o, lse, ws)
    return o, lse
