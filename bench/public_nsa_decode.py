#!/usr/bin/env python3
"""The fastest public NSA's decode (flash_nsa.nsa_decode, Triton; laid out by
../shared/anchors/mdy_nsa/setup.sh), timed as a CUDA-graph replay for the same batches and
lengths as nsa_decode_bench, in the same run. It supports shared K/V with mean pooling only, pages
of 128 tokens; one new token per sequence, whose compressed block it writes when one completes.

    PYTHONPATH=.anchors/mdy_nsa/src python3 bench/public_nsa_decode.py --batch 1,8,64 --lens 8192,65536
"""
import sys

import torch
import triton

# sdpa_common: the script's folder is on sys.path
from sdpa_common import add_row, batch_lens_args, graph_ms, table_header, time_ms, write_markdown

HQ, HKV, D = 64, 4, 128
KERNEL, STRIDE, BLOCK, TOPN, INIT, LOCAL, WINDOW = 32, 16, 64, 16, 1, 2, 512


def bench(B, T):
    from flash_nsa import nsa_decode

    torch.manual_seed(0)
    dev, dt, PAGE = "cuda", torch.bfloat16, 128
    n_x = triton.cdiv(T, PAGE)
    t2 = max((T - KERNEL) // STRIDE + 1, 0)
    n_c = triton.cdiv(t2, PAGE)
    per_seq = n_x + n_c
    k = torch.randn(B * per_seq + 1, PAGE, HKV, D, device=dev, dtype=dt)
    v = torch.randn(B * per_seq + 1, PAGE, HKV, D, device=dev, dtype=dt)
    width = triton.cdiv(n_x, 8) * 8
    cwidth = triton.cdiv(n_c, 8) * 8
    bt = torch.full((B, width), -1, dtype=torch.int32)
    cbt = torch.full((B, cwidth), -1, dtype=torch.int32)
    slots = []
    for b in range(B):
        bt[b, :n_x] = torch.arange(b * per_seq, b * per_seq + n_x)
        cbt[b, :n_c] = torch.arange(b * per_seq + n_x, (b + 1) * per_seq)
        last = t2 - 1
        slots.append((b * per_seq + n_x + last // PAGE) * PAGE + last % PAGE)
    kw = dict(context_lens=torch.full((B,), T, device=dev, dtype=torch.int32), block_tables=bt.to(dev),
              cmp_block_tables=cbt.to(dev), cmp_slot_mapping=torch.tensor(slots, device=dev, dtype=torch.int32),
              fixed_y_maxlen=T // STRIDE, fixed_num_slc_blocks=triton.cdiv(T, BLOCK), kernel_size=KERNEL,
              stride=STRIDE, block_size=BLOCK, top_n=TOPN, num_init_blocks=INIT, num_local_blocks=LOCAL,
              window_size=WINDOW, sm_scale=D ** -0.5)
    q = torch.randn(B, HQ, D, device=dev, dtype=dt)
    w = torch.rand(B, HQ, 3, device=dev, dtype=dt)

    def step():
        return nsa_decode(q, k, v, w, **kw)

    step()
    eager = time_ms(step, warmup=3, reps=21)
    graph = graph_ms(step)
    del k, v
    torch.cuda.empty_cache()
    return eager, graph


def main():
    args = batch_lens_args("8192,16384,32768,65536,131072")
    lines = table_header("B", "T", "public NSA decode us (eager)", "public NSA decode us (graph)")
    for B in (int(b) for b in args.batch.split(",")):
        for T in (int(t) for t in args.lens.split(",")):
            try:
                eager, graph = bench(B, T)
                line = f"| {B} | {T // 1024}K | {eager * 1e3:.1f} | {graph * 1e3:.1f} |"
            except Exception as e:  # keep going: report what failed
                line = f"| {B} | {T // 1024}K | failed: {type(e).__name__}: {str(e)[:80]} | - |"
                torch.cuda.empty_cache()
            add_row(lines, line)
    write_markdown(args.markdown, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
