"""The reach backbone from Python (spec §11): the schedule, Config validation, the selection holding
every backbone block, and the layer taking its offsets from its index (decoding included)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import has_torch

import nsa


def test_schedule():
    assert nsa.backbone_schedule(0, 64000, 64) == [1]
    assert [nsa.backbone_schedule(i, 64000, 64)[0] for i in range(12)] == [2 ** (i % 10) for i in range(12)]
    assert nsa.backbone_schedule(3, 64000, 64, 3) == [64, 128, 192]
    assert nsa.backbone_schedule(0, 64, 64) == []
    with pytest.raises(nsa.Error, match="per_layer"):
        nsa.backbone_schedule(0, 100, 64, 9)


@pytest.mark.parametrize("offsets,parameter", [((0,), "backbone_offsets[0]"), ((2, 2), "backbone_offsets[1]"),
                                               ((1, 2, 3, 4), "n_init + n_local + num_backbone")])
def test_bad_offsets_are_named_errors(offsets, parameter):
    cfg = nsa.Config(n_selected=6, backbone_offsets=offsets)
    with pytest.raises(nsa.Error) as e:
        cfg.native().validate()
    assert e.value.parameter == parameter


def test_selection_holds_the_backbone_blocks():
    cfg = nsa.Config(cmp_block_len=8, cmp_stride=4, slc_block_len=16, n_selected=5, n_init=1, n_local=1, window=16,
                     backbone_offsets=(2, 5))
    rng = np.random.default_rng(0)
    T = 300
    q = rng.uniform(-1, 1, (T, 4, 8)).astype(np.float32)
    k = rng.uniform(-1, 1, (T, 2, 8)).astype(np.float32)
    v = rng.uniform(-1, 1, (T, 2, 8)).astype(np.float32)
    g = rng.uniform(0, 1, (T, 4, 3)).astype(np.float32)
    _, aux = nsa.attention(q, k, v, g, config=cfg, return_aux=True)
    _, ref = nsa.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), g.astype(np.float64),
                           config=cfg, return_aux=True)
    assert (aux.indices != ref.indices).any(axis=-1).mean() < 0.02
    for t in range(T):
        for o in (2, 5):
            if t // 16 - o >= 0:
                assert (ref.indices[t] == t // 16 - o).any(axis=-1).all(), (t, o)


if has_torch():
    import torch

    def test_layer_backbone_from_its_index_decodes_like_its_prefill():
        cfg = nsa.Config(cmp_block_len=8, cmp_stride=4, slc_block_len=16, n_selected=4, n_init=1, n_local=1, window=12)
        torch.manual_seed(0)
        m = nsa.NativeSparseAttention(32, 4, 2, config=cfg, phi_hidden=12, backbone=True, layer_idx=3, max_seqlen=200,
                                      dtype=torch.float64)
        assert m.config.backbone_offsets == (8,)  # 2^(3 mod ceil(log2(13)))
        assert "backbone=(8,)" in repr(m)
        x = torch.randn(1, 150, 32, dtype=torch.float64)
        full = m(x)
        cache = nsa.NSACache.allocate(m, 1, 160)
        with torch.no_grad():
            m(x[:, :100], cache=cache)
            for t in range(100, 150):
                torch.testing.assert_close(m(x[:, t:t + 1], cache=cache), full[:, t:t + 1], rtol=1e-12, atol=1e-12)
        with pytest.raises(nsa.Error, match="layer_idx"):
            nsa.NativeSparseAttention(32, 4, 2, config=cfg, backbone=True, max_seqlen=200)
