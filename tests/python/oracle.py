"""An independent NumPy implementation of spec §2-§7 (docs/semantics.md), for testing the binding.

Plain loops over sequences, tokens and heads, in the precision of its inputs (float64 for an
oracle, float32 for the "plain same-precision implementation" that tolerances are measured
against). It shares no code with the C++ library, so a test that agrees with it checks the
binding end to end: layouts, strides, packing, argument order.
"""
from __future__ import annotations

import math

import numpy as np


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def phi_apply(phi, block):
    """phi of one block [l, D] -> [D]; phi None = mean, else nsa.Phi-like (w1, b1, w2, b2, pe)."""
    if phi is None:
        return block.mean(axis=0)
    flat = (block + phi.pe).reshape(-1)
    if phi.w2 is None:
        return phi.w1 @ flat
    return phi.w2 @ gelu_tanh(phi.w1 @ flat + phi.b1) + phi.b2


def overlap(i, j, l, d, lp):
    a0, a1 = i, i + l // d - 1
    b0, b1 = j * (lp // d), (j + 1) * (lp // d) - 1
    return max(0, min(a1, b1) - max(a0, b0) + 1)


def softmax_attend(qv, keys, values, scale):
    """o, lse of q [D] over keys [m, D]; zeros and -inf when m = 0."""
    if keys.shape[0] == 0:
        return np.zeros(values.shape[1], dtype=qv.dtype), -np.inf
    s = scale * (keys @ qv)
    mx = s.max()
    p = np.exp(s - mx)
    z = p.sum()
    return (p / z) @ values, float(mx + np.log(z))


def compress(x, phi, cu, l, d):
    """xc [T // d, H, D] in the packed layout of blocks.h (unused rows zero)."""
    T, H, D = x.shape
    xc = np.zeros((T // d, H, D), dtype=x.dtype)
    for s, e in zip(cu[:-1], cu[1:]):
        n_c = (e - s - l) // d + 1 if e - s >= l else 0
        for i in range(n_c):
            for h in range(H):
                xc[s // d + i, h] = phi_apply(phi, x[s + i * d: s + i * d + l, h])
    return xc


def select(S_row, t, cfg):
    """Spec §4 for one (t, KV head): sorted indices padded with -1 to n."""
    n, lp = cfg.n_selected, cfg.slc_block_len
    J = t // lp
    count = min(n, J + 1)
    forced = [j for j in range(J + 1) if j < cfg.n_init or j > J - cfg.n_local]
    chosen = set(forced[:count])
    rest = sorted((j for j in range(J + 1) if j not in chosen), key=lambda j: (-S_row[j], j))
    chosen |= set(rest[: count - len(chosen)])
    out = sorted(chosen)
    return out + [-1] * (n - len(out))


def forward(cfg, q, kv6, g, phi_k, phi_v, cu=None):
    """(o [T, Hq, Dv], lse [T, Hq, 3], indices [T, Hkv, n], S [T, Hkv, Ns]) by the spec."""
    T, Hq, Dqk = q.shape
    k_cmp, v_cmp = kv6[0], kv6[1]
    shared = kv6[2] is None
    k_slc, v_slc = (k_cmp, v_cmp) if shared else (kv6[2], kv6[3])
    k_win, v_win = (k_cmp, v_cmp) if shared else (kv6[4], kv6[5])
    Hkv, Dv = k_cmp.shape[1], v_cmp.shape[2]
    G = Hq // Hkv
    l, d, lp, n, w = cfg.cmp_block_len, cfg.cmp_stride, cfg.slc_block_len, cfg.n_selected, cfg.window
    scale = cfg.scale if cfg.scale > 0 else 1.0 / math.sqrt(Dqk)
    cu = [0, T] if cu is None else [int(c) for c in cu]
    kc, vc = compress(k_cmp, phi_k, cu, l, d), compress(v_cmp, phi_v, cu, l, d)
    longest = max([e - s for s, e in zip(cu[:-1], cu[1:])], default=0)
    Ns = -(-longest // lp)
    o = np.zeros((T, Hq, Dv), dtype=q.dtype)
    lse = np.full((T, Hq, 3), -np.inf)
    idx = np.full((T, Hkv, n), -1, dtype=np.int32)
    S = np.zeros((T, Hkv, Ns))
    for s, e in zip(cu[:-1], cu[1:]):
        for t in range(e - s):
            row = s + t
            C = (t - l + 1) // d + 1 if t >= l - 1 else 0
            for hk in range(Hkv):
                heads = range(hk * G, (hk + 1) * G)
                p_cmp = {}
                for h in heads:
                    keys = kc[s // d: s // d + C, hk]
                    o_c, lse_c = softmax_attend(q[row, h], keys, vc[s // d: s // d + C, hk], scale)
                    p_cmp[h] = np.exp(scale * (keys @ q[row, h]) - lse_c) if C else np.zeros(0)
                    o[row, h] += g[row, h, 0] * o_c
                    lse[row, h, 0] = lse_c
                for j in range(t // lp + 1):
                    S[row, hk, j] = sum(overlap(i, j, l, d, lp) * p_cmp[h][i] for h in heads for i in range(C))
                if n > 0:
                    idx[row, hk] = select(S[row, hk], t, cfg)
                    positions = [p for j in idx[row, hk] if j >= 0 for p in range(j * lp, min((j + 1) * lp, t + 1))]
                else:
                    positions = []
                pos = s + np.array(positions, dtype=np.int64)
                for h in heads:
                    o_s, lse_s = softmax_attend(q[row, h], k_slc[pos, hk], v_slc[pos, hk], scale)
                    o[row, h] += g[row, h, 1] * o_s
                    lse[row, h, 1] = lse_s
                    start = max(0, t - w + 1) if w > 0 else t + 1
                    o_w, lse_w = softmax_attend(q[row, h], k_win[s + start: row + 1, hk],
                                                v_win[s + start: row + 1, hk], scale)
                    o[row, h] += g[row, h, 2] * o_w
                    lse[row, h, 2] = lse_w
    return o, lse, idx, S


def dense(q, k, v, scale, cu=None):
    T, Hq, _ = q.shape
    G = Hq // k.shape[1]
    cu = [0, T] if cu is None else [int(c) for c in cu]
    o = np.zeros((T, Hq, v.shape[2]), dtype=q.dtype)
    lse = np.zeros((T, Hq))
    for s, e in zip(cu[:-1], cu[1:]):
        for row in range(s, e):
            for h in range(Hq):
                o[row, h], lse[row, h] = softmax_attend(q[row, h], k[s: row + 1, h // G], v[s: row + 1, h // G], scale)
    return o, lse
