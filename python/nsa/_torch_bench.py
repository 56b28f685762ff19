"""``nsa bench`` with PyTorch's CPU attention beside it, in the same run.

The ``nsa`` console script (_cli.py) sends ``nsa bench`` here when torch is importable: the C++
program runs with the same arguments and prints its table (NSA, and its own dense attention
unless ``--no-dense``); where the rows are the CPU backend's, PyTorch's
``scaled_dot_product_attention`` (causal, K and V repeated to Hq heads beforehand, outside the
timing: GQA inside SDPA is slower on the CPU) is then timed on the same lengths, head dims, dtype
and thread count, with the program's warm-up and repeat counts (median), and a last table gives
both times and the ratio, with the CPU model, the nsa kernel table and torch's CPU capability.
``--no-torch`` leaves torch out (the program alone, as the CMake build's ``nsa bench``).
"""
from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

_ROW = re.compile(r"\s*(\d+)\s+cpu\s+(fwd\+bwd|fwd)\s+([\d.]+)")


def _option(argv: List[str], name: str, default: str) -> str:
    """The last value given for --name (the program takes the last one too)."""
    value = default
    for i, a in enumerate(argv[:-1]):
        if a == name:
            value = argv[i + 1]
    return value


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _time_ms(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def torch_rows(seqlens: List[int], hq: int, hkv: int, dqk: int, dv: int, dtype: str, threads: int, warmup: int,
               repeats: int, backward: bool) -> Tuple[Dict[Tuple[int, str], float], str]:
    """{(T, pass): ms} of torch's causal SDPA on one sequence, and a line describing torch."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads if threads > 0 else (os.cpu_count() or 1))
    dt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[dtype]
    desc = (f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
            f"{torch.get_num_threads()} threads")
    rows: Dict[Tuple[int, str], float] = {}
    gen = torch.Generator().manual_seed(0)
    for T in seqlens:
        q = torch.randn(1, hq, T, dqk, generator=gen).to(dt)
        k = torch.randn(1, hkv, T, dqk, generator=gen).to(dt).repeat_interleave(hq // hkv, dim=1).contiguous()
        v = torch.randn(1, hkv, T, dv, generator=gen).to(dt).repeat_interleave(hq // hkv, dim=1).contiguous()
        with torch.no_grad():
            rows[(T, "fwd")] = _time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), warmup,
                                        repeats)
        if backward:
            qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
            do = torch.randn(1, hq, T, dv, generator=gen).to(dt)

            def fwd_bwd():
                F.scaled_dot_product_attention(qg, kg, vg, is_causal=True).backward(do)
                qg.grad = kg.grad = vg.grad = None

            rows[(T, "fwd+bwd")] = _time_ms(fwd_bwd, warmup, repeats)
    return rows, desc


def main(program: str, argv: List[str]) -> int:
    """``nsa bench ARGV`` through `program`, then the torch baseline where the rows are the CPU's."""
    argv = [a for a in argv if a != "--no-torch"]
    run = subprocess.run([program, "bench", *argv], stdout=subprocess.PIPE, text=True)
    sys.stdout.write(run.stdout)
    sys.stdout.flush()
    if run.returncode != 0:
        return run.returncode
    nsa_rows: Dict[Tuple[int, str], float] = {}
    kernels: Optional[str] = None
    for line in run.stdout.splitlines():
        if line.startswith("cpu:"):
            kernels = line
        m = _ROW.match(line)
        if m:
            nsa_rows[(int(m.group(1)), m.group(2))] = float(m.group(3))
    if not nsa_rows:  # another backend's rows: no CPU baseline to add
        return 0
    hq = int(_option(argv, "--hq", "16"))
    hkv = int(_option(argv, "--hkv", "1"))
    dqk = int(_option(argv, "--dqk", "128"))
    dv = int(_option(argv, "--dv", "128"))
    dtype = _option(argv, "--dtype", "bf16")
    threads = int(_option(argv, "--threads", "0"))
    warmup = int(_option(argv, "--warmup", "1"))
    repeats = int(_option(argv, "--repeats", "1"))
    seqlens = sorted({T for T, _ in nsa_rows})
    print(f"torch SDPA on the same shapes ({len(seqlens)} lengths) ...", file=sys.stderr, flush=True)
    rows, desc = torch_rows(seqlens, hq, hkv, dqk, dv, dtype, threads, warmup, repeats,
                            backward=any(p == "fwd+bwd" for _, p in nsa_rows))
    print()
    print(f"CPU: {cpu_model()}; Hq {hq}, Hkv {hkv}, Dqk {dqk}, Dv {dv}, {dtype}, causal")
    if kernels:
        print(f"nsa {kernels}")
    print(desc)
    print()
    print("| T | pass | torch SDPA ms | nsa cpu ms | nsa vs torch |")
    print("| --- | --- | --- | --- | --- |")
    for (T, p), ms in sorted(nsa_rows.items()):
        t = rows.get((T, p))
        print(f"| {T} | {p} | {t:.1f} | {ms:.1f} | {t / ms:.2f}x |" if t else f"| {T} | {p} | - | {ms:.1f} | - |")
    return 0
