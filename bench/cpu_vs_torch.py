#!/usr/bin/env python3
"""NSA on the CPU backend against PyTorch's CPU scaled_dot_product_attention, in the same run, from
a build tree: the package's `nsa bench` torch baseline (python/nsa/_torch_bench.py, which the
installed `nsa bench` uses) run on a given program.

  python bench/cpu_vs_torch.py --nsa build/cpu/bin/nsa --seqlens 4096,16384 --threads 2 --warmup 1 --repeats 1

Defaults (the shape of docs/benchmarks/cpu.md): --seqlens 4096,16384 --threads 2 --hq 16 --hkv 1
--dqk 128 --dv 128 --repeats 3 --check-tokens 128 --no-dense; --d D sets both head dims; every
other `nsa bench` option passes through. The program: --nsa, else $NSA_BIN, else build/cpu/bin/nsa.
"""
import importlib.util
import os
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "_torch_bench", Path(__file__).resolve().parents[1] / "python" / "nsa" / "_torch_bench.py")
_torch_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_torch_bench)

DEFAULTS = {"--seqlens": "4096,16384", "--threads": "2", "--hq": "16", "--hkv": "1", "--dqk": "128",
            "--dv": "128", "--repeats": "3", "--check-tokens": "128"}


def main() -> int:
    argv = sys.argv[1:]
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    program = os.environ.get("NSA_BIN", "build/cpu/bin/nsa")
    if "--nsa" in argv:
        i = argv.index("--nsa")
        program = argv[i + 1]
        del argv[i:i + 2]
    if "--d" in argv:
        i = argv.index("--d")
        d = argv[i + 1]
        argv[i:i + 2] = ["--dqk", d, "--dv", d]
    for name, value in DEFAULTS.items():
        if name not in argv:
            argv += [name, value]
    if "--no-dense" not in argv:
        argv.append("--no-dense")
    return _torch_bench.main(program, argv)


if __name__ == "__main__":
    sys.exit(main())
