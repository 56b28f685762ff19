#!/usr/bin/env python3
"""The same-run prefill table: this library, the fastest public NSA and dense SDPA, forward and
forward+backward, from the three outputs of one device call (scripts/gpu_check.sh's
`public_prefill` step writes them):

  - this library: the CSV of `nsa bench --suite backward` (rows of one variant, several runs of a
    shape averaged; --variant, default saved_o_cmp_win: the backward given o and the compressed
    and window branches' outputs, as the torch layer gives them);
  - dense: the markdown table of bench/sdpa_backward_baseline.py on that suite's `full` rows (its
    dense forward and forward+backward columns);
  - the public NSA: the logs of ../shared/anchors/mdy_nsa's bench.py (`--no-decode --no-check
    --no-breakdown`), one per group, their `nsa_core fwd`, `nsa_core bwd (README style)` and
    `nsa_core fwd+bwd` rows.

Writes the plot CSV of bench/plot_speed.py (--csv) and a markdown table with the ratios
(--markdown); prints the table. Needs nothing but the standard library.

    python3 bench/public_nsa_prefill.py --ours nsa.csv --dense dense.md --public 16=g16.txt --public 4=g4.txt \\
        [--variant saved_o_cmp_win] [--csv OUT.csv] [--markdown OUT.md]
"""
from __future__ import annotations

import argparse
import csv
import re
import statistics
import sys


def read_ours(path: str, variant: str) -> dict:
    """(G, Hkv, T) -> [(fwd, bwd, fwd+bwd), ...]: every run of `variant` at Dqk = Dv = 128."""
    out: dict = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r["variant"] != variant or r["dqk"] != "128" or r["dv"] != "128":
                continue
            key = (int(r["hq"]) // int(r["hkv"]), int(r["hkv"]), int(r["T"]))
            out.setdefault(key, []).append((float(r["fwd_ms"]), float(r["bwd_ms"]), float(r["fwd_bwd_ms"])))
    if not out:
        raise SystemExit(f"public_nsa_prefill: no rows of variant {variant!r} with Dqk = Dv = 128 in {path}")
    return out


# A row of sdpa_backward_baseline.py's main table: | Hq/Hkv | Dqk/Dv | T | NSA fwd | NSA bwd | NSA fwd+bwd |
# NSA TFLOP/s | dense fwd | dense fwd+bwd | ...
_DENSE_ROW = re.compile(r"^\| (\d+)/(\d+) \| 128/128 \| (\d+)K \| [^|]+\| [^|]+\| [^|]+\| [^|]+\| ([\d.]+) \| ([\d.]+) \|")


def read_dense(path: str) -> dict:
    """(G, Hkv, T) -> (dense fwd, dense fwd+bwd) from sdpa_backward_baseline.py's markdown."""
    out = {}
    with open(path) as f:
        for line in f:
            m = _DENSE_ROW.match(line)
            if m:
                hq, hkv, t = int(m.group(1)), int(m.group(2)), int(m.group(3)) * 1024
                out[(hq // hkv, hkv, t)] = (float(m.group(4)), float(m.group(5)))
    return out


def read_public(path: str) -> dict:
    """T -> {'fwd', 'bwd', 'fwd_bwd'} from the anchor bench.py's result table."""
    lens: list[int] = []
    out: dict = {}
    names = {"nsa_core fwd+bwd": "fwd_bwd", "nsa_core bwd (README style)": "bwd", "nsa_core fwd": "fwd"}
    with open(path) as f:
        for line in f:
            if line.startswith("case "):
                lens = [int(x) for x in line.split()[1:]]
                continue
            for prefix, name in names.items():  # (the name, then a space: "fwd" is not "fwd+bwd")
                if line.startswith(prefix + " ") and lens:
                    values = line[len(prefix):].split()
                    for t, v in zip(lens, values[-len(lens):]):
                        out.setdefault(t, {})[name] = float(v)
                    break
    if not out:
        raise SystemExit(f"public_nsa_prefill: no 'case' table in {path}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ours", required=True, help="CSV of nsa bench --suite backward")
    ap.add_argument("--dense", required=True, help="markdown of bench/sdpa_backward_baseline.py")
    ap.add_argument("--public", action="append", default=[], metavar="G=LOG",
                    help="the public NSA's bench.py log for group G (repeatable)")
    ap.add_argument("--hkv", type=int, default=4, help="the public runs' Hkv (bench.py --hkv)")
    ap.add_argument("--variant", default="saved_o_cmp_win")
    ap.add_argument("--csv")
    ap.add_argument("--markdown")
    a = ap.parse_args()
    ours, dense = read_ours(a.ours, a.variant), read_dense(a.dense)
    public = {}
    for item in a.public:
        g, sep, path = item.partition("=")
        if not sep or not g.isdigit():
            raise SystemExit(f"--public: {item!r} is not G=LOG")
        public[int(g)] = read_public(path)
    lines = [
        "| G | T | NSA fwd | public fwd | dense fwd | public / NSA fwd | NSA bwd | public bwd | NSA fwd+bwd | "
        "public fwd+bwd | dense fwd+bwd | public / NSA fwd+bwd | dense / NSA fwd+bwd |",
        "|" + " --- |" * 13,
    ]
    rows = []
    missing = []
    for (g, hkv, t), runs in sorted(ours.items(), key=lambda kv: (-kv[0][0], kv[0][2])):
        p = public.get(g, {}).get(t) if hkv == a.hkv else None
        d = dense.get((g, hkv, t))
        if p is None or d is None or not {"fwd", "bwd", "fwd_bwd"} <= set(p):
            absent = [name for name, v in (("public", p), ("dense", d)) if v is None] or ["public bwd or fwd+bwd"]
            missing.append(f"G {g} Hkv {hkv} T {t}: " + " and ".join(absent))
            continue
        f = statistics.fmean(r[0] for r in runs)
        fb = statistics.fmean(r[2] for r in runs)
        bs = " / ".join(f"{r[1]:.2f}" for r in runs)
        fbs = " / ".join(f"{r[2]:.2f}" for r in runs)
        lines.append(f"| {g} | {t // 1024}K | {f:.2f} | {p['fwd']:.2f} | {d[0]:.2f} | {p['fwd'] / f:.2f}x | {bs} | "
                     f"{p['bwd']:.2f} | {fbs} | {p['fwd_bwd']:.2f} | {d[1]:.2f} | {p['fwd_bwd'] / fb:.2f}x | "
                     f"{d[1] / fb:.2f}x |")
        rows.append([t, g * hkv, hkv, 128, 128, f"{f:.2f}", f"{p['fwd']:.2f}", f"{d[0]:.2f}", f"{fb:.2f}",
                     f"{p['fwd_bwd']:.2f}", f"{d[1]:.2f}"])
    if not rows:
        raise SystemExit("public_nsa_prefill: no shape has this library, the public NSA and dense: " + "; ".join(missing))
    print("\n".join(lines))
    for m in missing:
        print(f"left out (not measured by all three): {m}", file=sys.stderr)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(f"This library (variant {a.variant}; several runs of a shape: each, and their mean in the "
                    "ratios), the public NSA and dense SDPA in one run, ms. Above 1 this library is faster.\n\n")
            f.write("\n".join(lines) + "\n")
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.writer(f, lineterminator="\n")
            w.writerow(["T", "hq", "hkv", "dqk", "dv", "nsa_fwd_ms", "public_fwd_ms", "dense_fwd_ms", "nsa_fwd_bwd_ms",
                        "public_fwd_bwd_ms", "dense_fwd_bwd_ms"])
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
