"""Plots and the summary table of the comparison, from the run folders (log.jsonl, meta.json,
eval.json) into one folder.

    python3 train/plot.py out/quality/dense out/quality/nsa out/quality/nsa_backbone --out docs/images/quality

Writes (PNG, matplotlib):
  loss_tokens.png        training loss against tokens seen, one line per arm (light: per step;
                         dark: exponential moving average)
  loss_wallclock.png     the same against training wall-clock (summed over chunks)
  retrieval_<task>.png   accuracy heatmaps, needle depth x context length, one panel per arm
  selection_<task>.png   NSA arms: how often the needle's block is selected at the answer rows,
                         mean over layers, depth x length
  speed_memory.png       median step time and peak memory per arm
  answers.png            retrieval answers' token accuracy in training against tokens seen (moving
                         average over the steps with answers), and the curriculum's distance bound
                         (when the logs have them)
and summary.csv / summary.md: one row per arm (parameters, steps, tokens, wall-clock, final
training loss, held-out loss, step time, tokens/s, peak memory, mean retrieval accuracy per task
and length).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"dense": "#1f77b4", "nsa": "#d62728", "nsa_backbone": "#2ca02c"}


def read_run(run_dir: Path) -> dict:
    run = {"dir": run_dir, "log": [], "meta": {}, "eval": None}
    log = run_dir / "log.jsonl"
    if log.exists():
        run["log"] = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    if (run_dir / "meta.json").exists():
        run["meta"] = json.loads((run_dir / "meta.json").read_text())
    if (run_dir / "eval.json").exists():
        run["eval"] = json.loads((run_dir / "eval.json").read_text())
    run["arm"] = run["meta"].get("arm") or (run["eval"] or {}).get("arm") or run_dir.name
    return run


def ema(values, alpha: float):
    out, acc = [], None
    for v in values:
        acc = v if acc is None else alpha * v + (1 - alpha) * acc
        out.append(acc)
    return out


def plot_loss(runs, key: str, xlabel: str, scale: float, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        if not run["log"]:
            continue
        x = [r[key] / scale for r in run["log"]]
        y = [r["loss"] for r in run["log"]]
        color = COLORS.get(run["arm"])
        ax.plot(x, y, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(x, ema(y, min(1.0, 20.0 / max(1, len(y)))), color=color, linewidth=1.8, label=run["arm"])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("training loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_answers(runs, path: Path) -> bool:
    """Answer accuracy in training against tokens, one line per arm, and the curriculum's bound
    on a second (log) axis. False, and nothing written, when no log has answers."""
    logged = [run for run in runs if any("answer_acc" in r for r in run["log"])]
    if not logged:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    bound = None
    for run in logged:
        rows = [r for r in run["log"] if "answer_acc" in r]
        x = [r["tokens"] / 1e6 for r in rows]
        y = [r["answer_acc"] for r in rows]
        color = COLORS.get(run["arm"])
        ax.plot(x, y, color=color, alpha=0.2, linewidth=0.8)
        ax.plot(x, ema(y, min(1.0, 20.0 / max(1, len(y)))), color=color, linewidth=1.8, label=run["arm"])
        if bound is None and any("max_distance" in r for r in run["log"]):
            bound = [(r["tokens"] / 1e6, r["max_distance"]) for r in run["log"] if "max_distance" in r]
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("answer tokens predicted (argmax), training batches")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    if bound:
        twin = ax.twinx()
        twin.plot([b[0] for b in bound], [b[1] for b in bound], color="0.4", linestyle="--", linewidth=1.2)
        twin.set_yscale("log")
        twin.set_ylabel("curriculum: needle within this many tokens (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def heatmaps(panels, lengths, depths, title: str, path: Path) -> None:
    """panels: [(label, matrix [len][depth] with None for missing)]."""
    fig, axes = plt.subplots(1, len(panels), figsize=(1.6 + 2.4 * len(panels), 4.4), squeeze=False, sharey=True,
                             constrained_layout=True)
    image = None
    for ax, (label, matrix) in zip(axes[0], panels):
        grid = [[math.nan if matrix[li][di] is None else matrix[li][di] for li in range(len(lengths))]
                for di in range(len(depths))]  # rows: depth
        image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto", origin="upper")
        for di in range(len(depths)):
            for li in range(len(lengths)):
                v = grid[di][li]
                if not math.isnan(v):
                    ax.text(li, di, f"{v:.2f}", ha="center", va="center", fontsize=7,
                            color="black" if v > 0.6 else "white")
        ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)
                                            for n in lengths])
        ax.set_xlabel("context length")
        ax.set_title(label)
    axes[0][0].set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths])
    axes[0][0].set_ylabel("needle depth")
    fig.suptitle(title)
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_speed_memory(runs, path: Path) -> None:
    arms, step_ms, mem = [], [], []
    for run in runs:
        steady = run["log"][min(len(run["log"]) - 1, 5):] if run["log"] else []
        if not steady:
            continue
        arms.append(run["arm"])
        step_ms.append(statistics.median(r["step_s"] for r in steady) * 1e3)
        mem.append(max(r["peak_mem_mib"] for r in run["log"]) / 1024)
    if not arms:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.6))
    colors = [COLORS.get(arm, "gray") for arm in arms]
    a.bar(arms, step_ms, color=colors)
    a.set_ylabel("median step time (ms)")
    b.bar(arms, mem, color=colors)
    b.set_ylabel("peak memory (GiB)")
    for ax, values in ((a, step_ms), (b, mem)):
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary_rows(runs) -> list:
    rows = []
    for run in runs:
        ev, log, meta = run["eval"] or {}, run["log"], run["meta"]
        steady = log[min(len(log) - 1, 5):] if log else []
        tail = log[-max(1, len(log) // 20):] if log else []
        row = {
            "arm": run["arm"],
            "params": meta.get("params", {}).get("total"),
            "attention_params": meta.get("params", {}).get("attention"),
            "steps": log[-1]["step"] if log else None,
            "tokens": log[-1]["tokens"] if log else None,
            "train_wall_s": round(log[-1]["wall_s"], 1) if log else None,
            "final_train_loss": round(statistics.fmean(r["loss"] for r in tail), 4) if tail else None,
            "heldout_loss": round(ev["heldout"]["loss"], 4) if ev.get("heldout") else None,
            "median_step_ms": round(statistics.median(r["step_s"] for r in steady) * 1e3, 2) if steady else None,
            "tok_per_s": round(statistics.median(r["tok_per_s"] for r in steady)) if steady else None,
            "peak_mem_mib": round(max(r["peak_mem_mib"] for r in log)) if log else None,
        }
        ret = ev.get("retrieval")
        if ret:
            for task, cell in ret["tasks"].items():
                for li, n in enumerate(ret["lengths"]):
                    row[f"{task}_acc_{n}"] = round(statistics.fmean(cell["accuracy"][li]), 4)
                    if "token_accuracy" in cell:  # (evaluations written before it have none)
                        row[f"{task}_tokacc_{n}"] = round(statistics.fmean(cell["token_accuracy"][li]), 4)
        rows.append(row)
    return rows


def write_summary(rows, out: Path) -> None:
    keys = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    with (out / "summary.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for row in rows:
            w.writerow(row)
    lines = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
    for row in rows:
        lines.append("| " + " | ".join("" if row.get(k) is None else str(row[k]) for k in keys) + " |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", help="train/train.py output folders")
    p.add_argument("--out", default="docs/images/quality", help="folder for the PNGs and summary files")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [read_run(Path(d)) for d in args.run_dirs]
    written = []

    def done(name):
        written.append(out / name)
        return out / name

    plot_loss(runs, "tokens", "tokens seen (millions)", 1e6, done("loss_tokens.png"))
    plot_loss(runs, "wall_s", "training wall-clock (s)", 1.0, done("loss_wallclock.png"))
    plot_speed_memory(runs, done("speed_memory.png"))
    if plot_answers(runs, out / "answers.png"):
        done("answers.png")
    evals = [r for r in runs if r["eval"]]
    if evals:
        ref = evals[0]["eval"]["retrieval"]
        for task in ref["tasks"]:
            panels = [(r["arm"], r["eval"]["retrieval"]["tasks"][task]["accuracy"]) for r in evals
                      if task in r["eval"]["retrieval"]["tasks"]]
            heatmaps(panels, ref["lengths"], ref["depths"], f"{task} retrieval accuracy", done(f"retrieval_{task}.png"))
            sel_panels = []
            for r in evals:
                sel = r["eval"].get("selection", {}).get(task)
                if not sel:
                    continue
                per_layer = sel["needle_selected"]  # [layer][len][depth]
                mean = [[statistics.fmean(layer[li][di] for layer in per_layer)
                         for di in range(len(ref["depths"]))] for li in range(len(ref["lengths"]))]
                sel_panels.append((r["arm"], mean))
            if sel_panels:
                heatmaps(sel_panels, ref["lengths"], ref["depths"],
                         f"{task}: needle block selected at the answer rows (mean over layers)",
                         done(f"selection_{task}.png"))
    write_summary(summary_rows(runs), out)
    written += [out / "summary.csv", out / "summary.md"]
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
