#!/usr/bin/env python3
"""L2 model of dkv_ws_kernel<raw>'s gathered query rows (window + selection dK / dV).

The kernel's CTA owns one raw key block of one KV head and walks query tiles of 64 / G tokens: the
block's window queries first, then the tokens that selected the block (the inverted index, in
token order). Each tile reads, per token, the Q and dO rows of the G query heads of that KV head
(G x (Dqk + Dv) x 2 bytes: 8 KB at G = 16, D = 128). This model replays that access stream under an
LRU cache of the given size, with SMS CTAs resident (one per SM, as the kernel's 210 KB of shared
memory allows) advancing one query tile per step, CTAs started in grid order: the pieces of long
lists first (rows of the grid's extra CTAs), then each KV head's own CTAs. Selections are random, as
in the benchmarks: every token picks its first block, its own and the one before (the forced
blocks), and uniformly random admissible blocks up to n.

It prints the model's DRAM bytes of those rows (misses x row bytes). The model leaves out the K / V
tiles, the row statistics and dK / dV's writes, and L2's sectors and partitions: the cache size is
the knob that stands for them (25-50 MB brackets the H100's DRAM bytes measured at 8K, see
docs/cuda_backward.md).

--ranges R > 1 models a schedule the kernel does not have: every list cut into R token ranges
(window with the range holding the block's first key), the pieces run range-major, lists longer
than --range-cap tiles cut further; it also prints the fp32 partial dK / dV bytes such pieces would
write and read back.

  tools/dkv_l2_model.py --T 8192                    (5.2 GB; measured on the H100: 4.96)
  tools/dkv_l2_model.py --T 8192 --ranges 4 --range-cap 64
"""
import argparse
import random
from collections import OrderedDict


def selections(T, lp, n, hkv, seed):
    """lists[hk][b]: the tokens that picked block b of KV head hk, ascending."""
    rng = random.Random(seed)
    nb = (T + lp - 1) // lp
    lists = []
    for _ in range(hkv):
        sel = [[] for _ in range(nb)]
        for t in range(T):
            J = t // lp
            pick = {0, J} | ({J - 1} if J >= 1 else set())
            want = min(n, J + 1)
            while len(pick) < want:
                pick.add(rng.randrange(J + 1))
            for j in pick:
                sel[j].append(t)
        lists.append(sel)
    return lists


def tiles_of(hk, tokens, tq):
    return [[(hk, t) for t in tokens[i:i + tq]] for i in range(0, len(tokens), tq)]


def window_tiles(hk, b, T, lp, w, tq):
    t0 = b * lp
    t1 = min(T - 1, t0 + lp - 1 + w - 1)
    return tiles_of(hk, list(range(t0, t1 + 1)), tq)


def cut(tiles, cap):
    if len(tiles) <= cap:
        return [tiles]
    k = (len(tiles) + cap - 1) // cap
    per = (len(tiles) + k - 1) // k
    return [tiles[i * per:(i + 1) * per] for i in range(k)]


