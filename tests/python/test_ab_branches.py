"""scripts/ab_branches.sh's profile step on a made-up snapshot, with a stand-in for
scripts/profile_gpu.sh that writes what it was asked: one ncu run by default, or one per variant of
AB_PROFILE_VARIANTS (their bench flags and length passed on, each listed in the summary, a failed
one reported by name)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

STAND_IN = r'''#!/usr/bin/env bash
mkdir -p "$OUT"
[[ "$BENCH_FLAGS" == *broken* ]] && exit 1
echo "    1.000 ms  T=$T flags=$BENCH_FLAGS" > "$OUT/kernel_times.txt"
echo "    2.000 ms    1 x  kernel of $BENCH_FLAGS at $T" > "$OUT/kernel_by_name.txt"
echo "    2.000 ms  total" > "$OUT/kernel_total.txt"
'''


def run_profile_step(tmp_path: Path, **env: str) -> str:
    root = tmp_path / "root"
    shutil.copytree(ROOT / "scripts", root / "scripts")
    (root / "scripts" / "profile_gpu.sh").write_text(STAND_IN)
    (root / ".snap" / "snap").mkdir(parents=True)
    (root / ".snap" / "snap" / ".commit").write_text("abc1234\n")
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(root / "scripts" / "ab_branches.sh"), "run"], capture_output=True, text=True,
                       env=dict(os.environ, OUT=str(out), AB_STEPS="profile", AB_PACK="0", **env))
    return (out / "ab_summary.txt").read_text() + f"\nrc={r.returncode}"


def test_one_profile_by_default(tmp_path: Path) -> None:
    summary = run_profile_step(tmp_path)
    assert "  ncu:     1.000 ms  T=65536 flags=--g16-only" in summary, summary
    assert summary.endswith("rc=0"), summary


def test_one_profile_per_variant(tmp_path: Path) -> None:
    summary = run_profile_step(tmp_path, AB_PROFILE_VARIANTS="fast slow broken", AB_PROFILE_T="8192",
                               AB_PROFILE_FLAGS="--shape 16,4,128,128")
    for v in ("fast", "slow"):
        kernels = f"  ncu {v}:     2.000 ms    1 x  kernel of --shape 16,4,128,128 --variant {v} at 8192"
        assert kernels in summary, summary
        assert f"  ncu {v}:     2.000 ms  total" in summary, summary
    assert "  profile broken FAILED" in summary, summary
    assert summary.endswith("rc=1"), summary
