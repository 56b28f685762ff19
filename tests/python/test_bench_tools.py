"""The benchmark tools that turn a GPU call's logs into the committed tables: bench/public_nsa_prefill.py
(this library's backward-suite CSV, dense SDPA's markdown and the public NSA's bench.py logs ->
the same-run table and the plot CSV) and bench/plot_speed.py (that CSV -> the README's plot). They
run on the logs alone, so they are tested here on small made-up logs in the formats they read."""
from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PREFILL = ROOT / "bench" / "public_nsa_prefill.py"

OURS = """T,hq,hkv,dqk,dv,variant,fwd_ms,bwd_ms,fwd_bwd_ms,bwd_tflops,ws_mb,qkvo_mb,peak_mb
8192,64,4,128,128,full,3.0000,7.0000,10.0000,150,27,319,939
8192,64,4,128,128,saved_o_cmp_win,2.0000,6.0000,8.0000,160,27,319,939
8192,64,4,128,128,saved_o_cmp_win,4.0000,8.0000,12.0000,160,27,319,939
65536,64,4,128,128,saved_o_cmp_win,40.0000,80.0000,120.0000,230,268,2550,9521
8192,16,4,128,128,saved_o_cmp_win,1.5000,2.5000,4.0000,110,12,80,325
8192,64,4,192,128,saved_o_cmp_win,9.0000,9.0000,18.0000,110,12,80,325
"""
# sdpa_backward_baseline.py's main table (only dense fwd / fwd+bwd are read).
DENSE = """| Hq/Hkv | Dqk/Dv | T | NSA fwd ms | NSA bwd ms | NSA fwd+bwd ms | NSA bwd TFLOP/s | dense fwd ms | dense fwd+bwd ms | fwd+bwd speedup | x | y | z |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
| 64/4 | 128/128 | 8K | 3.00 | 7.00 | 10.00 | 150 | 1.50 | 5.00 | 0.50x | 27 (8.4%) | 939 | 1111 |
| 64/4 | 128/128 | 64K | 40.00 | 80.00 | 120.00 | 230 | 100.00 | 480.00 | 4.00x | 27 (8.4%) | 939 | 1111 |
| 16/4 | 128/128 | 8K | 1.50 | 2.50 | 4.00 | 110 | 0.50 | 2.00 | 0.50x | 12 (9.8%) | 325 | 303 |
"""
PUBLIC_G16 = """=== mdy666 flash_nsa results (ms, do_bench median, warmup=25 rep=100) ===
case                              8192      65536
nsa_core fwd                     2.500     44.000
nsa_core fwd+bwd                 9.000    132.000
nsa_core bwd (README style)      6.500     88.000
swa alone fwd                    0.504      4.413
"""


def _run(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    (tmp_path / "ours.csv").write_text(OURS)
    (tmp_path / "dense.md").write_text(DENSE)
    (tmp_path / "g16.txt").write_text(PUBLIC_G16)
    return subprocess.run([sys.executable, str(PREFILL), "--ours", str(tmp_path / "ours.csv"), "--dense",
                           str(tmp_path / "dense.md"), "--public", f"16={tmp_path / 'g16.txt'}", *extra],
                          capture_output=True, text=True)


def test_prefill_table_merges_the_three_and_averages_repeated_runs(tmp_path):
    r = _run(tmp_path, "--csv", str(tmp_path / "out.csv"), "--markdown", str(tmp_path / "out.md"))
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(open(tmp_path / "out.csv")))
    # G16 8K and 64K only: G4 has no public log, Dqk 192 and the `full` rows are not the variant.
    assert [(r["T"], r["hq"]) for r in rows] == [("8192", "64"), ("65536", "64")]
    first = rows[0]
    assert first["nsa_fwd_ms"] == "3.00" and first["nsa_fwd_bwd_ms"] == "10.00"  # the two runs' means
    assert (first["public_fwd_ms"], first["public_fwd_bwd_ms"]) == ("2.50", "9.00")
    assert (first["dense_fwd_ms"], first["dense_fwd_bwd_ms"]) == ("1.50", "5.00")
    table = (tmp_path / "out.md").read_text()
    # 8K: public / NSA fwd 2.5 / 3 = 0.83x, fwd+bwd 9 / 10 = 0.90x, dense / NSA 5 / 10 = 0.50x; both runs shown.
    assert "| 16 | 8K | 3.00 | 2.50 | 1.50 | 0.83x | 6.00 / 8.00 | 6.50 | 8.00 / 12.00 | 9.00 | 5.00 | 0.90x | 0.50x |" in table
    assert "| 16 | 64K | 40.00 | 44.00 | 100.00 | 1.10x | 80.00 | 88.00 | 120.00 | 132.00 | 480.00 | 1.10x | 4.00x |" in table
    assert "left out (not measured by all three): G 4 Hkv 4 T 8192: public" in r.stderr


def test_prefill_csv_draws_the_speed_plot(tmp_path):
    pytest.importorskip("matplotlib")
    assert _run(tmp_path, "--csv", str(tmp_path / "out.csv")).returncode == 0
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "plot_speed.py"), "--csv", str(tmp_path / "out.csv"),
                        "--out", str(tmp_path / "speed.png")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "speed.png").stat().st_size > 0


@pytest.mark.parametrize("extra, message", [
    (("--public", "x=log"), "is not G=LOG"),
    (("--variant", "nope"), "no rows of variant 'nope'"),
])
def test_prefill_bad_arguments_are_named(tmp_path, extra, message):
    r = _run(tmp_path, *extra)
    assert r.returncode != 0 and message in r.stderr


def test_prefill_without_any_complete_shape_says_which_are_missing(tmp_path):
    (tmp_path / "empty.md").write_text("no table\n")
    (tmp_path / "ours.csv").write_text(OURS)
    (tmp_path / "g16.txt").write_text(PUBLIC_G16)
    r = subprocess.run([sys.executable, str(PREFILL), "--ours", str(tmp_path / "ours.csv"), "--dense",
                        str(tmp_path / "empty.md"), "--public", f"16={tmp_path / 'g16.txt'}"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "no shape has this library, the public NSA and dense" in r.stderr
    assert "G 16 Hkv 4 T 8192: dense;" in r.stderr and "G 4 Hkv 4 T 8192: public and dense" in r.stderr
