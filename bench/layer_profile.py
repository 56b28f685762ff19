#!/usr/bin/env python3
"""Where the training layer's time goes: one forward+backward of nsa.NativeSparseAttention and of
its dense twin (layer_bench.py's) under torch.profiler, the GPU kernels summed by name, largest
first, with each one's share of the step.

    python3 bench/layer_profile.py [--G 16] [--T 65536] [--phi mlp] [--top 25] [--markdown OUT.md]
"""
import argparse
import sys

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import nsa
from layer_bench import D, HKV, DenseTwin  # the script's folder is on sys.path


def kernel_table(module, x, top):
    """(total GPU ms of one step, [(kernel name, calls, ms)] largest first) of forward+backward."""
    def step():
        x.grad = None
        module.zero_grad(set_to_none=True)
        module(x).float().sum().backward()

    step()  # warm-up: workspaces, autotuning, lazy module state
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        name = e.name if len(e.name) <= 90 else e.name[:87] + "..."
        calls, us = kernels.get(name, (0, 0.0))
        kernels[name] = (calls + 1, us + e.device_time_total)
    rows = sorted(((n, c, us / 1000) for n, (c, us) in kernels.items()), key=lambda r: -r[2])
    return sum(r[2] for r in rows), rows[:top]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--G", type=int, default=16)
    ap.add_argument("--T", type=int, default=65536)
    ap.add_argument("--phi", default="mlp")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--markdown")
    a = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    hq = a.G * HKV
    hidden = hq * D
    torch.manual_seed(0)
    x = torch.randn(a.T, hidden, device=dev, dtype=dt, requires_grad=True)
    layer = nsa.NativeSparseAttention(hidden, hq, HKV, head_dim=D, phi=a.phi, device=dev, dtype=dt)
    out = [f"GPU kernels of one forward+backward, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
           f"bf16, G {a.G} (Hq {hq}, Hkv {HKV}), D {D}, T {a.T}, phi {a.phi}\n"]
    for title, module in (("NSA layer", layer), ("dense twin", DenseTwin(layer))):
        total, rows = kernel_table(module, x, a.top)
        out.append(f"\n{title}: {total:.2f} ms of GPU kernels\n\n| kernel | calls | ms | share |\n| --- | --- | --- | --- |\n")
        out += [f"| `{n}` | {c} | {ms:.2f} | {100 * ms / total:.1f}% |\n" for n, c, ms in rows]
    text = "".join(out)
    print(text, flush=True)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
