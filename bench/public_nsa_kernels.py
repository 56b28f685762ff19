#!/usr/bin/env python3
"""The fastest public NSA's forward+backward by kernel (flash_nsa.NSACore, Triton; laid out by
../shared/anchors/mdy_nsa/setup.sh): torch.profiler over a few steps, each kernel's time per step,
largest first, for a side-by-side look at where its time goes against this library's kernels
(scripts/profile_gpu.sh). The paper's configuration, phi = mean, one sequence, random data.

    PYTHONPATH=.anchors/mdy_nsa/src python3 bench/public_nsa_kernels.py --groups 16,4 --lens 8192,65536
"""
import argparse
import collections

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", default="16,4", help="G = Hq / Hkv at Hkv 4")
    ap.add_argument("--lens", default="8192,65536")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    from flash_nsa import NSAConfig, NSACore  # noqa: E402 (the anchor's package)

    hkv, d = 4, 128
    for group in (int(x) for x in args.groups.split(",")):
        hq = hkv * group
        for t in (int(x) for x in args.lens.split(",")):
            cfg = NSAConfig(head_dim=d, num_heads=hq, num_kv_heads=hkv, kernel_size=32, stride=16, cmp_k_method="mean",
                            cmp_v_method="mean", block_size=64, top_n=16, num_init_blocks=1, num_local_blocks=2,
                            window_size=512, recompute_swa_o=False, recompute_slc_o=False, recompute_cmp_kv=False,
                            recompute_cmp_o=False)
            nsa = NSACore(cfg, process_group=None, pp_size=1)
            torch.manual_seed(0)
            cu = torch.tensor([0, t], device="cuda", dtype=torch.int32)

            def rand(h):
                return torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16).requires_grad_(True)

            q, k, v = rand(hq), rand(hkv), rand(hkv)
            w = torch.randn(t, hq, 3, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
            do = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)

            def step():
                return torch.autograd.grad(nsa(q, k, v, w, cu), (q, k, v, w), do)

            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    step()
                torch.cuda.synchronize()
            total = collections.defaultdict(float)
            count = collections.Counter()
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    total[e.name] += e.device_time_total / 1000.0
                    count[e.name] += 1
            print(f"=== public fwd+bwd Hq {hq} Hkv {hkv} T {t}: kernels per step (ms) ===")
            whole = 0.0
            for name, ms in sorted(total.items(), key=lambda x: -x[1]):
                whole += ms / args.steps
                print(f"{ms / args.steps:9.3f}  {count[name] // args.steps:3d}x  {name[:110]}")
            print(f"{whole:9.3f}  total")
            del q, k, v, w, do
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
