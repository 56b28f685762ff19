"""NSA on the CPU backend against PyTorch's CPU scaled_dot_product_attention, in the same run.

Runs `nsa bench` (the NSA layer: phi, compressed, selected and window branches, gates) for each
length, then times torch's dense causal SDPA on the same shape and dtype with the same number of
threads, and prints one table: CPU model, the nsa kernel table, torch version and its CPU
capability, and per (T, pass) both times and the speedup. Without torch the nsa rows alone.

  python bench/cpu_vs_torch.py --nsa build/cpu/bin/nsa --seqlens 4096,16384 --threads 2

Torch gets its strongest form: K and V repeated to Hq heads beforehand (outside the timing; GQA
inside SDPA is slower on the CPU), inputs [B, H, T, D] contiguous, is_causal=True. Each time is
the median of --repeats runs after --warmup runs (wall clock).
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def run_nsa(args):
    """{(T, pass): ms} and the kernel line from `nsa bench`."""
    cmd = [args.nsa, "bench", "--seqlens", args.seqlens, "--threads", str(args.threads), "--dtype", args.dtype,
           "--hq", str(args.hq), "--hkv", str(args.hkv), "--dqk", str(args.d), "--dv", str(args.d),
           "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--no-dense",
           "--check-tokens", str(args.check_tokens)]
    if args.no_backward:
        cmd.append("--no-backward")
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    kernels, rows = "", {}
    for line in out.splitlines():
        if line.startswith("cpu:"):
            kernels = line
        m = re.match(r"\s*(\d+)\s+cpu\s+(fwd\+bwd|fwd)\s+([\d.]+)", line)
        if m:
            rows[(int(m.group(1)), m.group(2))] = float(m.group(3))
    return kernels, rows, out


def time_ms(fn, warmup, repeats):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_torch(args):
    """{(T, pass): ms} of torch SDPA, and a description; None without torch."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None, "torch not importable: no baseline"
    torch.set_num_threads(args.threads)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[args.dtype]
    desc = f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads"
    rows = {}
    gen = torch.Generator().manual_seed(0)
    for T in [int(t) for t in args.seqlens.split(",")]:
        q = torch.randn(1, args.hq, T, args.d, generator=gen).to(dtype)
        k = torch.randn(1, args.hkv, T, args.d, generator=gen).to(dtype)
        v = torch.randn(1, args.hkv, T, args.d, generator=gen).to(dtype)
        rep = args.hq // args.hkv
        k = k.repeat_interleave(rep, dim=1).contiguous()
        v = v.repeat_interleave(rep, dim=1).contiguous()
        print(f"torch SDPA T = {T}", file=sys.stderr, flush=True)
        with torch.no_grad():
            rows[(T, "fwd")] = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                       args.warmup, args.repeats)
        if not args.no_backward:
            qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
            do = torch.randn(q.shape, generator=gen).to(dtype)

            def fwd_bwd():
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
                o.backward(do)
                qg.grad = kg.grad = vg.grad = None

            rows[(T, "fwd+bwd")] = time_ms(fwd_bwd, args.warmup, args.repeats)
    return rows, desc


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nsa", default=os.environ.get("NSA_BIN", "build/cpu/bin/nsa"), help="the nsa program")
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    ap.add_argument("--hq", type=int, default=16)
    ap.add_argument("--hkv", type=int, default=1)
    ap.add_argument("--d", type=int, default=128, help="head dim of q, k and v")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--check-tokens", type=int, default=128)
    ap.add_argument("--no-backward", action="store_true")
    args = ap.parse_args()

    kernels, nsa_rows, nsa_out = run_nsa(args)
    torch_rows, torch_desc = run_torch(args)
    print(nsa_out)
    print(f"CPU: {cpu_model()}; {args.threads} threads; Hq {args.hq}, Hkv {args.hkv}, D {args.d}, {args.dtype}, causal")
    print(f"nsa {kernels}")
    print(torch_desc)
    print()
    print("| T | pass | torch SDPA ms | nsa cpu ms | nsa vs torch |")
    print("| --- | --- | --- | --- | --- |")
    for (T, p), ms in sorted(nsa_rows.items()):
        t = torch_rows.get((T, p)) if torch_rows else None
        tcol = f"{t:.1f}" if t else "-"
        ratio = f"{t / ms:.2f}x" if t else "-"
        print(f"| {T} | {p} | {tcol} | {ms:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
