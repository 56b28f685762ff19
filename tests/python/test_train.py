"""The training harness (train/) on the CPU: a tiny configuration of each arm trains, checkpoints,
resumes exactly where a single run would be, evaluates and plots; a model fits a fixed batch; the
attention reaches back (and not forward) in every arm.

The tiny preset: 2 layers, hidden 64, 4/2 heads, 256 tokens, NSA blocks l 16, d 8, l' 32, n 4,
w 64 (8 selection blocks per sequence, 4 attended: the NSA arms are sparse).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from train import data  # noqa: E402
from train import evaluate as evaluate_cli  # noqa: E402
from train import train as train_cli  # noqa: E402
from train.model import ARMS, ModelConfig, apply_rope, build_model, rope_inv_freq  # noqa: E402

BATCH, SEQ = 2, 256
# The tiny model's head dim (16) is one the cuda backend does not compile: these runs are CPU runs
# wherever they are.
TINY = ["--preset", "tiny", "--threads", "1", "--progress", "none", "--batch", str(BATCH), "--device", "cpu"]
TINY_MODEL = dict(vocab_size=data.VOCAB_SIZE, n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, cmp_block_len=16,
                  cmp_stride=8, slc_block_len=32, n_selected=4, n_init=1, n_local=1, window=64,
                  backbone_max_seqlen=4 * SEQ)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # The harness sets torch's thread count (--threads 1: the machine's cores are shared); put it back.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_model(arm: str, seed: int = 0):
    model = build_model(ModelConfig(attention=arm, **TINY_MODEL), seed=seed)
    for layer in model.attention_layers():
        if hasattr(layer, "num_threads"):
            layer.num_threads = 1
    return model


def read_log(run_dir: Path) -> list:
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every arm: a 4-step run made of a 3-step chunk and a resumed 1-step chunk."""
    root = tmp_path_factory.mktemp("quality")
    for arm in ARMS:
        out = str(root / arm)
        first = train_cli.main(["--arm", arm, "--out-dir", out, "--steps", "4", "--chunk-steps", "3", *TINY])
        assert first["step"] == 3 and not first["done"] and first["stop"] == "chunk-steps"
        second = train_cli.main(["--arm", arm, "--out-dir", out, "--resume", *TINY])
        assert second["step"] == 4 and second["done"]
    return root


# ---- data -------------------------------------------------------------------------------------


def test_split_is_by_file_and_fixed():
    files = data.stdlib_files()
    assert len(files) > 100
    held = [rel for rel, _ in files if data.is_heldout(rel, 5)]
    assert 0 < len(held) < len(files) // 5
    assert data.is_heldout(held[0], 5) and not data.is_heldout(held[0], 0)
    train, heldout, info = data.load_corpora(5)
    assert info["train_files"] + info["heldout_files"] == len(files)
    assert len(train) > len(heldout) > 0 and train.tokens.max() <= data.BOS


@pytest.mark.parametrize("task", data.TASKS)
def test_retrieval_sample_layout(task):
    train, _, _ = data.load_corpora(5)
    rng = np.random.default_rng(3)
    for depth in (0.0, 0.37, 1.0):
        s = data.retrieval_sample(rng, train, SEQ, task, depth)
        assert s.tokens.shape == (SEQ + 1,) and s.tokens[0] == data.BOS
        assert s.answer[1] == SEQ + 1 and (s.tokens == data.QUERY).sum() == 1  # QUERY key value ends it
        value = s.tokens[s.needle[0]:s.needle[1]]
        np.testing.assert_array_equal(s.tokens[s.answer[0]:s.answer[1]], value)
        assert s.tokens[s.needle[1]] == data.NEEDLE and chr(s.tokens[s.needle[0] - 1]) in "= "
        assert all(chr(c).isdigit() for c in value)
        np.testing.assert_array_equal(s.answer_rows() + 1, np.arange(s.answer[0], s.answer[1]))
        if task == "passkey" and depth == 0.0:
            assert s.tokens[1] == data.NEEDLE  # right after BOS
        if task == "passkey" and depth == 1.0:
            assert s.tokens[s.needle[1] + 1] == data.QUERY  # right before the question


