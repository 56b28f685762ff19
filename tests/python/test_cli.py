"""The nsa command from the Python package: ``python -m nsa`` and, where pip installed the
package, the ``nsa`` console script (pyproject.toml's project.scripts) run the C++ program shipped
as nsa/bin/nsa: --version gives the package's version, -h works before and after ``bench``, and
``nsa bench`` runs the benchmark (checked against the reference)."""
from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import nsa
from nsa import _cli

ROOT = Path(__file__).resolve().parents[2]


def _pip_installed() -> bool:
    try:
        importlib.metadata.distribution("nsa")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _commands():
    """Ways to start the nsa command here: python -m nsa always, the console script when pip
    installed the package (scripts/test_python.sh's default)."""
    cmds = [[sys.executable, "-m", "nsa"]]
    if _pip_installed():
        script = Path(sysconfig.get_path("scripts")) / "nsa"
        assert script.is_file(), f"pip installed nsa but not its console script {script}"
        cmds.append([str(script)])
    return cmds


def _run(cmd, *args, timeout=120):
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout)


def test_the_package_ships_the_program():
    exe = _cli.executable()
    assert exe.is_file() and os.access(exe, os.X_OK), exe


def test_version_is_the_project_version():
    cmake = (ROOT / "CMakeLists.txt").read_text()
    project_version = re.search(r"project\(nsa VERSION ([0-9.]+)", cmake).group(1)
    assert nsa.__version__ == project_version
    if _pip_installed():
        assert importlib.metadata.version("nsa") == project_version
    for cmd in _commands():
        r = _run(cmd, "--version")
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines()[0] == f"nsa {project_version}", r.stdout


@pytest.mark.parametrize("args", [["-h"], ["--help"], ["bench", "-h"], ["bench", "--help"],
                                  ["bench", "--seqlens", "64", "-h"]])
def test_help_everywhere(args):
    for cmd in _commands():
        r = _run(cmd, *args)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("usage: nsa bench"), r.stdout


def test_usage_errors_keep_their_exit_status():
    for cmd in _commands():
        r = _run(cmd, "bench", "--no-such-option")
        assert r.returncode == 2 and "unknown option --no-such-option" in r.stderr, (r.returncode, r.stderr)


def test_suite_usage_errors_name_the_option():
    """``nsa bench --suite``: an unknown suite names the allowed ones; a suite's unknown option is a
    usage error too (on a build without CUDA, the suite itself is: it needs the CUDA backend)."""
    for cmd in _commands():
        r = _run(cmd, "bench", "--suite", "nonesuch")
        assert r.returncode == 2 and '--suite must be forward or backward, got "nonesuch"' in r.stderr, r.stderr
        r = _run(cmd, "bench", "--suite", "forward", "--no-such-option")
        assert r.returncode == 2 and "--suite forward" in r.stderr, (r.returncode, r.stderr)


def test_bench_runs_from_the_python_install():
    args = ["bench", "--seqlens", "96", "--hq", "2", "--dqk", "16", "--dv", "16", "--phi-hidden", "8",
            "--cmp-block-len", "8", "--cmp-stride", "4", "--slc-block-len", "16", "--n-selected", "4",
            "--window", "32", "--check-tokens", "96", "--threads", "1", "--backend", "cpu"]
    for cmd in _commands():
        r = _run(cmd, *args)
        assert r.returncode == 0, r.stdout + r.stderr
        rows = [line.split() for line in r.stdout.splitlines() if line.strip().startswith("96 ")]
        assert [row[2] for row in rows] == ["fwd", "fwd+bwd"], r.stdout


def test_bench_adds_torch_on_the_cpu():
    """With torch importable, ``nsa bench`` on the CPU times torch's SDPA on the same shapes in the
    same run (a table with both and the ratio); ``--no-torch`` leaves it out."""
    pytest.importorskip("torch")
    args = ["bench", "--backend", "cpu", "--seqlens", "96,128", "--hq", "2", "--dqk", "16", "--dv", "16",
            "--phi-hidden", "8", "--cmp-block-len", "8", "--cmp-stride", "4", "--slc-block-len", "16",
            "--n-selected", "4", "--window", "32", "--check-tokens", "0", "--threads", "1", "--no-dense"]
    for cmd in _commands():
        r = _run(cmd, *args)
        assert r.returncode == 0, r.stdout + r.stderr
        table = [line for line in r.stdout.splitlines() if re.match(r"\| (96|128) \| fwd", line)]
        assert len(table) == 4, r.stdout
        assert all(re.search(r"\| [\d.]+ \| [\d.]+ \| [\d.]+x \|$", line) for line in table), table
        assert "torch " in r.stdout and "CPU capability" in r.stdout, r.stdout
        r = _run(cmd, *args, "--no-torch")
        assert r.returncode == 0, r.stdout + r.stderr
        assert "torch SDPA ms" not in r.stdout, r.stdout
