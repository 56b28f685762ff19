"""Decoding from Python (spec §10): the functional API on numpy and torch, the layer with a
growable and with a fixed paged cache ([B, S, hidden] steps), opcheck of the operators,
torch.compile of a decode step, and named errors for bad caches."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import HIDDEN, has_torch, make_layer

import nsa

CFG = nsa.Config(cmp_block_len=8, cmp_stride=4, slc_block_len=16, n_selected=3, n_init=1, n_local=1, window=12)


def make_cache(np_or_torch, B, capacity, hkv, dqk, dv, dtype, page=16, shared=False, seed=0):
    """Pools with shuffled pages (poisoned with NaN), an int32 block table, lengths and status."""
    rng = np.random.default_rng(seed)
    max_pages = -(-capacity // page)
    P = B * max_pages + 2
    ids = rng.permutation(P)[: B * max_pages].reshape(B, max_pages).astype(np.int32)

    def pool(rows, d):
        return np.full((P, rows, hkv, d), np.nan, dtype=dtype)

    pools = []
    for s in range(3):
        have = s == 0 or not shared
        pools += [pool(page, dqk) if have else None, pool(page, dv) if have else None]
    pools += [pool(page // CFG.cmp_stride, dqk), pool(page // CFG.cmp_stride, dv)]
    arrays = (pools, ids, np.zeros(B, np.int32), np.zeros(B, np.int32))
    if np_or_torch == "torch":
        import torch

        arrays = ([None if p is None else torch.from_numpy(p) for p in pools], torch.from_numpy(ids),
                  torch.zeros(B, dtype=torch.int32), torch.zeros(B, dtype=torch.int32))
    return nsa.CacheArrays(tuple(arrays[0]), arrays[1], arrays[2], arrays[3])


def random_problem(seqlens, hq=4, hkv=2, dqk=8, dv=6, dtype=np.float64, seed=1):
    rng = np.random.default_rng(seed)
    T = sum(seqlens)
    q = rng.uniform(-1, 1, (T, hq, dqk)).astype(dtype)
    k = [rng.uniform(-1, 1, (T, hkv, dqk)).astype(dtype) for _ in range(3)]
    v = [rng.uniform(-1, 1, (T, hkv, dv)).astype(dtype) for _ in range(3)]
    g = rng.uniform(0, 1, (T, hq, 3)).astype(dtype)
    l = CFG.cmp_block_len
    phi = [nsa.Phi(w1=rng.uniform(-0.2, 0.2, (5, l * d)).astype(dtype), b1=rng.uniform(-0.5, 0.5, 5).astype(dtype),
                   w2=rng.uniform(-0.5, 0.5, (d, 5)).astype(dtype), b2=rng.uniform(-0.5, 0.5, d).astype(dtype),
                   pe=rng.uniform(-0.5, 0.5, (l, d)).astype(dtype)) for d in (dqk, dv)]
    cu = np.array([0, *np.cumsum(seqlens)], dtype=np.int32)
    return q, k, v, g, phi, cu


@pytest.mark.parametrize("shared", [False, True])
def test_numpy_decode_equals_prefill_rows(shared):
    """fp64 on the reference: every step's rows equal the prefill's (1e-12), steps of 1 to 3
    tokens over two sequences of different lengths after a first chunk, one sequence idle."""
    seqlens = [45, 30]
    q, k, v, g, phi, cu = random_problem(seqlens)
    kk, vv = (k[0], v[0]) if shared else (tuple(k), tuple(v))
    o_full, aux = nsa.attention(q, kk, vv, g, phi[0], phi[1], cu_seqlens=cu, config=CFG, return_aux=True)
    cache = make_cache("numpy", 2, 64, 2, 8, 6, np.float64, shared=shared)
    done = [0, 0]
    for step in ([20, 7], [1, 1], [3, 0], [0, 2], [1, 3], [20, 17]):
        step = [min(s, n - d) for s, n, d in zip(step, seqlens, done)]
        rows = np.concatenate([np.arange(cu[b] + done[b], cu[b] + done[b] + step[b]) for b in range(2)]).astype(int)
        cache.seq_lens[:] = [d + s for d, s in zip(done, step)]
        new_cu = np.array([0, step[0], step[0] + step[1]], dtype=np.int32)
        kn = k[0][rows] if shared else tuple(x[rows] for x in k)
        vn = v[0][rows] if shared else tuple(x[rows] for x in v)
        nsa.cache_append(cache, kn, vn, phi[0], phi[1], cu_seqlens=new_cu, config=CFG)
        o, a = nsa.decode(cache, q[rows], g[rows], cu_seqlens=new_cu, config=CFG, return_aux=True)
        np.testing.assert_allclose(o, o_full[rows], rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(a.indices, aux.indices[rows])
        done = [d + s for d, s in zip(done, step)]
    assert done == seqlens


def test_numpy_dense_decode_equals_dense_attention():
    seqlens = [33, 20]
    q, k, v, g, phi, cu = random_problem(seqlens)
    o_full = nsa.dense_attention(q, k[1], v[1], cu_seqlens=cu)
    cache = make_cache("numpy", 2, 40, 2, 8, 6, np.float64)
    cache.seq_lens[:] = seqlens
    nsa.cache_append(cache, tuple(k), tuple(v), phi[0], phi[1], cu_seqlens=cu, config=CFG)
    o, lse = nsa.dense_decode(cache.pools[2], cache.pools[3], cache.block_table, cache.seq_lens, q, cu_seqlens=cu)
    np.testing.assert_allclose(o, o_full, rtol=1e-12, atol=1e-12)


def test_bad_cache_is_a_named_error():
    q, k, v, g, phi, cu = random_problem([10])
    cache = make_cache("numpy", 1, 16, 2, 8, 6, np.float64)
    cache.seq_lens[:] = [10]
    cache.block_table[0, 0] = 999
    with pytest.raises(nsa.Error) as e:
        nsa.cache_append(cache, tuple(k), tuple(v), phi[0], phi[1], config=CFG)
    assert e.value.parameter == "pages.block_table[0][0]"
    cache.block_table[0, 0] = 0
    cache.seq_lens[:] = [9]  # 10 new tokens in a sequence of 9
    with pytest.raises(nsa.Error, match="pages.seq_lens"):
        nsa.cache_append(cache, tuple(k), tuple(v), phi[0], phi[1], config=CFG)


if has_torch():
    import torch

    def test_a_cache_serves_one_layer():
        # Two layers of the same shapes must not share a cache (each holds its own layer's keys):
        # the second layer's call is a named error; reset() frees the cache for another layer.
        a, b = make_layer(0), make_layer(1)
        x = torch.randn(2, 10, HIDDEN, dtype=torch.float64)
        for cache in (nsa.NSACache(), nsa.NSACache.allocate(a, 2, 32)):
            with torch.no_grad():
                a(x, cache=cache)
                with pytest.raises(nsa.Error, match="cache"):
                    b(x[:, :1], cache=cache)
                a(x[:, :1], cache=cache)  # its own layer still decodes with it
                cache.reset()
                b(x, cache=cache)

    @pytest.mark.parametrize("shared_kv", [False, True])
    def test_layer_fixed_cache_batched_steps_equal_prefill(shared_kv):
        """NSACache.allocate with [B, S, hidden] inputs: a prompt, then steps of 1, 2 and 4 tokens
        per sequence (speculative verification: each query its own selection)."""
        m = make_layer(shared_kv=shared_kv)
        x = torch.randn(2, 60, HIDDEN, dtype=torch.float64)
        full = m(x)
        cache = nsa.NSACache.allocate(m, batch_size=2, max_seqlen=64)
        with torch.no_grad():
            pos = 20
            out = m(x[:, :pos], cache=cache)
            torch.testing.assert_close(out, full[:, :pos], rtol=1e-12, atol=1e-12)
            for s in (1, 2, 4, 1, 4, 2, 1, 4, 2, 1, 4, 4, 4, 4, 2):
                out = m(x[:, pos:pos + s], cache=cache)
                torch.testing.assert_close(out, full[:, pos:pos + s], rtol=1e-12, atol=1e-12)
                pos += s
        assert cache.seq_lens.tolist() == [pos, pos]
        cache.check()

    def test_layer_growable_cache_outgrows_its_pages():
        m = make_layer()
        x = torch.randn(150, HIDDEN, dtype=torch.float64)
        full = m(x)
        cache = nsa.NSACache()
        with torch.no_grad():
            m(x[:5], cache=cache)
            cap0 = cache.capacity
            for t in range(5, 150):
                y = m(x[t:t + 1], cache=cache)
                torch.testing.assert_close(y, full[t:t + 1], rtol=1e-12, atol=1e-12)
        assert cache.capacity > cap0 and cache.seq_len(0) == 150

    def test_opcheck_decode_operators():
        cache = make_cache("torch", 2, 32, 2, 8, 6, np.float64)
        q, k, v, g, phi, cu = random_problem([20, 9])
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
        cache.seq_lens[:] = torch.tensor([20, 9], dtype=torch.int32)
        pools = [p if p is not None else torch.empty(0, dtype=torch.float64) for p in cache.pools]
        phis = [t(x) for x in phi[0]] + [t(x) for x in phi[1]]
        args = (*pools, cache.block_table, cache.seq_lens, cache.status, 0, t(k[0]), t(v[0]), t(k[1]), t(v[1]),
                t(k[2]), t(v[2]), *phis, t(cu), 0, CFG.ints(), "auto", 0)
        torch.library.opcheck(torch.ops.nsa.cache_append.default, args)
        torch.ops.nsa.cache_append(*args)
        dargs = (t(q), t(g), *pools, cache.block_table, cache.seq_lens, cache.status, 0, t(cu), 0, CFG.ints(), 0.0,
                 False, "auto", 0, False)
        torch.library.opcheck(torch.ops.nsa.decode.default, dargs)
        torch.library.opcheck(torch.ops.nsa.decode.default, dargs[:-1] + (True,))

    def test_torch_compile_of_a_decode_step():
        """A decode step of the layer with a fixed cache under torch.compile (CPU, float32)
        gives the eager step's outputs."""
        m = make_layer(dtype=torch.float32)
        x = torch.randn(2, 40, HIDDEN)
        caches = [nsa.NSACache.allocate(m, 2, 48) for _ in range(2)]

        def step(inp, cache):
            return m(inp, cache=cache)

        compiled = torch.compile(step, backend="aot_eager")
        with torch.no_grad():
            a = step(x[:, :30], caches[0])
            b = compiled(x[:, :30], caches[1])
            torch.testing.assert_close(a, b, rtol=0, atol=0)
            for t in range(30, 36):
                torch.testing.assert_close(compiled(x[:, t:t + 1], caches[1]), step(x[:, t:t + 1], caches[0]),
                                           rtol=0, atol=0)