def test_multikey_samples_with_several_queries():
    train, _, _ = data.load_corpora(5)
    rng = np.random.default_rng(4)
    for max_distance in (None, 40):
        s = data.retrieval_sample(rng, train, SEQ, "multikey", n_keys=4, queries=3, max_distance=max_distance)
        assert s.tokens.shape == (SEQ + 1,) and (s.tokens == data.QUERY).sum() == 3
        spans = [s.answer, *s.more_answers]
        assert len(spans) == 3 and spans[-1][1] == SEQ + 1
        needles = {}  # key -> (value, position of the needle's closing NEEDLE) of every planted needle
        marks = np.nonzero(s.tokens == data.NEEDLE)[0]
        for a, b in zip(marks[0::2], marks[1::2]):
            text = data.decode(s.tokens[a + 1:b])
            needles[text[:-5]] = (text[-5:], int(b))
        first_question = int(np.nonzero(s.tokens == data.QUERY)[0][0])
        asked = set()
        for a, b in spans:
            q = int(np.nonzero(s.tokens[:a] == data.QUERY)[0][-1])  # the question this answer follows
            key = data.decode(s.tokens[q + 1:a])
            value, end = needles[key]
            assert data.decode(s.tokens[a:b]) == value
            asked.add(key)
            if max_distance is not None:  # within the bound (plus the other needles' 12 tokens each)
                assert first_question - end - 1 <= max_distance + 3 * 12
        assert len(asked) == 3  # distinct needles
        np.testing.assert_array_equal(s.answer_rows() + 1, np.concatenate([np.arange(a, b) for a, b in spans]))
        # the first question is the one the sample's needle and answer describe
        np.testing.assert_array_equal(s.tokens[s.answer[0]:s.answer[1]], s.tokens[s.needle[0]:s.needle[1]])
    stream = data.DataStream(train, SEQ, seed=2, retrieval_frac=1.0, multikey_frac=1.0, queries=4, answer_weight=3.0)
    _, w = stream.next_batch(2)
    assert (w == 3.0).sum() == 2 * 4 * 5  # every query's 5 digits weighted
    one = data.DataStream(train, SEQ, seed=2, retrieval_frac=1.0, multikey_frac=0.0, queries=4, answer_weight=3.0)
    assert (one.next_batch(2)[1] == 3.0).sum() == 2 * 5  # passkey samples keep one question
    with pytest.raises(ValueError, match="queries"):
        data.DataStream(train, SEQ, seed=2, n_keys=4, queries=5)
    with pytest.raises(ValueError, match="queries"):
        data.retrieval_sample(rng, train, SEQ, "multikey", n_keys=2, queries=0)


def test_stream_state_replays_batches():
    train, _, _ = data.load_corpora(5)
    a = data.DataStream(train, SEQ, seed=7, answer_weight=2.0)
    a.next_batch(3)
    state = a.state()
    first, w1 = a.next_batch(3)
    b = data.DataStream(train, SEQ, seed=99, answer_weight=2.0)
    b.set_state(state)
    second, w2 = b.next_batch(3)
    np.testing.assert_array_equal(first, second)
    np.testing.assert_array_equal(w1, w2)


def test_distance_curriculum_brings_the_needle_close_then_lets_it_go():
    train, _, _ = data.load_corpora(5)
    plain = data.DataStream(train, SEQ, seed=5, retrieval_frac=1.0)
    off = data.DataStream(train, SEQ, seed=5, retrieval_frac=1.0, distance_start=0)
    np.testing.assert_array_equal(plain.next_batch(4)[0], off.next_batch(4)[0])  # off: the stream as it was
    cur = data.DataStream(train, SEQ, seed=5, retrieval_frac=1.0, multikey_frac=0.0, distance_start=16,
                          distance_steps=10)
    assert cur.max_distance() == 16
    cur.set_step(5)
    assert cur.max_distance() == 64  # 16 * (256 / 16) ** 0.5
    cur.set_step(10)
    assert cur.max_distance() is None
    held = data.DataStream(train, SEQ, seed=5, distance_start=16, distance_steps=10, distance_hold=4)
    for step, bound in ((0, 16), (3, 16), (4, 16), (9, 64), (13, 16 * 16 ** 0.9), (14, None)):
        held.set_step(step)
        assert held.max_distance() == (None if bound is None else round(bound)), step
    rng = np.random.default_rng(1)
    for bound in (16, 64):
        far = []
        for _ in range(40):
            s = data.retrieval_sample(rng, train, SEQ, "passkey", max_distance=bound)
            # haystack tokens between the needle's end and the question
            far.append(int(np.nonzero(s.tokens == data.QUERY)[0][0]) - s.needle[1] - 1)
        assert max(far) <= bound and min(far) >= 0
    free = [data.retrieval_sample(rng, train, SEQ, "passkey").depth for _ in range(40)]
    assert min(free) < 0.5  # without the bound the needle goes anywhere
    with pytest.raises(ValueError, match="distance_start"):
        data.DataStream(train, SEQ, seed=5, distance_start=SEQ + 1, distance_steps=3)
    with pytest.raises(ValueError, match="distance_steps"):
        data.DataStream(train, SEQ, seed=5, distance_start=8, distance_steps=0)


