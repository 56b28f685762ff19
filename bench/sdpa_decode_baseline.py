#!/usr/bin/env python3
"""Dense baseline of the decode benchmark: PyTorch SDPA decoding, same shapes, same run.

Reads the CSV that nsa_decode_bench wrote (one row per batch B and cache length T), times
torch.nn.functional.scaled_dot_product_attention for one new query per sequence against T cached
keys (q [B, Hq, 1, D], k/v [B, Hkv, T, D], GQA; PyTorch picks its backend) eagerly and as a
CUDA-graph replay, and prints a markdown table: NSA attend and whole step (graph), the library's
own dense decode, SDPA, the speedups over SDPA and the bandwidth each reaches.

    python3 bench/sdpa_decode_baseline.py nsa_decode.csv [--markdown OUT.md]
"""
import sys

import torch
import torch.nn.functional as F

# sdpa_common: the script's folder is on sys.path
from sdpa_common import add_row, csv_args, graph_ms, table_header, time_ms, write_markdown


def sdpa_decode_ms(B, T, hq, hkv, dqk, dv):
    """(eager ms, graph ms) of one decode step of SDPA over T cached tokens."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.rand(B, hq, 1, dqk, device="cuda", dtype=torch.bfloat16, generator=g) * 2 - 1
    k = torch.rand(B, hkv, T, dqk, device="cuda", dtype=torch.bfloat16, generator=g) * 2 - 1
    v = torch.rand(B, hkv, T, dv, device="cuda", dtype=torch.bfloat16, generator=g) * 2 - 1
    out = torch.empty(B, hq, 1, dv, device="cuda", dtype=torch.bfloat16)

    def step():
        out.copy_(F.scaled_dot_product_attention(q, k, v, enable_gqa=True))

    eager = time_ms(step, warmup=3, reps=21)
    graphed = graph_ms(step)
    del q, k, v
    torch.cuda.empty_cache()
    return eager, graphed


def main():
    args, rows = csv_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    lines = table_header("B", "T", "NSA attend us (graph)", "NSA step us (graph)", "NSA attend GB/s",
                         "nsa dense us (graph)", "SDPA us (eager)", "SDPA us (graph)", "SDPA GB/s", "SDPA / NSA attend",
                         "SDPA / NSA step")
    for r in rows:
        B, T, hq, hkv, dqk, dv = (int(r[c]) for c in ("B", "T", "hq", "hkv", "dqk", "dv"))
        eager, graphed = sdpa_decode_ms(B, T, hq, hkv, dqk, dv)
        attend = float(r["attend_graph_ms"]) * 1e3
        step = float(r["step_graph_ms"]) * 1e3
        dense = float(r["dense_graph_ms"]) * 1e3
        dense_bytes = float(r["dense_bytes"])
        line = (f"| {B} | {T // 1024}K | {attend:.1f} | {step:.1f} | {float(r['attend_bytes']) / attend / 1e3:.0f} | "
                f"{dense:.1f} | {eager * 1e3:.1f} | {graphed * 1e3:.1f} | {dense_bytes / (graphed * 1e6):.0f} | "
                f"{graphed * 1e3 / attend:.2f}x | {graphed * 1e3 / step:.2f}x |")
        add_row(lines, line)
    write_markdown(args.markdown, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
