"""Draws the README's speed plot: forward and forward+backward time against sequence length on the
H200 for this library (NSA), the fastest public NSA kernels and dense attention (PyTorch SDPA),
at G = 16 and G = 4, from a same-run benchmark CSV in docs/benchmarks/results/.

    python bench/plot_speed.py [--csv docs/benchmarks/results/<file>.csv] [--out docs/images/speed_h200.png]

The CSV needs the columns T, hq, hkv, dqk, nsa_fwd_ms, public_fwd_ms, dense_fwd_ms, nsa_fwd_bwd_ms,
public_fwd_bwd_ms, dense_fwd_bwd_ms (one row per shape and length; rows with Dqk != 128 are left
out). Needs matplotlib (not a dependency of nsa: pip install matplotlib).
"""
from __future__ import annotations

import argparse
import csv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CSV = ROOT / "docs/benchmarks/results/h200_public_nsa_prefill_c841e78.csv"
DEFAULT_OUT = ROOT / "docs/images/speed_h200.png"
# What the default CSV's rows were measured on (docs/benchmarks/h200.md, "Against the fastest
# public NSA"); another CSV gets its own words through --note.
DEFAULT_NOTE = ("nsa: c841e78, the backward given o and the compressed branch's output; public: "
                "mdy666/Scalable-Flash-Native-Sparse-Attention fcf117c; one device call, 2026-12-04")

# (column prefix, legend, colour, marker)
SERIES = [
    ("nsa", "nsa (this library, CUDA)", "#d62728", "o"),
    ("public", "fastest public NSA (Triton)", "#1f77b4", "s"),
    ("dense", "dense attention (PyTorch SDPA)", "#7f7f7f", "^"),
]
PASSES = [("fwd", "forward"), ("fwd_bwd", "forward + backward")]


def read_rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["dqk"] == "128"]
    if not rows:
        raise SystemExit(f"plot_speed: no rows with dqk = 128 in {path}")
    return rows


def plot(rows: list[dict], csv_path: Path, out: Path, note: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, LogLocator

    groups = sorted({(int(r["hq"]), int(r["hkv"])) for r in rows}, key=lambda s: -s[0] // s[1])
    fig, axes = plt.subplots(len(groups), len(PASSES), figsize=(10, 3.6 * len(groups)), squeeze=False)
    lengths = sorted({int(r["T"]) for r in rows})
    for i, (hq, hkv) in enumerate(groups):
        shape = [r for r in rows if (int(r["hq"]), int(r["hkv"])) == (hq, hkv)]
        for j, (suffix, title) in enumerate(PASSES):
            ax = axes[i][j]
            for prefix, label, colour, marker in SERIES:
                pts = sorted((int(r["T"]), float(r[f"{prefix}_{suffix}_ms"])) for r in shape
                             if r.get(f"{prefix}_{suffix}_ms"))
                if pts:
                    ax.plot(*zip(*pts), label=label, color=colour, marker=marker, linewidth=2)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(lengths, [f"{t // 1024}K" for t in lengths])
            ax.minorticks_off()
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
            ax.grid(True, which="major", alpha=0.3)
            ax.set_title(f"{title}, G = {hq // hkv} (Hq {hq}, Hkv {hkv})", fontsize=11)
            ax.set_xlabel("sequence length T")
            ax.set_ylabel("time (ms, lower is better)")
    axes[0][0].legend(fontsize=9)
    fig.suptitle("One NVIDIA H200, bf16, one sequence, D = 128, paper blocks (l 32, d 16, l' 64, n 16, w 512), "
                 "random data", fontsize=10)
    source = csv_path.relative_to(ROOT) if csv_path.is_relative_to(ROOT) else csv_path
    fig.text(0.5, 0.005, f"data: {source}" + (f"\n{note}" if note else ""), ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.035, 1, 0.97))
    out.parent.mkdir(parents=True, exist_ok=True)
    # No creation time or software version in the file: the same CSV gives the same bytes.
    fig.savefig(out, dpi=100, metadata={"Software": None})
    print(f"plot_speed: wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--note", default=None, help="where the figures come from (commits, date); "
                    "default: the default CSV's")
    args = ap.parse_args()
    path = args.csv.resolve()
    note = args.note if args.note is not None else DEFAULT_NOTE if path == DEFAULT_CSV else ""
    plot(read_rows(path), path, args.out, note)


if __name__ == "__main__":
    main()