def test_packed_rows_hold_several_samples_while_the_distance_is_short():
    train, _, _ = data.load_corpora(5)
    seq, bound = 2048, 40
    stream = data.DataStream(train, seq, seed=3, retrieval_frac=1.0, multikey_frac=0.0, answer_weight=5.0,
                             distance_start=bound, distance_steps=100, pack_len=300)
    key = data.encode(data._PASSKEY_KEY)
    tokens, weights = stream.next_batch(2)
    assert tokens.shape == (2, seq + 1)
    for row, rows, w in zip(tokens, stream.last_answers, weights):
        # max(300, 2 * 40) = 300 tokens + 1 per sample: 6 of 301 and the last one 542 long. (A
        # sample's text may cross a file boundary of the corpus, whose BOS then lies inside it.)
        starts = [0, 301, 602, 903, 1204, 1505]
        assert set(starts) <= set(np.nonzero(row == data.BOS)[0].tolist()), np.nonzero(row == data.BOS)[0]
        queries = np.nonzero(row == data.QUERY)[0]
        assert len(queries) == len(starts)
        assert len(rows) == len(starts) * data._DIGITS and np.all(w[rows] == 5.0)
        assert np.count_nonzero(w != 1.0) == len(rows)
        for q, start in zip(queries, starts):
            a = q + 1 + len(key)  # the answer: the digits after the question's key
            value = row[a:a + data._DIGITS]
            assert a - 1 in rows  # the row whose next token is the answer's first digit
            needle = [i for i in range(start, q) if row[i] == data.NEEDLE and
                      np.array_equal(row[i + 1:i + 1 + len(key)], key)]
            assert len(needle) == 1, "one passkey needle in each sample"
            n0 = needle[0]
            np.testing.assert_array_equal(row[n0 + 1 + len(key):n0 + 1 + len(key) + data._DIGITS], value)
            end = n0 + 1 + len(key) + data._DIGITS  # the closing NEEDLE
            assert 0 <= q - end - 1 <= bound
    # Grown past a quarter of the row: one sample per row again.
    stream.set_step(80)
    assert stream.max_distance() > seq // 4
    tokens, _ = stream.next_batch(2)
    assert all(np.count_nonzero(row == data.BOS) == 1 for row in tokens)
    # Off (the default) or without the curriculum: as before.
    with pytest.raises(ValueError, match="pack_len"):
        data.DataStream(train, seq, seed=3, pack_len=300)
    with pytest.raises(ValueError, match="pack_len"):
        data.DataStream(train, seq, seed=3, distance_start=8, distance_steps=4, pack_len=seq + 1)
    with pytest.raises(ValueError, match="too short"):
        data.DataStream(train, seq, seed=3, retrieval_frac=1.0, multikey_frac=1.0, n_keys=8, queries=8,
                        distance_start=8, distance_steps=4, pack_len=64).next_batch(1)


def test_distance_curriculum_flags_are_checked():
    with pytest.raises(SystemExit):
        train_cli.parse_args(["--arm", "dense", *TINY, "--needle-distance-start", "100000"])
    with pytest.raises(SystemExit):
        train_cli.parse_args(["--arm", "dense", *TINY, "--needle-distance-start", "8", "--needle-distance-steps", "0"])
    args = train_cli.parse_args(["--arm", "dense", *TINY, "--needle-distance-start", "8", "--steps", "40"])
    assert args.needle_distance_steps == 20
    with pytest.raises(SystemExit):
        train_cli.parse_args(["--arm", "dense", *TINY, "--queries", "5"])  # more than --n-keys (4)
    with pytest.raises(SystemExit):
        train_cli.parse_args(["--arm", "dense", *TINY, "--retrieval-pack", "64"])  # no curriculum
    with pytest.raises(SystemExit):
        train_cli.parse_args(["--arm", "dense", *TINY, "--needle-distance-hold", "10"])  # no curriculum
    with pytest.raises(SystemExit):
        train_cli.parse_args(["--arm", "dense", *TINY, "--needle-distance-start", "8", "--retrieval-pack", "257"])
    assert train_cli.parse_args(["--arm", "dense", *TINY, "--queries", "4"]).queries == 4


