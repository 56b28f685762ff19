"""scripts/gtest_sharded.sh (the GPU tests' runner, and break_tests.sh's) on a made-up GoogleTest
binary: its summary line counts each failed test once, a parameterised one too (GoogleTest names a
failed test twice: its result line, then the failure list at the end), and its exit status is a
failing shard's."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gtest_sharded.sh"

# Shard 0: a parameterised test fails, a plain one passes; shard 1: a plain test fails, one passes.
FAKE = r'''#!/usr/bin/env bash
if [[ "$GTEST_SHARD_INDEX" == 0 ]]; then
cat <<'X'
[==========] Running 2 tests from 2 test suites.
[ RUN      ] Cases/Suite.Param/case_a
[  FAILED  ] Cases/Suite.Param/case_a, where GetParam() = case_a (301 ms)
[ RUN      ] Plain.Passes
[       OK ] Plain.Passes (1 ms)
[==========] 2 tests from 2 test suites ran. (302 ms total)
[  PASSED  ] 1 test.
[  FAILED  ] 1 test, listed below:
[  FAILED  ] Cases/Suite.Param/case_a, where GetParam() = case_a

 1 FAILED TEST
X
exit 1
fi
cat <<'X'
[==========] Running 2 tests from 1 test suite.
[ RUN      ] Plain.Fails
[  FAILED  ] Plain.Fails (5 ms)
[ RUN      ] Plain.AlsoPasses
[       OK ] Plain.AlsoPasses (0 ms)
[==========] 2 tests from 1 test suite ran. (5 ms total)
[  PASSED  ] 1 test.
[  FAILED  ] 1 test, listed below:
[  FAILED  ] Plain.Fails

 1 FAILED TEST
X
exit 1
'''

PASSING = r'''#!/usr/bin/env bash
cat <<'X'
[==========] Running 1 test from 1 test suite.
[ RUN      ] Plain.Passes
[       OK ] Plain.Passes (1 ms)
[==========] 1 test from 1 test suite ran. (1 ms total)
[  PASSED  ] 1 test.
X
'''


def run(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    fake = tmp_path / "fake_tests"
    fake.write_text(body)
    fake.chmod(0o755)
    env = dict(os.environ, NSA_TEST_SHARDS="2")
    return subprocess.run(["bash", str(SCRIPT), str(fake)], capture_output=True, text=True, env=env)


def test_each_failed_test_counts_once(tmp_path: Path) -> None:
    r = run(tmp_path, FAKE)
    last = r.stdout.strip().splitlines()[-1]
    assert last == "[==========] sharded: 4 tests ran in 2 shards (2 passed, 2 failed)", r.stdout
    assert r.returncode == 1
    assert "---- shard 0 of 2" in r.stdout and "---- shard 1 of 2" in r.stdout


def test_passing_shards_exit_zero(tmp_path: Path) -> None:
    r = run(tmp_path, PASSING)
    assert r.stdout.strip().splitlines()[-1] == "[==========] sharded: 2 tests ran in 2 shards (2 passed, 0 failed)"
    assert r.returncode == 0
