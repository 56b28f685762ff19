#!/usr/bin/env python3
"""Dense baseline for the CUDA NSA benchmark: PyTorch SDPA, causal, GQA, bf16, same shapes.

Reads the CSV that `nsa bench --suite forward` wrote, times
torch.nn.functional.scaled_dot_product_attention (is_causal=True, enable_gqa=True; PyTorch picks
its backend, cuDNN on an H200) for every shape in it with CUDA events (warm-up, median of
repeats, random data), and prints one markdown table per shape: NSA forward and its stages,
dense forward, achieved TFLOP/s and the speedup over dense.

    python3 bench/sdpa_baseline.py nsa_bench.csv [--markdown OUT.md]
"""
import sys

import torch
import torch.nn.functional as F

from sdpa_common import csv_args, time_ms, write_markdown  # the script's folder is on sys.path


def dense_ms(T, hq, hkv, dqk, dv):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.rand(1, hq, T, dqk, device="cuda", dtype=torch.bfloat16, generator=g) * 2 - 1
    k = torch.rand(1, hkv, T, dqk, device="cuda", dtype=torch.bfloat16, generator=g) * 2 - 1
    v = torch.rand(1, hkv, T, dv, device="cuda", dtype=torch.bfloat16, generator=g) * 2 - 1
    reps = 5 if T >= 65536 else 9
    return time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), reps=reps)


def main():
    args, rows = csv_args()
    shapes = []
    for r in rows:
        key = tuple(int(r[c]) for c in ("T", "hq", "hkv", "dqk", "dv"))
        if key not in shapes:
            shapes.append(key)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    lines = []
    by_group = {}
    for key in shapes:
        T, hq, hkv, dqk, dv = key
        ms = dense_ms(*key)
        flops = 2.0 * hq * (dqk + dv) * T * (T + 1) / 2  # causal: token t attends t + 1 keys
        stages = {r["stage"]: (float(r["ms"]), float(r["tflops"])) for r in rows
                  if tuple(int(r[c]) for c in ("T", "hq", "hkv", "dqk", "dv")) == key}
        nsa_ms = stages["forward"][0]
        by_group.setdefault((hq, hkv, dqk, dv), []).append((T, nsa_ms, ms, flops / ms / 1e9, stages))
        print(f"T={T} Hq={hq} Hkv={hkv} D={dqk}/{dv}: dense SDPA {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s), "
              f"NSA forward {nsa_ms:.3f} ms, speedup {ms / nsa_ms:.2f}x", flush=True)
    for (hq, hkv, dqk, dv), entries in by_group.items():
        stage_names = []
        for entry in entries:
            stage_names += [s for s in entry[4] if s != "forward" and s not in stage_names]
        lines.append(f"\n### Hq = {hq}, Hkv = {hkv} (G = {hq // hkv}), Dqk = {dqk}, Dv = {dv}\n")
        lines.append("| T | NSA fwd ms | NSA TFLOP/s | dense SDPA ms | dense TFLOP/s | speedup | "
                     + " | ".join(f"{s} ms" for s in stage_names) + " |")
        lines.append("|" + " --- |" * (6 + len(stage_names)))
        for T, nsa_ms, ms, dense_tf, stages in entries:
            lines.append(f"| {T // 1024}K | {nsa_ms:.2f} | {stages['forward'][1]:.0f} | {ms:.2f} | {dense_tf:.0f} | "
                         f"{ms / nsa_ms:.2f}x | "
                         + " | ".join(f"{stages[s][0]:.2f}" if s in stages else "-" for s in stage_names) + " |")
    print("\n".join(lines))
    write_markdown(args.markdown, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