# ---- model ------------------------------------------------------------------------------------


def test_dense_twin_rotates_like_the_layer():
    import nsa

    layer = nsa.NativeSparseAttention(64, 4, 2, config=nsa.Config(cmp_block_len=16, cmp_stride=8,
                                                                   slc_block_len=32, n_selected=4, window=64))
    if not hasattr(layer, "_rotate"):
        pytest.skip("the layer has no _rotate to compare with")
    x = torch.randn(50, 2, 16)
    pos = torch.arange(50) * 37  # long positions too
    torch.testing.assert_close(apply_rope(x, pos, rope_inv_freq(16, 10000.0)), layer._rotate(x, pos), rtol=0, atol=0)
    xb = torch.randn(3, 50, 2, 16)  # a batch: every sequence rotated by the same positions
    torch.testing.assert_close(apply_rope(xb, pos, rope_inv_freq(16, 10000.0))[2], layer._rotate(xb[2], pos),
                               rtol=0, atol=0)


def test_twins_share_their_common_initialisation():
    dense, sparse = tiny_model("dense"), tiny_model("nsa")
    dp, sp = dict(dense.named_parameters()), dict(sparse.named_parameters())
    common = [n for n in dp if n in sp and dp[n].shape == sp[n].shape]
    for name in ("embed.weight", "blocks.1.attn.q_proj.weight", "blocks.0.mlp.up_proj.weight", "lm_head.weight"):
        assert name in common
    for name in common:
        torch.testing.assert_close(dp[name], sp[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("arm", ARMS)
def test_attention_reaches_back_not_forward(arm):
    """Changing token 100 changes no prediction before it, and changes the one at 110 and the one
    at 250: 150 tokens back, past the 64-token window and outside the forced initial and local
    blocks of position 250 (seen: changes of ~1e-3 of the logits' scale for NSA, ~5e-3 for dense;
    an attention that ignores its input leaves only the MLPs, which change nothing there)."""
    model = tiny_model(arm, seed=1).eval()
    rng = np.random.default_rng(0)
    tokens = torch.from_numpy(rng.integers(0, 256, (1, SEQ)))
    changed = tokens.clone()
    changed[0, 100] = (changed[0, 100] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens)[0], model(changed)[0]
    diff = (a - b).abs().amax(dim=-1)
    assert diff[:100].max().item() == 0.0, "a later token changed an earlier prediction"
    scale = a.abs().amax().item()
    assert diff[110].item() > 1e-4 * scale, f"position 110 does not see position 100 ({diff[110].item():.3g})"
    assert diff[250].item() > 1e-4 * scale, f"position 250 does not see position 100 ({diff[250].item():.3g})"


@pytest.mark.parametrize("arm", ["dense", "nsa"])
def test_fits_a_fixed_batch(tmp_path, arm):
    """train.py --overfit: 20 steps on one batch of text take the loss from ln(264) ~ 5.6 below
    3.2 nats (the tiny model reaches ~2.7-2.8 here), and it keeps falling."""
    out = tmp_path / arm
    train_cli.main(["--arm", arm, "--out-dir", str(out), "--steps", "20", "--lr", "1e-2", "--retrieval-frac", "0",
                    "--overfit", *TINY])
    losses = [r["loss"] for r in read_log(out)]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses), losses
    assert losses[0] > 5.0, losses
    assert losses[-1] < 3.2, losses
    assert max(losses[-5:]) < losses[5], losses


# ---- training runs, resume, evaluation, plots -------------------------------------------------


@pytest.mark.parametrize("arm", ARMS)
def test_chunks_continue_one_run(runs, arm):
    out = runs / arm
    log = read_log(out)
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    assert [r["tokens"] for r in log] == [BATCH * SEQ * s for s in (1, 2, 3, 4)]
    assert all(math.isfinite(r["loss"]) and r["step_s"] > 0 and r["peak_mem_mib"] > 0 for r in log)
    assert all(b["wall_s"] > a["wall_s"] for a, b in zip(log, log[1:]))
    meta = json.loads((out / "meta.json").read_text())
    assert [c["start_step"] for c in meta["chunks"]] == [0, 3]
    assert [c["end_step"] for c in meta["chunks"]] == [3, 4]
    # A complete run: --resume returns at once and logs nothing more.
    again = train_cli.main(["--arm", arm, "--out-dir", str(out), "--resume", *TINY])
    assert again["done"] and len(read_log(out)) == 4


@pytest.mark.parametrize("arm", ["dense", "nsa"])
def test_resumed_run_equals_a_single_run(runs, tmp_path, arm):
    single = tmp_path / arm
    train_cli.main(["--arm", arm, "--out-dir", str(single), "--steps", "4", *TINY])
    chunked = [r["loss"] for r in read_log(runs / arm)]
    straight = [r["loss"] for r in read_log(single)]
    assert chunked == pytest.approx(straight, rel=1e-6, abs=1e-6)
    assert straight[-1] != straight[0]


def test_curriculum_run_resumes_as_one_run(tmp_path):
    # The curriculum depends on the step: a run cut in two chunks trains on the same batches.
    flags = ["--arm", "dense", "--steps", "3", "--retrieval-frac", "1.0", "--needle-distance-start", "8", *TINY]
    train_cli.main(["--out-dir", str(tmp_path / "one"), *flags])
    train_cli.main(["--out-dir", str(tmp_path / "two"), "--chunk-steps", "2", *flags])
    train_cli.main(["--out-dir", str(tmp_path / "two"), "--resume", *flags])
    train_cli.main(["--out-dir", str(tmp_path / "plain"), *flags[:-len(TINY) - 2], *TINY])  # no curriculum
    one, two, plain = ([r["loss"] for r in read_log(tmp_path / d)] for d in ("one", "two", "plain"))
    assert len(one) == 3 and one == pytest.approx(two, rel=1e-6, abs=1e-6)
    assert one[0] != plain[0]  # step 0 drew needles near the question
    rows = read_log(tmp_path / "one")
    assert [r.get("max_distance") for r in rows] == [8, None, None]  # the bound while it grows (1 step here)
    for r in rows:  # every sample is retrieval: one 5-digit answer each
        assert r["answers"] == BATCH * data._DIGITS and 0 <= r["answer_acc"] <= 1 and r["answer_loss"] > 0
    meta = json.loads((tmp_path / "one" / "meta.json").read_text())
    assert meta["args"]["needle_distance_start"] == 8 and meta["args"]["needle_distance_steps"] == 1


def test_run_settings_are_fixed(runs):
    out = str(runs / "dense")
    with pytest.raises(SystemExit, match="exists"):
        train_cli.main(["--arm", "dense", "--out-dir", out, *TINY])
    with pytest.raises(SystemExit, match="--lr"):
        train_cli.main(["--arm", "dense", "--out-dir", out, "--resume", "--lr", "0.5", *TINY])
    with pytest.raises(SystemExit, match="--arm"):
        train_cli.main(["--arm", "nsa", "--out-dir", out, "--resume", *TINY])


def test_gate_hidden_reaches_the_layer(tmp_path):
    """--gate-hidden 16 trains NSA with an MLP gate 16 wide and the run's checkpoint rebuilds it;
    without the flag the layers keep the layer's default linear gate."""
    out = tmp_path / "mlp_gate"
    train_cli.main(["--arm", "nsa", "--out-dir", str(out), "--steps", "1", "--gate-hidden", "16", *TINY])
    cfg = ModelConfig(**torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)["model_config"])
    assert cfg.gate_hidden == 16
    for layer in build_model(cfg).attention_layers():
        assert [type(m) for m in layer.gate] == [torch.nn.Linear, torch.nn.SiLU, torch.nn.Linear]
        assert layer.gate[0].out_features == 16
    for layer in tiny_model("nsa").attention_layers():
        assert [type(m) for m in layer.gate] == [torch.nn.Linear]
    # A config saved with gate_hidden None (the layer's default when that was an MLP gate hidden // 4
    # wide) rebuilds that gate, so its checkpoint's weights load.
    old = ModelConfig(**{**cfg.to_dict(), "gate_hidden": None})
    assert old.gate_hidden == cfg.hidden // 4
    for layer in build_model(old).attention_layers():
        assert layer.gate[0].out_features == cfg.hidden // 4 and len(layer.gate) == 3


