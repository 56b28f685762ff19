"""tools/dkv_l2_model.py, the L2 model of dkv_ws_kernel<raw>'s gathered query rows: the orders it
replays do the kernel's work (every selected (token, block) pair and every window query once), and
its cache counts what an LRU cache of that size counts."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "dkv_l2_model.py"


def load():
    spec = importlib.util.spec_from_file_location("dkv_l2_model", TOOL)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


M = load()
T, LP, N, W, HKV, TQ = 700, 64, 4, 96, 2, 4


def expected_reads(lists):
    """(hk, token) reads of the kernel: per block, its window queries and the tokens that picked it."""
    c = Counter()
    for hk, sel in enumerate(lists):
        for b, toks in enumerate(sel):
            for t in toks:
                c[(hk, t)] += 1
            for t in range(b * LP, min(T - 1, b * LP + LP - 1 + W - 1) + 1):
                c[(hk, t)] += 1
    return c


def reads_of(order):
    return Counter(u for cta in order for tile in cta for u in tile)


def test_selections_are_the_forced_and_random_blocks_of_each_token():
    lists = M.selections(T, LP, N, HKV, seed=3)
    for sel in lists:
        for b, toks in enumerate(sel):
            assert toks == sorted(toks) and len(set(toks)) == len(toks)
            assert all(t // LP >= b for t in toks)  # causal: a block is picked only by its tokens or later ones
        for t in range(T):
            picked = [b for b, toks in enumerate(sel) if t in toks]
            J = t // LP
            assert len(picked) == min(N, J + 1)
            assert {0, J} <= set(picked) and (J == 0 or J - 1 in picked)


@pytest.mark.parametrize("ranges,cap", [(1, None), (3, 2), (4, 64)])
def test_every_order_reads_each_row_as_often_as_the_kernel(ranges, cap):
    lists = M.selections(T, LP, N, HKV, seed=1)
    if ranges == 1:
        order, _, _ = M.kernel_order(lists, T, LP, W, TQ, min_piece_tiles=2, target_ctas=64)
    else:
        order, _, _ = M.range_order(lists, T, LP, W, TQ, ranges, cap)
    assert reads_of(order) == expected_reads(lists)
    assert all(len(tile) <= TQ for cta in order for tile in cta)


def test_range_pieces_stay_inside_their_range_and_cap():
    lists = M.selections(T, LP, N, HKV, seed=2)
    order, _, partial = M.range_order(lists, T, LP, W, TQ, 3, 2)
    edges = [T * r // 3 for r in range(4)]
    for cta in order:
        assert len(cta) <= 2
        sel_tokens = [t for tile in cta for (_, t) in tile]
        # a piece's tokens lie in one range, save its block's window, which may run into the next
        r = max(i for i in range(3) if edges[i] <= min(sel_tokens))
        assert max(sel_tokens) < edges[r + 1] + LP + W
    assert partial == len(order) - HKV * len(lists[0])


def test_the_cache_counts_compulsory_misses_alone_when_everything_fits_and_lru_otherwise():
    order = [[[(0, 1), (0, 2)], [(0, 1)]], [[(0, 3)], [(0, 1)]]]
    hits, misses, steps = M.replay(order, row_bytes=1, l2_bytes=100, sms=2)
    assert (hits, misses, steps) == (2, 3, 2)
    # one resident CTA, a cache of one row: (0,1) (0,2) (0,1) (0,3) (0,1) all miss
    hits, misses, steps = M.replay(order, row_bytes=1, l2_bytes=1, sms=1)
    assert (hits, misses, steps) == (0, 5, 4)


def test_the_command_prints_the_model_and_names_a_bad_option():
    out = subprocess.run([sys.executable, str(TOOL), "--T", "1024", "--sms", "8"], capture_output=True, text=True,
                         check=True).stdout
    assert "T 1024, G 16, Hkv 4" in out and "GB of Q / dO rows" in out
    bad = subprocess.run([sys.executable, str(TOOL), "--G", "3"], capture_output=True, text=True)
    assert bad.returncode != 0 and "--G must divide 64" in bad.stderr and "got 3" in bad.stderr
