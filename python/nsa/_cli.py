"""The ``nsa`` console script: runs the C++ command-line program shipped in the package.

``pip install .`` builds the program (tools/nsa) with the extension and installs it as
``nsa/bin/nsa`` inside the package; pyproject.toml's ``project.scripts`` makes ``nsa`` (and
``python -m nsa``) start it with the same arguments, so ``nsa bench``, ``nsa --version`` and
``nsa --help`` behave exactly as the CMake build's ``build/<preset>/bin/nsa``.
"""
from __future__ import annotations

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
    # exec, not a child process: the program's exit status, signals and terminal are the user's.
    os.execv(exe, [str(exe), *sys.argv[1:]])


if __name__ == "__main__":
    main()
