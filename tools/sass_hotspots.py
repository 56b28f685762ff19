#!/usr/bin/env python3
"""Summarises Nsight Compute's per-instruction source page (scripts/profile_gpu.sh, SOURCE_REGEX).

    tools/sass_hotspots.py source.csv[.gz] [--top N]

For each kernel in the file: instructions executed (warp level) and sampled warp stalls, in total,
by opcode, and the N instructions with the most stall samples. Column names are matched loosely
(they differ between Nsight Compute versions); a column that is missing is reported, not guessed.
"""
import argparse
import collections
import csv
import gzip
import io
import sys


def open_text(path):
    if path.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def number(text):
    try:
        return float(str(text).replace(",", "")) if text not in (None, "") else 0.0
    except ValueError:
        return 0.0


def find(header, *needles, exclude=()):
    for i, name in enumerate(header):
        low = name.lower()
        if all(n in low for n in needles) and not any(x in low for x in exclude):
            return i
    return None


def sections(lines):
    """Splits the file into (title, rows) per kernel: ncu prints a "Kernel Name" row before each
    table (and may print a kernel's table twice: only its first is kept)."""
    title, block, seen = "kernel", [], set()
    for line in lines + ['"Kernel Name","end"']:
        if line.startswith('"Kernel Name"'):
            if block and title not in seen:
                seen.add(title)
                yield title, block
            block = []
            title = next(csv.reader([line]))[1]
        else:
            block.append(line)


def summarise(title, block, top):
    rows = list(csv.reader(block))
    header_at = next((i for i, r in enumerate(rows) if any("source" in c.lower() for c in r)), None)
    if header_at is None:
        print(f"{title}: no header row")
        return
    header = rows[header_at]
    body = [r for r in rows[header_at + 1:] if len(r) == len(header)]
    src = find(header, "source")
    execd = find(header, "instructions executed", exclude=("predicated",))
    stall = find(header, "warp stall sampling (all")
    missing = [n for n, c in (("Instructions Executed", execd), ("Warp Stall Sampling (All Samples)", stall)) if c is None]
    print(f"== {title}")
    if missing:
        print("   missing columns:", ", ".join(missing), "| have:", ", ".join(header))
    total_e = sum(number(r[execd]) for r in body) if execd is not None else 0.0
    total_s = sum(number(r[stall]) for r in body) if stall is not None else 0.0
    print(f"   {len(body)} instructions, {total_e:.4g} executed (warp level), {total_s:.4g} stall samples")
    by_op = collections.defaultdict(lambda: [0.0, 0.0])
    for r in body:
        text = r[src].strip()
        op = text.split()[0] if text else "?"
        if op.startswith("@") and len(text.split()) > 1:
            op = text.split()[1]
        op = op.split(".")[0]
        by_op[op][0] += number(r[execd]) if execd is not None else 0.0
        by_op[op][1] += number(r[stall]) if stall is not None else 0.0
    reasons = [(i, name) for i, name in enumerate(header) if name.startswith("stall_") and "(" not in name]
    if reasons:
        totals = sorted(((sum(number(r[i]) for r in body), name[6:]) for i, name in reasons), reverse=True)
        print("   stall reasons (% of samples):",
              ", ".join(f"{name} {100 * v / max(total_s, 1):.1f}" for v, name in totals if v > 0.005 * total_s))
    print("   by opcode (executed %, stall samples %):")
    for op, (e, s) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:25]:
        print(f"     {op:12s} {100 * e / max(total_e, 1):6.2f}%  {100 * s / max(total_s, 1):6.2f}%")
    if stall is not None:
        print(f"   top {top} instructions by stall samples:")
        ranked = sorted(range(len(body)), key=lambda i: -number(body[i][stall]))[:top]
        for i in ranked:
            r = body[i]
            e = number(r[execd]) if execd is not None else 0.0
            print(f"     #{i:6d} {100 * number(r[stall]) / max(total_s, 1):5.2f}%  exec {e:10.4g}  {r[src].strip()[:90]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    with open_text(args.path) as f:
        lines = f.read().splitlines()
    if not lines:
        sys.exit(f"{args.path}: empty")
    for title, block in sections(lines):
        summarise(title, block, args.top)


if __name__ == "__main__":
    main()