def kernel_order(lists, T, lp, w, tq, min_piece_tiles=32, target_ctas=1024):
    """The CTAs as the kernel runs them (see DkvPlan::init and raw_pieces_plan_kernel)."""
    hkv, nb = len(lists), len(lists[0])
    total = sum((len(l) + tq - 1) // tq for sel in lists for l in sel)
    total += hkv * sum(len(window_tiles(0, b, T, lp, w, tq)) for b in range(nb))
    cap = max((total + target_ctas - 1) // target_ctas, min_piece_tiles)
    pieces, own = [], [[] for _ in range(hkv)]
    for j in range(nb):  # slot order (j, b, hk): block-major across heads
        for hk in range(hkv):
            parts = cut(tiles_of(hk, lists[hk][j], tq), cap)
            own[hk].append(window_tiles(hk, j, T, lp, w, tq) + parts[0])
            pieces += parts[1:]
    per_row = (len(pieces) + hkv - 1) // hkv  # grid row y: its share of the slots, then head y's CTAs
    order = []
    for hk in range(hkv):
        order += pieces[hk * per_row:(hk + 1) * per_row] + own[hk]
    return order, cap, 0


def range_order(lists, T, lp, w, tq, ranges, cap):
    hkv, nb = len(lists), len(lists[0])
    edges = [T * r // ranges for r in range(ranges + 1)]
    order, partial_pieces = [], 0
    for r in range(ranges):
        for hk in range(hkv):
            for b in range(nb):
                toks = [t for t in lists[hk][b] if edges[r] <= t < edges[r + 1]]
                tiles = tiles_of(hk, toks, tq)
                if edges[r] <= b * lp < edges[r + 1]:
                    tiles = window_tiles(hk, b, T, lp, w, tq) + tiles
                if tiles:
                    parts = cut(tiles, cap)
                    order += parts
                    partial_pieces += len(parts)
    # every piece but one per (hk, block) writes fp32 partials that are read back
    partial_pieces -= hkv * nb
    return order, cap, partial_pieces


def replay(order, row_bytes, l2_bytes, sms):
    cap_rows = int(l2_bytes // row_bytes)
    cache, hits, misses = OrderedDict(), 0, 0
    active, nxt, steps = [], 0, 0
    while nxt < len(order) or active:
        while len(active) < sms and nxt < len(order):
            if order[nxt]:
                active.append([order[nxt], 0])
            nxt += 1
        still = []
        for c in active:
            tiles, i = c
            for u in tiles[i]:
                if u in cache:
                    hits += 1
                    cache.move_to_end(u)
                else:
                    misses += 1
                    cache[u] = True
                    if len(cache) > cap_rows:
                        cache.popitem(last=False)
            c[1] += 1
            if c[1] < len(tiles):
                still.append(c)
        active = still
        steps += 1
    return hits, misses, steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--G", type=int, default=16)
    ap.add_argument("--hkv", type=int, default=4)
    ap.add_argument("--d", type=int, default=128, help="Dqk = Dv")
    ap.add_argument("--lp", type=int, default=64)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--w", type=int, default=512)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--l2-mb", type=float, default=25.0)
    ap.add_argument("--ranges", type=int, default=1)
    ap.add_argument("--range-cap", type=int, default=64, help="tiles per piece with --ranges")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    for name, v, lo in (("--T", a.T, 1), ("--G", a.G, 1), ("--hkv", a.hkv, 1), ("--sms", a.sms, 1),
                        ("--ranges", a.ranges, 1), ("--range-cap", a.range_cap, 1)):
        if v < lo:
            ap.error(f"{name} must be >= {lo}, got {v}")
    if 64 % a.G:
        ap.error(f"--G must divide 64 (a query tile is 64 rows), got {a.G}")
    tq = 64 // a.G
    row_bytes = a.G * 2 * a.d * 2  # Q and dO rows of the group's heads, 16-bit
    lists = selections(a.T, a.lp, a.n, a.hkv, a.seed)
    if a.ranges == 1:
        order, cap, partial_pieces = kernel_order(lists, a.T, a.lp, a.w, tq)
    else:
        order, cap, partial_pieces = range_order(lists, a.T, a.lp, a.w, tq, a.ranges, a.range_cap)
    hits, misses, steps = replay(order, row_bytes, a.l2_mb * 2**20, a.sms)
    acc = hits + misses
    part_gb = partial_pieces * 64 * 2 * a.d * 4 * 2 / 1e9  # dK and dV of 64 keys, fp32, written and read
    print(f"T {a.T}, G {a.G}, Hkv {a.hkv}, L2 {a.l2_mb:g} MB, ranges {a.ranges}, piece cap {cap} tiles: "
          f"{len(order)} CTAs, {steps} steps; {acc} row reads, hit rate {hits / acc:.3f}, "
          f"DRAM {misses * row_bytes / 1e9:.2f} GB of Q / dO rows"
          + (f", partial dK / dV {part_gb:.2f} GB" if a.ranges > 1 else ""))


if __name__ == "__main__":
    main()
