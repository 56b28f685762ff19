"""Evaluate trained runs: held-out LM loss, retrieval accuracy by depth x length, and for NSA
arms how the needle fared in the selection and what the gates did.

    python3 train/evaluate.py out/quality/dense out/quality/nsa out/quality/nsa_backbone

Per run folder (train/train.py's --out-dir) it writes ``eval.json`` there and prints the tables:

- heldout: mean next-token cross-entropy (nats, and bits) over evenly spaced windows of the
  trained length from the held-out files;
- retrieval: for each task (passkey, multikey), the share of samples whose every answer token is
  the model's argmax given the prompt and the earlier answer tokens (exactly what greedy decoding
  would produce), on a grid of 10 needle depths x lengths (default: the trained length, 2x, 4x),
  and the share of answer tokens (the value's digits) that are the argmax (``token_accuracy``: a
  graded signal, about 0.1 for a model that knows only that digits come, 1 for retrieval). The
  samples are seeded by their cell alone, so every arm sees the same ones;
- selection (NSA arms): at the rows that predict the answer, per layer, how often a block holding
  the needle's value is among the selected blocks (``needle_selected``), how often it was forced
  there (initial, local or backbone blocks: ``needle_forced``), how often it was selected where it
  was not forced (``needle_selected_unforced``: the learned scores' own success), how often the
  whole value lies inside the sliding window (``needle_in_window``), and the mean gate per branch
  (cmp, slc, win) at those rows (``gate_answer``) and over all rows (``gate_all``);
- train: the run's final loss, median step time, tokens/s and peak memory from its log.

The NSA layer returns only its output; the selection's indices and the gates are taken from the
layer's ``capture`` switch (``aux``).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import torch.nn.functional as F

from train import data as data_mod
from train.model import ModelConfig, build_model

BRANCHES = ("cmp", "slc", "win")


def load_run(run_dir: Path, device: torch.device):
    ckpt = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)
    cfg = ModelConfig(**ckpt["model_config"])
    cfg.save_branch_outputs = False
    model = build_model(cfg, seed=0)
    model.load_state_dict(ckpt["model"])
    model.to(device).eval()
    return model, cfg, ckpt


def autocast_for(device: torch.device):
    return (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
            else torch.autocast("cpu", enabled=False))


@torch.no_grad()
def heldout_loss(model, corpus, seq_len: int, windows: int, batch: int, device) -> dict:
    tokens = torch.from_numpy(data_mod.heldout_windows(corpus, seq_len, windows))
    total, count = 0.0, 0
    for i in range(0, windows, batch):
        chunk = tokens[i:i + batch].to(device)
        with autocast_for(device):
            logits = model(chunk[:, :-1]).float()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1),
                                 reduction="sum").item()
        count += chunk[:, 1:].numel()
    loss = total / count
    return {"loss": loss, "bits_per_token": loss / math.log(2), "windows": windows, "tokens": count}


class SelectionStats:
    """Sums over (layer, length, depth) cells of the needle's fate in the selection and the gates."""

    def __init__(self, cfg: ModelConfig, layers, n_lengths: int, n_depths: int):
        self.cfg, self.layers = cfg, layers
        shape = (len(layers), n_lengths, n_depths)
        self.rows = np.zeros(shape)
        self.selected = np.zeros(shape)
        self.forced = np.zeros(shape)
        self.unforced_rows = np.zeros(shape)
        self.unforced_selected = np.zeros(shape)
        self.in_window = np.zeros(shape[1:])
        self.window_rows = np.zeros(shape[1:])
        self.gate_answer = np.zeros(shape + (3,))
        self.gate_all = np.zeros((len(layers), 3))
        self.gate_all_rows = np.zeros(len(layers))
        self.offsets = [tuple(layer.config.backbone_offsets) for layer in layers]

    def add(self, samples, seq_len: int, li: int, di: int) -> None:
        cfg, lp = self.cfg, self.cfg.slc_block_len
        for k, layer in enumerate(self.layers):
            aux = layer.aux
            idx = aux["indices"].cpu().numpy()  # [B * seq_len, Hkv, n]
            gates = aux["gates"].float()  # [B * seq_len, Hq, 3]
            self.gate_all[k] += gates.sum(dim=(0, 1)).cpu().numpy() / gates.shape[1]
            self.gate_all_rows[k] += gates.shape[0]
            for b, s in enumerate(samples):
                t = s.answer_rows()  # positions in the sample
                rows = b * seq_len + t
                blocks = np.arange(s.needle[0] // lp, (s.needle[1] - 1) // lp + 1)
                hit = np.isin(idx[rows], blocks).any(axis=-1)  # [rows, Hkv]
                J = t // lp
                forced = np.zeros(len(t), dtype=bool)
                for j in blocks:
                    forced |= (j < cfg.n_init) | ((J - cfg.n_local < j) & (j <= J))
                    for o in self.offsets[k]:
                        forced |= J - o == j
                self.rows[k, li, di] += hit.size
                self.selected[k, li, di] += hit.sum()
                self.forced[k, li, di] += forced.sum() * hit.shape[1]
                free = ~forced
                self.unforced_rows[k, li, di] += free.sum() * hit.shape[1]
                self.unforced_selected[k, li, di] += hit[free].sum()
                self.gate_answer[k, li, di] += gates[torch.from_numpy(rows)].mean(dim=1).sum(dim=0).cpu().numpy()
                if k == 0:
                    inside = t - cfg.window + 1 <= s.needle[0] if cfg.window else np.zeros(len(t), dtype=bool)
                    self.in_window[li, di] += np.sum(inside)
                    self.window_rows[li, di] += len(t)

    def result(self) -> dict:
        def ratio(a, b):
            with np.errstate(invalid="ignore", divide="ignore"):
                r = np.where(b > 0, a / np.maximum(b, 1), np.nan)
            return [[[None if math.isnan(x) else round(float(x), 4) for x in row] for row in layer] for layer in r] \
                if r.ndim == 3 else [[None if math.isnan(x) else round(float(x), 4) for x in row] for row in r]

        answer_rows = self.rows / self.cfg.n_kv_heads  # self.rows counts each answer row once per KV head
        return {
            "needle_selected": ratio(self.selected, self.rows),
            "needle_forced": ratio(self.forced, self.rows),
            "needle_selected_unforced": ratio(self.unforced_selected, self.unforced_rows),
            "needle_in_window": ratio(self.in_window, self.window_rows),
            "gate_answer": {name: ratio(self.gate_answer[..., i], answer_rows) for i, name in enumerate(BRANCHES)},
            "gate_all": {name: [round(float(x), 4) for x in self.gate_all[:, i] / np.maximum(1, self.gate_all_rows)]
                         for i, name in enumerate(BRANCHES)},
            "backbone_offsets": [list(o) for o in self.offsets],
        }


@torch.no_grad()
def retrieval(model, cfg: ModelConfig, corpus, lengths, depths, tasks, samples: int, n_keys: int,
              tokens_per_batch: int, device, seed: int) -> tuple:
    sparse = cfg.attention != "dense"
    layers = model.attention_layers() if sparse else []
    out, stats = {}, {}
    for task in tasks:
        acc = np.zeros((len(lengths), len(depths)))
        tok = np.zeros((len(lengths), len(depths)))
        st = SelectionStats(cfg, layers, len(lengths), len(depths)) if sparse else None
        for li, length in enumerate(lengths):
            per_batch = max(1, tokens_per_batch // length)
            for di, depth in enumerate(depths):
                cell = data_mod.retrieval_eval_set(corpus, length, float(depth), di, task, samples, seed, n_keys)
                correct, right_tokens, answer_tokens = 0, 0, 0
                for i in range(0, len(cell), per_batch):
                    chunk = cell[i:i + per_batch]
                    tokens = torch.from_numpy(np.stack([s.tokens for s in chunk])).to(device)
                    for layer in layers:
                        layer.capture = True
                    with autocast_for(device):
                        h = model.hidden_states(tokens[:, :-1])
                        rows = [torch.from_numpy(s.answer_rows()).to(device) for s in chunk]
                        logits = torch.stack([model.lm_head(h[b, r]) for b, r in enumerate(rows)])  # [b, answer, V]
                    targets = torch.stack([tokens[b, r + 1] for b, r in enumerate(rows)])
                    hit = logits.argmax(-1) == targets
                    correct += int(hit.all(dim=-1).sum())
                    right_tokens += int(hit.sum())
                    answer_tokens += hit.numel()
                    if st is not None:
                        st.add(chunk, length, li, di)
                    for layer in layers:
                        layer.capture, layer.aux = False, None
                acc[li, di] = correct / len(cell)
                tok[li, di] = right_tokens / max(answer_tokens, 1)
        out[task] = {"accuracy": [[round(float(x), 4) for x in row] for row in acc],
                     "token_accuracy": [[round(float(x), 4) for x in row] for row in tok]}
        if st is not None:
            stats[task] = st.result()
    return out, stats


def train_summary(run_dir: Path) -> dict:
    path = run_dir / "log.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        return {}
    tail = rows[-max(1, len(rows) // 20):]
    steady = rows[min(len(rows) - 1, 5):]  # the first steps include warm-up (allocator, kernels' first use)
    return {"steps": rows[-1]["step"], "tokens": rows[-1]["tokens"], "wall_s": rows[-1]["wall_s"],
            "final_loss": statistics.fmean(r["loss"] for r in tail),
            "median_step_s": statistics.median(r["step_s"] for r in steady),
            "median_tok_per_s": statistics.median(r["tok_per_s"] for r in steady),
            "peak_mem_mib": max(r["peak_mem_mib"] for r in rows)}


def markdown(result: dict) -> str:
    lines = [f"## {result['arm']} ({result['run_dir']}, step {result['step']})", ""]
    h = result["heldout"]
    lines.append(f"held-out loss {h['loss']:.4f} nats/token ({h['bits_per_token']:.4f} bits), "
                 f"{h['windows']} windows of {result['seq_len']}")
    if result.get("train"):
        t = result["train"]
        lines.append(f"train: final loss {t['final_loss']:.4f}, median step {t['median_step_s'] * 1e3:.1f} ms, "
                     f"{t['median_tok_per_s']:,.0f} tok/s, peak memory {t['peak_mem_mib']:,.0f} MiB")
    r = result["retrieval"]
    for task, cell in r["tasks"].items():
        lines += ["", f"{task} accuracy / answer-token accuracy (rows: depth, columns: length)", "",
                  "| depth | " + " | ".join(str(n) for n in r["lengths"]) + " |",
                  "| --- |" + " --- |" * len(r["lengths"])]
        for di, d in enumerate(r["depths"]):
            pairs = (f"{cell['accuracy'][li][di]:.2f} / {cell['token_accuracy'][li][di]:.2f}"
                     for li in range(len(r["lengths"])))
            lines.append(f"| {d:.2f} | " + " | ".join(pairs) + " |")
        sel = result.get("selection", {}).get(task)
        if sel:
            lines += ["", f"{task} selection at the answer rows, mean over depths (rows: layer, columns: length): "
                          "needle block selected / forced / selected where not forced; gates cmp, slc, win", "",
                      "| layer | " + " | ".join(str(n) for n in r["lengths"]) + " |",
                      "| --- |" + " --- |" * len(r["lengths"])]

            def mean(values):
                v = [x for x in values if x is not None]
                return f"{statistics.fmean(v):.2f}" if v else "-"

            for k in range(len(sel["needle_selected"])):
                cells = []
                for li in range(len(r["lengths"])):
                    gates = "/".join(mean(sel["gate_answer"][b][k][li]) for b in BRANCHES)
                    cells.append(f"{mean(sel['needle_selected'][k][li])} / {mean(sel['needle_forced'][k][li])} / "
                                 f"{mean(sel['needle_selected_unforced'][k][li])}; g {gates}")
                lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def evaluate(run_dir, lengths=None, n_depths: int = 10, samples: int = 10, tasks=data_mod.TASKS,
             heldout_windows: int = 16, tokens_per_batch: int = 131072, device="auto", threads: int = 0,
             seed: int = 1234, out=None) -> dict:
    run_dir = Path(run_dir)
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    if threads > 0:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model, cfg, ckpt = load_run(run_dir, dev)
    for layer in model.attention_layers():
        if hasattr(layer, "num_threads"):
            layer.num_threads = threads
    args = ckpt["args"]
    seq_len = args["seq_len"]
    lengths = list(lengths) if lengths else [seq_len, 2 * seq_len, 4 * seq_len]
    depths = [round(float(d), 4) for d in np.linspace(0.0, 1.0, n_depths)]
    _, held, corpus_info = data_mod.load_corpora(args["heldout_percent"])
    result = {"arm": cfg.attention, "run_dir": str(run_dir), "step": ckpt["step"], "steps": args["steps"],
              "tokens": ckpt["tokens"], "seq_len": seq_len, "device": str(dev), "data": corpus_info}
    result["heldout"] = heldout_loss(model, held, seq_len, heldout_windows, max(1, tokens_per_batch // seq_len), dev)
    acc, sel = retrieval(model, cfg, held, lengths, depths, tasks, samples, args["n_keys"], tokens_per_batch, dev, seed)
    result["retrieval"] = {"lengths": lengths, "depths": depths, "samples": samples, "tasks": acc}
    if sel:
        result["selection"] = sel
    result["train"] = train_summary(run_dir)
    result["eval_seconds"] = round(time.perf_counter() - t0, 2)
    out_path = Path(out) if out else run_dir / "eval.json"
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    return result


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None (a preset's or a computed default, which the help names)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("run_dirs", nargs="+", help="train/train.py output folders")
    p.add_argument("--lengths", help="comma-separated context lengths (default: trained length, 2x, 4x)")
    p.add_argument("--depths", type=int, default=10, help="needle depths, evenly spaced over [0, 1]")
    p.add_argument("--samples", type=int, default=10, help="samples per (task, length, depth) cell")
    p.add_argument("--tasks", default=",".join(data_mod.TASKS))
    p.add_argument("--heldout-windows", type=int, default=16)
    p.add_argument("--tokens-per-batch", type=int, default=131072, help="tokens per forward pass")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=1234, help="seed of the evaluation samples (same for every arm)")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else None
    tasks = [t for t in args.tasks.split(",") if t]
    for t in tasks:
        if t not in data_mod.TASKS:
            p.error(f"--tasks: {t!r} is not one of {data_mod.TASKS}")
    results = []
    for run_dir in args.run_dirs:
        r = evaluate(run_dir, lengths, args.depths, args.samples, tasks, args.heldout_windows, args.tokens_per_batch,
                     args.device, args.threads, args.seed)
        print(markdown(r), flush=True)
        results.append(r)
    return results


if __name__ == "__main__":
    main()
