#!/usr/bin/env python3
"""Dense baseline for the CUDA NSA backward benchmark: PyTorch SDPA forward+backward.

Reads the CSV that `nsa bench --suite backward` wrote, times torch.nn.functional.
scaled_dot_product_attention (is_causal=True, enable_gqa=True, bf16; PyTorch picks its backend)
forward and forward+backward for every shape in it with CUDA events (warm-up, median of repeats,
random data), and prints a markdown table: NSA forward, backward, forward+backward, the dense
numbers and the speedup, the backward's workspace against q, k, v, o, the peak device memory of
a forward+backward (NSA: every tensor the layer reads or writes, three K/V pairs, plus the larger
workspace, from the CSV; dense: torch.cuda.max_memory_allocated over one forward+backward, with
q, k, v and dO); then the ablations.

    python3 bench/sdpa_backward_baseline.py nsa_backward_bench.csv [--markdown OUT.md]
"""
import sys

import torch
import torch.nn.functional as F

from sdpa_common import add_row, csv_args, table_header, time_ms, write_markdown  # the script's folder is on sys.path


def dense_ms(T, hq, hkv, dqk, dv):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = (torch.rand(1, hq, T, dqk, device="cuda", dtype=torch.bfloat16, generator=g) * 2 - 1).requires_grad_()
    k = (torch.rand(1, hkv, T, dqk, device="cuda", dtype=torch.bfloat16, generator=g) * 2 - 1).requires_grad_()
    v = (torch.rand(1, hkv, T, dv, device="cuda", dtype=torch.bfloat16, generator=g) * 2 - 1).requires_grad_()
    do = torch.rand(1, hq, T, dv, device="cuda", dtype=torch.bfloat16, generator=g) * 2 - 1
    reps = 5 if T >= 65536 else 9

    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def fwd_bwd():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.autograd.grad(o, (q, k, v), do)

    f, fb = time_ms(fwd, reps=reps), time_ms(fwd_bwd, reps=reps)
    # Peak device memory of one forward+backward: q, k, v, dO, and what SDPA and autograd allocate.
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    return f, fb, torch.cuda.max_memory_allocated() / 1e6


def main():
    args, rows = csv_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    lines = table_header("Hq/Hkv", "Dqk/Dv", "T", "NSA fwd ms", "NSA bwd ms", "NSA fwd+bwd ms", "NSA bwd TFLOP/s",
                         "dense fwd ms", "dense fwd+bwd ms", "fwd+bwd speedup", "bwd workspace MB (% of q,k,v,o)",
                         "NSA peak MB", "dense peak MB")
    ablations = ["", *table_header("Hq/Hkv", "Dqk/Dv", "T", "variant", "NSA fwd ms", "NSA bwd ms", "NSA fwd+bwd ms")]
    for r in rows:
        T, hq, hkv, dqk, dv = (int(r[c]) for c in ("T", "hq", "hkv", "dqk", "dv"))
        f, b, fb = float(r["fwd_ms"]), float(r["bwd_ms"]), float(r["fwd_bwd_ms"])
        if r["variant"] != "full":
            ablations.append(f"| {hq}/{hkv} | {dqk}/{dv} | {T // 1024}K | {r['variant']} | {f:.2f} | {b:.2f} | {fb:.2f} |")
            continue
        ws, qkvo = float(r["ws_mb"]), float(r["qkvo_mb"])
        nsa_peak = f"{float(r['peak_mb']):.0f}" if r.get("peak_mb") else "-"
        try:
            dense_f, dense_fb, dense_peak = dense_ms(T, hq, hkv, dqk, dv)
            dense = f"{dense_f:.2f} | {dense_fb:.2f} | {dense_fb / fb:.2f}x"
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # no SDPA backend for this shape: say so
            print(f"dense SDPA failed at T={T} Hq={hq} Dqk={dqk} Dv={dv}: {e}", file=sys.stderr, flush=True)
            torch.cuda.empty_cache()
            dense, dense_peak = "failed | failed | -", None
        line = (f"| {hq}/{hkv} | {dqk}/{dv} | {T // 1024}K | {f:.2f} | {b:.2f} | {fb:.2f} | {float(r['bwd_tflops']):.0f} | "
                f"{dense} | {ws:.0f} ({100 * ws / qkvo:.1f}%) | {nsa_peak} | {'-' if dense_peak is None else f'{dense_peak:.0f}'} |")
        add_row(lines, line)
    lines += ablations
    print("\n".join(lines))
    write_markdown(args.markdown, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
