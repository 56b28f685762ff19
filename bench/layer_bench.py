#!/usr/bin/env python3
"""The training layer: nsa.NativeSparseAttention against its dense twin, forward and
forward+backward, on the GPU, in one run.

For each group G (64/4 and 16/4 heads, D 128, hidden = Hq * D), phi (mean, mlp with F = 4D) and
length T (one sequence, bf16): the layer (independent K/V, gates, rotary, paper blocks) and the
dense twin (the same q / one K/V set / o projections, q, k and v as one product as the layer
does, the layer's rotary, PyTorch SDPA causal with GQA)
on the same x. Forward: the layer's call; forward+backward: the call, then backward of
out.sum() through every parameter and x. Median of CUDA-event timings (two warm-ups, then 15 runs
up to 16K, 7 at 32K, 5 above: --reps); peak memory: the most
allocated during one forward+backward beyond what was allocated before it.

    python3 bench/layer_bench.py [--lens 8192,16384,32768,65536] [--groups 16,4] [--phi mean,mlp]
                                 [--kept o_cmp_win] [--gate linear] [--kv-sets compact]
                                 [--csv OUT.csv] [--markdown OUT.md]

--kept: what the layer keeps for the backward besides o (KEPT), one or more of o_cmp_win (the
compressed and window branches' outputs: the layer's default, save_cmp_output and save_win_output),
o_cmp (the compressed branch's alone), o (nothing more) and o_branch (every branch's output:
save_branch_outputs=True), each measured in the same run.
--gate: the layer's gate, linear (the layer's default, gate_hidden=0: one Linear of 3 Hq columns, as
the public NSA layers have it) and / or mlp (an MLP gate hidden / 4 wide, gate_hidden = hidden // 4).
--kv-sets: how the layer hands its K and V sets to the library: compact (the layer's way: each set
its own [T, Hkv, D] array) and / or views (strided views into the fused projection's rows and the
rotated keys, without the copy).
"""
import argparse
import csv
import sys

import torch
import torch.nn.functional as F

import nsa
import nsa.modules
from sdpa_common import time_ms  # the script's folder is on sys.path

HKV, D = 4, 128
# --kept: the layer's arguments for what it keeps for the backward besides o.
KEPT = {
    "o_cmp_win": dict(save_cmp_output=True, save_win_output=True),
    "o_cmp": dict(save_cmp_output=True, save_win_output=False),
    "o": dict(save_cmp_output=False, save_win_output=False),
    "o_branch": dict(save_branch_outputs=True, save_cmp_output=False, save_win_output=False),
}


class DenseTwin(torch.nn.Module):
    """The layer's projections and rotary around dense causal attention."""

    def __init__(self, layer):
        super().__init__()
        h, hq = layer.hidden_size, layer.num_heads
        dev, dt = layer.q_proj.weight.device, layer.q_proj.weight.dtype
        self.layer = layer  # for _rotate (its inv_freq)
        self.qkv_proj = torch.nn.Linear(h, (hq + 2 * HKV) * D, bias=False, device=dev, dtype=dt)  # one product
        self.o_proj = torch.nn.Linear(hq * D, h, bias=False, device=dev, dtype=dt)
        self.hq = hq

    def forward(self, x):
        T = x.shape[0]
        pos = torch.arange(T, device=x.device)
        q, k, v = self.qkv_proj(x).split([self.hq * D, HKV * D, HKV * D], dim=-1)
        q = self.layer._rotate(q.view(T, self.hq, D), pos)
        k = self.layer._rotate(k.view(T, HKV, D), pos)
        v = v.view(T, HKV, D)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           is_causal=True, enable_gqa=True)
        return self.o_proj(o[0].transpose(0, 1).reshape(T, self.hq * D))


def auto_reps(T):
    """Timed runs per measurement: more where a step is short and its median noisier."""
    return 15 if T <= 16384 else 7 if T <= 32768 else 5


