"""scripts/ab_rounds.sh on made-up snapshots, with stand-ins for scripts/profile_gpu.sh and the
snapshots' nsa programs: every round of every snapshot is run in alternation with the variant and
flags asked for, and the summary lists, per snapshot, each matching kernel's and each shape's
values in round order with their median; a snapshot without a build is refused."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# profile_gpu.sh's stand-in: kernel times that depend on the snapshot (its BUILD_DIR) and on a
# counter shared by every call, so that alternation and round order show in the values.
PROFILE = r'''#!/usr/bin/env bash
mkdir -p "$OUT"
n=$(( $(cat "$COUNTER" 2>/dev/null || echo 0) + 1 )); echo $n > "$COUNTER"
echo "$BUILD_DIR $BENCH_FLAGS" >> "$CALLS"
base=10; [[ "$BUILD_DIR" == *ab-build-b ]] && base=20
printf '  %d.000 ms    1 x  nsa::cmp_pass1_wide_kernel<bf16>\n     0.500 ms    1 x  other_kernel\n' $((base + n)) > "$OUT/kernel_by_name.txt"
printf '  %d.000 ms  total\n' $((base + n + 1)) > "$OUT/kernel_total.txt"
'''

# nsa's stand-in: the suite's CSV, the forward time depending on the snapshot and the round.
NSA = r'''#!/usr/bin/env bash
echo "$0 $*" >> "$CALLS"
out=""; while [[ $# -gt 0 ]]; do [[ "$1" == --out ]] && out="$2"; shift; done
n=$(wc -l < "$CALLS")
echo "T,hq,hkv,dqk,dv,variant,fwd_ms,bwd_ms,fwd_bwd_ms" > "$out"
echo "65536,64,4,128,128,v,$((FWD + n)).5,1,$((FWD + n + 100)).25" >> "$out"
'''


def run_rounds(tmp_path: Path, names: list[str], built: list[str], **env: str) -> tuple[str, str, str]:
    root = tmp_path / "root"
    shutil.copytree(ROOT / "scripts", root / "scripts")
    (root / "scripts" / "profile_gpu.sh").write_text(PROFILE)
    builds = tmp_path / "builds"
    for name in built:
        bin_dir = builds / f"ab-build-{name}" / "bin"
        bin_dir.mkdir(parents=True)
        (bin_dir / "nsa").write_text(NSA.replace("$((FWD", "$((" + ("30" if name == "a" else "40")))
        (bin_dir / "nsa").chmod(0o755)
    out, calls = tmp_path / "out", tmp_path / "calls.txt"
    r = subprocess.run(["bash", str(root / "scripts" / "ab_rounds.sh"), *names], capture_output=True, text=True,
                       env=dict(os.environ, OUT=str(out), AB_BUILDS=str(builds), CALLS=str(calls),
                                COUNTER=str(tmp_path / "counter"), **env))
    summary = (out / "rounds" / "summary.txt").read_text() if (out / "rounds" / "summary.txt").exists() else ""
    return summary, calls.read_text() if calls.exists() else "", f"rc={r.returncode} {r.stderr}"


def test_rounds_alternate_and_summarise(tmp_path: Path) -> None:
    summary, calls, rc = run_rounds(tmp_path, ["a", "b"], ["a", "b"], ROUNDS="2", KERNELS="cmp_pass1",
                                    VARIANT="fast_variant")
    assert rc.startswith("rc=0"), rc
    lines = calls.splitlines()
    # profile, bench for a; then for b; per round: four calls a round, snapshots alternating.
    assert len(lines) == 8, calls
    assert [("ab-build-a" in l, "ab-build-b" in l) for l in lines] == [(True, False)] * 2 + [(False, True)] * 2 + \
        [(True, False)] * 2 + [(False, True)] * 2, calls
    assert "--g16-only --variant fast_variant" in lines[0], calls
    assert "--suite backward --g16-only --lengths 8192,65536 --variant fast_variant" in lines[1], calls
    # Kernel times: profile calls 1 and 3 were a's (10 + n), 2 and 4 b's (20 + n); other_kernel is
    # not asked for.
    a, b = summary.split("== b")
    assert "cmp_pass1_wide_kernel<bf16>" in a and "11.000 / 13.000  (median 12.000)" in a, summary
    assert "(all kernels)" in a and "12.000 / 14.000  (median 13.000)" in a, summary
    assert "22.000 / 24.000  (median 23.000)" in b, summary
    assert "other_kernel" not in summary, summary
    # Event times: a's bench ran as the 2nd and 6th call (30 + n), b's as the 4th and 8th (40 + n).
    assert "event hq 64 T 65536: fwd 32.500 / 36.500  (median 34.500); fwd+bwd 132.250 / 136.250" in a, summary
    assert "fwd 44.500 / 48.500  (median 46.500)" in b, summary


def test_variant_of_a_snapshot_alternates_as_a_snapshot(tmp_path: Path) -> None:
    summary, calls, rc = run_rounds(tmp_path, ["a", "a:other_variant"], ["a"], ROUNDS="2", KERNELS="cmp_pass1",
                                    VARIANT="fast_variant")
    assert rc.startswith("rc=0"), rc
    lines = calls.splitlines()
    assert len(lines) == 8 and all("ab-build-a" in l for l in lines), calls
    # Per round: a with the default variant, then a with its own; profile and bench alike.
    variants = ["fast_variant", "fast_variant", "other_variant", "other_variant"] * 2
    assert [l.rstrip().split("--variant ")[1].split()[0] for l in lines] == variants, calls
    first, second = summary.split("== a-other_variant")
    assert first.startswith("== a\n") and "11.000 / 13.000  (median 12.000)" in first, summary
    assert "12.000 / 14.000  (median 13.000)" in second, summary
    assert "fwd 34.500 / 38.500  (median 36.500)" in second, summary
    assert (tmp_path / "out" / "rounds" / "bench_a-other_variant_2.csv").exists()


def test_unbuilt_snapshot_is_refused(tmp_path: Path) -> None:
    summary, calls, rc = run_rounds(tmp_path, ["a", "missing"], ["a"])
    assert rc.startswith("rc=1") and "no " in rc and "ab-build-missing/bin/nsa" in rc, rc
    assert calls == "" and summary == "", (calls, summary)