@pytest.fixture(scope="module")
def evaluated(runs):
    dirs = [str(runs / arm) for arm in ARMS]
    evaluate_cli.main([*dirs, "--lengths", f"{SEQ},{2 * SEQ}", "--depths", "3", "--samples", "2",
                       "--heldout-windows", "2", "--threads", "1", "--device", "cpu"])
    return runs


def test_retrieval_counts_whole_answers_and_answer_tokens():
    # A stand-in model whose prediction at every position is that position's own token: an answer
    # digit counts where it repeats the token before it, and a whole answer where all of them do.
    class Echo(torch.nn.Module):
        def hidden_states(self, tokens):
            return torch.nn.functional.one_hot(tokens, data.VOCAB_SIZE).float()

        def lm_head(self, h):
            return h

    from train.evaluate import retrieval
    train, _, _ = data.load_corpora(5)
    depths = [0.0, 0.5, 1.0]
    out, _ = retrieval(Echo(), ModelConfig(attention="dense", **TINY_MODEL), train, [SEQ], depths, ["passkey"],
                       samples=40, n_keys=4, tokens_per_batch=4 * SEQ, device=torch.device("cpu"), seed=3)
    for di, depth in enumerate(depths):
        cell = data.retrieval_eval_set(train, SEQ, depth, di, "passkey", 40, 3, 4)
        same = [s.tokens[s.answer_rows()] == s.tokens[s.answer_rows() + 1] for s in cell]
        assert out["passkey"]["token_accuracy"][0][di] == pytest.approx(np.mean(np.concatenate(same)), abs=1e-4)
        assert out["passkey"]["accuracy"][0][di] == pytest.approx(np.mean([x.all() for x in same]), abs=1e-4)
        assert out["passkey"]["token_accuracy"][0][di] > 0  # 5 random digits repeat their predecessor often


