#!/usr/bin/env python3
"""Where the training layer's time goes: one forward+backward of nsa.NativeSparseAttention and of
its dense twin (layer_bench.py's) under torch.profiler: the step's wall time, its GPU kernels in
all and by kind (the library's, matrix products and SDPA, the rest), the GPU's idle time inside
the step with its largest gaps, and the kernels summed by name, largest first.

--alone adds nsa.attention by itself on the layer's shapes (random q, K/V, gates; the layer's phi),
twice: with K/V as six compact tensors, and as column slices of one [T, (Hq + 2 * 3 * Hkv) * D +
gate] product as the layer's fused projection gives them: the library's kernels in the layer
against the same kernels alone.

    python3 bench/layer_profile.py [--G 16] [--T 65536] [--phi mlp] [--kept o_cmp_win] [--alone]
                                   [--top 25] [--markdown OUT.md]
"""
import argparse
import sys

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import nsa
from layer_bench import D, HKV, KEPT, DenseTwin  # the script's folder is on sys.path


def kind(name):
    if "nsa::" in name:
        return "library"
    low = name.lower()
    if any(s in low for s in ("gemm", "nvjet", "xmma", "cutlass", "cublas", "flash", "fmha", "sdpa")):
        return "products and SDPA"
    return "other"


def short(name, n=110):
    return name if len(name) <= n else name[:n - 3] + "..."


def kernel_table(step, top):
    """(wall ms of one step, {kind: ms}, idle ms, [(gap ms, kernel before, kernel after)] largest
    first, [(kernel name, calls, ms)] largest first) of step()."""
    for _ in range(2):  # warm-up: workspaces, autotuning, lazy module state
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    wall = start.elapsed_time(end)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    kernels, kinds = {}, {}
    for e in events:
        us = e.time_range.elapsed_us()
        calls, t = kernels.get(e.name, (0, 0.0))
        kernels[e.name] = (calls + 1, t + us)
        kinds[kind(e.name)] = kinds.get(kind(e.name), 0.0) + us / 1000
    # Idle: the step's span on the GPU (one stream) less the time some kernel ran.
    gaps, reach, prev = [], None, None
    for e in events:
        if reach is not None and e.time_range.start > reach:
            gaps.append(((e.time_range.start - reach) / 1000, short(prev.name, 60), short(e.name, 60)))
        if reach is None or e.time_range.end > reach:
            reach, prev = e.time_range.end, e
    rows = sorted(((short(n), c, us / 1000) for n, (c, us) in kernels.items()), key=lambda r: -r[2])
    return wall, kinds, sum(g[0] for g in gaps), sorted(gaps, key=lambda g: -g[0])[:5], rows[:top]


def report(title, result):
    wall, kinds, idle, gaps, rows = result
    total = sum(kinds.values())
    by_kind = ", ".join(f"{k} {ms:.2f}" for k, ms in sorted(kinds.items(), key=lambda kv: -kv[1]))
    out = [f"\n{title}: step {wall:.2f} ms; GPU kernels {total:.2f} ms ({by_kind}); idle inside the profiled "
           f"step {idle:.2f} ms" + ("; largest gaps: " + "; ".join(f"{g:.2f} ms after `{a}` before `{b}`"
                                                                  for g, a, b in gaps if g >= 0.05) if gaps else "")
           + "\n\n| kernel | calls | ms | share |\n| --- | --- | --- | --- |\n"]
    out += [f"| `{n}` | {c} | {ms:.2f} | {100 * ms / total:.1f}% |\n" for n, c, ms in rows]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--G", type=int, default=16)
    ap.add_argument("--T", type=int, default=65536)
    ap.add_argument("--phi", default="mlp")
    ap.add_argument("--kept", default="o_cmp_win", choices=list(KEPT),
                    help="what the layer keeps for the backward besides o (bench/layer_bench.py's --kept)")
    ap.add_argument("--alone", action="store_true", help="also nsa.attention alone, compact and sliced K/V")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--markdown")
    a = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    hq = a.G * HKV
    hidden = hq * D
    torch.manual_seed(0)
    x = torch.randn(a.T, hidden, device=dev, dtype=dt, requires_grad=True)
    layer = nsa.NativeSparseAttention(hidden, hq, HKV, head_dim=D, phi=a.phi, device=dev, dtype=dt, **KEPT[a.kept])
    out = [f"GPU kernels of one forward+backward, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
           f"bf16, G {a.G} (Hq {hq}, Hkv {HKV}), D {D}, T {a.T}, phi {a.phi}, "
           f"kept for the backward: {a.kept}\n"]
    print(out[0], flush=True)

    def module_step(module):
        def step():
            x.grad = None
            module.zero_grad(set_to_none=True)
            module(x).float().sum().backward()
        return step

    for title, module in (("NSA layer", layer), ("dense twin", DenseTwin(layer))):
        part = report(title, kernel_table(module_step(module), a.top))
        print("".join(part), flush=True)
        out += part
    if a.alone:
        phi_k, phi_v = layer._phi(layer.phi_k, dt), layer._phi(layer.phi_v, dt)
        q = torch.randn(a.T, hq, D, device=dev, dtype=dt, requires_grad=True)
        g = torch.rand(a.T, hq, 3, device=dev, dtype=dt, requires_grad=True)
        compact = [torch.randn(a.T, HKV, D, device=dev, dtype=dt, requires_grad=True) for _ in range(6)]
        width = (hq + 6 * HKV) * D + layer.gate[0].out_features
        y = torch.randn(a.T, width, device=dev, dtype=dt, requires_grad=True)
        parts = y[:, hq * D:hq * D + 6 * HKV * D].view(a.T, 2, 3, HKV, D)  # k sets, then v sets
        sliced = [parts[:, i % 2, i // 2] for i in range(6)]  # k_cmp, v_cmp, k_slc, ...
        for title, kv in (("nsa.attention alone, compact K/V", compact), ("nsa.attention alone, K/V sliced", sliced)):
            def step(kv=kv):
                for t in (q, g, *compact, y):
                    t.grad = None
                o = nsa.attention(q, tuple(kv[0::2]), tuple(kv[1::2]), g, phi_k, phi_v, config=layer.config,
                                  **keep)
                o.float().sum().backward()
            part = report(title, kernel_table(step, a.top))
            print("".join(part), flush=True)
            out += part
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write("".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