def measure(module, x, reps):
    fwd = time_ms(lambda: module(x), warmup=2, reps=reps)

    def step():
        x.grad = None
        module.zero_grad(set_to_none=True)
        module(x).float().sum().backward()

    both = time_ms(step, warmup=2, reps=reps)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return fwd, both, peak


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", default="8192,16384,32768,65536")
    ap.add_argument("--groups", default="16,4")
    ap.add_argument("--phi", default="mean,mlp")
    ap.add_argument("--reps", type=int, default=0, help="timed runs (median); 0: 15 up to 16K, 7 at 32K, 5 above")
    ap.add_argument("--kept", default="o_cmp_win", help=", ".join(KEPT) + " (comma-separated)")
    ap.add_argument("--gate", default="linear", help="linear, mlp (comma-separated)")
    ap.add_argument("--kv-sets", default="compact", help="compact, views (comma-separated)")
    ap.add_argument("--csv")
    ap.add_argument("--markdown")
    a = ap.parse_args()
    for kept in a.kept.split(","):
        if kept not in KEPT:
            raise SystemExit(f"--kept: {kept!r} is none of {', '.join(KEPT)}")
    for gate in a.gate.split(","):
        if gate not in ("mlp", "linear"):
            raise SystemExit(f"--gate: {gate!r} is neither mlp nor linear")
    for sets in a.kv_sets.split(","):
        if sets not in ("compact", "views"):
            raise SystemExit(f"--kv-sets: {sets!r} is neither compact nor views")
    dev, dt = "cuda", torch.bfloat16
    rows = []
    for G in [int(g) for g in a.groups.split(",")]:
        hq = G * HKV
        hidden = hq * D
        for T in [int(t) for t in a.lens.split(",")]:
            torch.manual_seed(0)
            x = torch.randn(T, hidden, device=dev, dtype=dt, requires_grad=True)
            dense = None
            for phi in a.phi.split(","):
                for kept, gate, sets in [(k, g, s) for k in a.kept.split(",") for g in a.gate.split(",")
                                         for s in a.kv_sets.split(",")]:
                    nsa.modules._COMPACT_KV_SETS = sets == "compact"
                    layer = nsa.NativeSparseAttention(hidden, hq, HKV, head_dim=D, phi=phi,
                                                       gate_hidden=0 if gate == "linear" else hidden // 4,
                                                       device=dev, dtype=dt, **KEPT[kept])
                    if dense is None:
                        twin = DenseTwin(layer)
                        dense = measure(twin, x, a.reps or auto_reps(T))
                        del twin
                    ours = measure(layer, x, a.reps or auto_reps(T))
                    del layer
                    torch.cuda.empty_cache()
                    row = {"G": G, "T": T, "phi": phi, "kept": kept, "gate": gate, "kv_sets": sets,
                           "nsa_fwd_ms": ours[0],
                           "dense_fwd_ms": dense[0],
                           "nsa_fwdbwd_ms": ours[1], "dense_fwdbwd_ms": dense[1], "nsa_peak_gib": ours[2],
                           "dense_peak_gib": dense[2]}
                    rows.append(row)
                    print(f"G {G} T {T} phi {phi} kept {kept} gate {gate} kv_sets {sets}: "
                          f"fwd {ours[0]:.2f} ms (dense {dense[0]:.2f}, "
                          f"{dense[0] / ours[0]:.2f}x), fwd+bwd {ours[1]:.2f} ms (dense {dense[1]:.2f}, "
                          f"{dense[1] / ours[1]:.2f}x), peak {ours[2]:.2f} GiB (dense {dense[2]:.2f})", flush=True)
            del x
            torch.cuda.empty_cache()
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(f"Layer vs dense twin, {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, Hkv {HKV}, "
                    f"D {D}, hidden Hq*D\n\n")
            f.write("| G | T | phi | kept | gate | K/V sets | NSA fwd ms | dense fwd ms | ratio | NSA fwd+bwd ms | "
                    "dense fwd+bwd ms | ratio | NSA peak GiB | dense peak GiB |\n|" + " --- |" * 14 + "\n")
            for r in rows:
                f.write(f"| {r['G']} | {r['T']} | {r['phi']} | {r['kept']} | {r['gate']} | {r['kv_sets']} | "
                        f"{r['nsa_fwd_ms']:.2f} | {r['dense_fwd_ms']:.2f} | "
                        f"{r['dense_fwd_ms'] / r['nsa_fwd_ms']:.2f}x | {r['nsa_fwdbwd_ms']:.2f} | "
                        f"{r['dense_fwdbwd_ms']:.2f} | {r['dense_fwdbwd_ms'] / r['nsa_fwdbwd_ms']:.2f}x | "
                        f"{r['nsa_peak_gib']:.2f} | {r['dense_peak_gib']:.2f} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