@pytest.mark.parametrize("arm", ARMS)
def test_evaluate_writes_every_table(evaluated, arm):
    result = json.loads((evaluated / arm / "eval.json").read_text())
    assert result["arm"] == arm and result["step"] == 4
    assert math.isfinite(result["heldout"]["loss"]) and result["heldout"]["tokens"] == 2 * SEQ
    ret = result["retrieval"]
    assert ret["lengths"] == [SEQ, 2 * SEQ] and ret["depths"] == [0.0, 0.5, 1.0]
    for task in data.TASKS:
        acc, tok = ret["tasks"][task]["accuracy"], ret["tasks"][task]["token_accuracy"]
        assert len(acc) == 2 and all(len(row) == 3 and all(0.0 <= x <= 1.0 for x in row) for row in acc)
        assert all(t >= a for ra, rt in zip(acc, tok) for a, t in zip(ra, rt))  # a whole answer: all its tokens
    assert result["train"]["steps"] == 4 and result["train"]["peak_mem_mib"] > 0
    if arm == "dense":
        assert "selection" not in result
        return
    for task in data.TASKS:
        sel = result["selection"][task]
        for key in ("needle_selected", "needle_forced"):
            assert len(sel[key]) == 2  # layers
            assert all(0.0 <= x <= 1.0 for layer in sel[key] for row in layer for x in row)
        # Depth 0 puts the needle in block 0, which n_init = 1 forces: always selected.
        assert all(layer[li][0] == 1.0 for layer in sel["needle_selected"] for li in range(2))
        assert all(layer[li][0] == 1.0 for layer in sel["needle_forced"] for li in range(2))
        for branch in evaluate_cli.BRANCHES:
            gates = [x for layer in sel["gate_answer"][branch] for row in layer for x in row]
            assert all(0.0 < x < 1.0 for x in gates)
        if arm == "nsa_backbone":
            assert sel["backbone_offsets"] == [[1], [2]]


def test_plot_writes_the_figures(evaluated, tmp_path):
    pytest.importorskip("matplotlib")
    from train import plot

    written = plot.main([str(evaluated / arm) for arm in ARMS] + ["--out", str(tmp_path)])
    names = {p.name for p in written}
    for name in ("loss_tokens.png", "loss_wallclock.png", "speed_memory.png", "answers.png", "retrieval_passkey.png",
                 "retrieval_multikey.png", "selection_passkey.png", "selection_multikey.png", "summary.csv"):
        assert name in names
        assert (tmp_path / name).stat().st_size > 1000 or name.endswith(".csv")
    rows = (tmp_path / "summary.csv").read_text().splitlines()
    assert len(rows) == 1 + len(ARMS) and rows[0].startswith("arm,")
