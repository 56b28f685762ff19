"""Shared helpers of the Python tests: random NSA problems in numpy."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

import nsa  # noqa: E402

# A small configuration whose blocks are all exercised by sequences of a few dozen tokens:
# l = 8, d = 4, l' = 16, n = 3 (1 initial + 1 local forced), w = 12.
SMALL = nsa.Config(cmp_block_len=8, cmp_stride=4, slc_block_len=16, n_selected=3, n_init=1, n_local=1, window=12)


@dataclass
class Problem:
    q: np.ndarray  # [T, Hq, Dqk]
    kv6: tuple  # (k_cmp, v_cmp, k_slc, v_slc, k_win, v_win); shared: the last four None
    g: np.ndarray  # [T, Hq, 3]
    phi_k: Optional[nsa.Phi]
    phi_v: Optional[nsa.Phi]
    cu: Optional[np.ndarray]  # [B+1] int32 or None

    @property
    def k(self):
        return self.kv6[0] if self.kv6[2] is None else (self.kv6[0], self.kv6[2], self.kv6[4])

    @property
    def v(self):
        return self.kv6[1] if self.kv6[2] is None else (self.kv6[1], self.kv6[3], self.kv6[5])

    def astype(self, dtype) -> "Problem":
        def cast(x):
            return None if x is None else x.astype(dtype)

        def cast_phi(p):
            return None if p is None else nsa.Phi(*[cast(x) for x in p])

        return Problem(cast(self.q), tuple(cast(x) for x in self.kv6), cast(self.g), cast_phi(self.phi_k),
                       cast_phi(self.phi_v), self.cu)


def make_phi(rng, kind: str, l: int, D: int, hidden: int):
    if kind == "mean":
        return None
    pe = rng.normal(0, 0.3, (l, D))
    if kind == "linear":
        return nsa.Phi(w1=rng.normal(0, 1 / np.sqrt(l * D), (D, l * D)), pe=pe)
    return nsa.Phi(w1=rng.normal(0, 1 / np.sqrt(l * D), (hidden, l * D)), b1=rng.normal(0, 0.1, hidden),
                   w2=rng.normal(0, 1 / np.sqrt(hidden), (D, hidden)), b2=rng.normal(0, 0.1, D), pe=pe)


def make_problem(seed: int, cfg: nsa.Config = SMALL, seqlens=(37,), hq=4, hkv=2, dqk=8, dv=6, phi="mlp",
                 shared=False, hidden=5) -> Problem:
    rng = np.random.default_rng(seed)
    T = int(sum(seqlens))
    q = rng.standard_normal((T, hq, dqk))
    n_sets = 1 if shared else 3
    kv = []
    for _ in range(n_sets):
        kv += [rng.standard_normal((T, hkv, dqk)), rng.standard_normal((T, hkv, dv))]
    kv6 = tuple(kv) + (None,) * (6 - len(kv))
    g = rng.uniform(0.1, 1.0, (T, hq, 3))
    cu = None if len(seqlens) == 1 else np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int32)
    return Problem(q, kv6, g, make_phi(rng, phi, cfg.cmp_block_len, dqk, hidden),
                   make_phi(rng, phi, cfg.cmp_block_len, dv, hidden), cu)


# The hidden size of make_layer's layers.
HIDDEN = 32


def make_layer(seed=0, **kw):
    """A small float64 nsa.NativeSparseAttention (4 query and 2 KV heads, SMALL, phi hidden 12) whose
    weights torch draws from `seed`; kw overrides those arguments or adds others."""
    import torch

    torch.manual_seed(seed)
    args = dict(hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, config=SMALL, phi_hidden=12, dtype=torch.float64)
    args.update(kw)
    return nsa.NativeSparseAttention(**args)


def has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


needs_torch = pytest.mark.skipif(not has_torch(), reason="PyTorch is not installed")
