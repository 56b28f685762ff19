"""scripts/profile_gpu.sh's reading of Nsight Compute's output, with a stand-in ncu that prints a
log in ncu's format (lines taken from a real run) and a stand-in nsa program: every kernel named,
those in a file's anonymous namespace ("<unnamed>::name") too; the suite's input fills listed but
left out of the total."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def kernel(name: str, value: str, unit: str = "us") -> str:
    return f"""  {name} (1024, 1, 1)x(256, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Warning: Data collection happened without fixed GPU frequencies. Profiling results may be inconsistent.
    Section: Command line profiler metrics
    ---------------------- ----------- ------------
    Metric Name            Metric Unit Metric Value
    ---------------------- ----------- ------------
    gpu__time_duration.sum          {unit}       {value}
    ---------------------- ----------- ------------

"""


LOG = ("==PROF== Connected to process 2308\n"
       "device: NVIDIA H100 80GB HBM3, 132 SMs\n"
       "[2308] nsa@127.0.0.1\n"
       + kernel("<unnamed>::fill_uniform(__nv_bfloat16 *, long, unsigned int, float, float)", "553.92")
       + kernel("<unnamed>::fill_uniform(__nv_bfloat16 *, long, unsigned int, float, float)", "37.40")
       + kernel("void nsa::cuda::win_attention_wgmma_kernel<__nv_bfloat16, 128, 128>(nsa::cuda::BranchParams, "
                "CUtensorMap_st, CUtensorMap_st, int, int)", "4.19", "ms")
       + kernel("nsa::<unnamed>::select_topn_kernel(nsa::cuda::TopnParams)", "586.11")
       + kernel("void nsa::cuda::win_attention_wgmma_kernel<__nv_bfloat16, 128, 128>(nsa::cuda::BranchParams, "
                "CUtensorMap_st, CUtensorMap_st, int, int)", "1.01", "ms"))


def run(tmp_path: Path) -> tuple[subprocess.CompletedProcess, Path]:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (tmp_path / "ncu.log").write_text(LOG)
    ncu = bindir / "ncu"
    ncu.write_text(f'#!/usr/bin/env bash\ncat "{tmp_path / "ncu.log"}"\n')
    build = tmp_path / "build"
    (build / "bin").mkdir(parents=True)
    nsa = build / "bin" / "nsa"
    nsa.write_text('#!/usr/bin/env bash\n[[ "$1" == --help ]] && echo "nsa bench --suite NAME"\nexit 0\n')
    for f in (ncu, nsa):
        f.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), BUILD_DIR=str(build), PATH=f"{bindir}:{os.environ['PATH']}")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "profile_gpu.sh")], capture_output=True, text=True, env=env,
                       timeout=60)
    return r, out


def test_every_kernel_named_and_the_fills_left_out_of_the_total(tmp_path):
    if shutil.which("awk") is None:
        import pytest
        pytest.skip("no awk")
    r, out = run(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    times = (out / "kernel_times.txt").read_text().splitlines()
    assert [line.split("ms  ", 1)[1] for line in times] == [
        "<unnamed>::fill_uniform", "<unnamed>::fill_uniform", "nsa::cuda::win_attention_wgmma_kernel<__nv_bfloat16, 128, 128>",
        "nsa::<unnamed>::select_topn_kernel", "nsa::cuda::win_attention_wgmma_kernel<__nv_bfloat16, 128, 128>"]
    assert [float(line.split()[0]) for line in times] == [0.554, 0.037, 4.19, 0.586, 1.01]
    by_name = (out / "kernel_by_name.txt").read_text().splitlines()
    assert by_name[0].split() == ["5.200", "ms", "2", "x", "nsa::cuda::win_attention_wgmma_kernel<__nv_bfloat16,", "128,",
                                  "128>"]
    assert any(line.endswith("2 x  <unnamed>::fill_uniform") and line.split()[0] == "0.591" for line in by_name)
    total = (out / "kernel_total.txt").read_text().splitlines()
    assert total[0].split() == ["5.786", "ms", "total"]  # 4.19 + 0.586 + 1.01, without the fills
    assert total[1].split()[:2] == ["0.591", "ms"] and "input fills" in total[1]
