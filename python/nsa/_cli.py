"""The ``nsa`` console script: runs the C++ command-line program shipped in the package.

``pip install .`` builds the program (tools/nsa) with the extension and installs it as
``nsa/bin/nsa`` inside the package; pyproject.toml's ``project.scripts`` makes ``nsa`` (and
``python -m nsa``) start it with the same arguments, so ``nsa bench``, ``nsa --version`` and
``nsa --help`` behave as the CMake build's ``build/<preset>/bin/nsa``; where torch is importable,
``nsa bench`` on the CPU also times PyTorch's CPU attention on the same shapes (_torch_bench.py;
``--no-torch`` leaves it out; ``nsa bench --suite ...`` runs the program alone).
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path


def executable() -> Path:
    """Where the package keeps the nsa program."""
    return Path(__file__).resolve().parent / "bin" / "nsa"


def main() -> None:
    exe = executable()
    if not os.access(exe, os.X_OK):
        sys.exit(f"nsa: this install of the Python package has no nsa program ({exe} is missing); "
                 "pip install . builds it (NSA_BUILD_TOOLS=ON in pyproject.toml)")
    args = sys.argv[1:]
    # `nsa bench` with torch importable: the program, then torch's CPU attention on the same shapes
    # (_torch_bench.py; --no-torch: the program alone). Help and the CUDA suites (--suite: their
    # CSV has its own SDPA baselines, bench/sdpa_*baseline.py) go to the program.
    if (args[:1] == ["bench"] and "--no-torch" not in args and not {"-h", "--help", "--suite"} & set(args)
            and importlib.util.find_spec("torch") is not None):
        from ._torch_bench import main as bench_with_torch

        sys.exit(bench_with_torch(str(exe), args[1:]))
    args = [a for a in args if a != "--no-torch"] if args[:1] == ["bench"] else args
    # exec, not a child process: the program's exit status, signals and terminal are the user's.
    os.execv(exe, [str(exe), *args])


if __name__ == "__main__":
    main()
