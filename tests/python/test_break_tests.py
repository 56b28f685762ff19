"""scripts/break_tests.sh on a made-up project: a GoogleTest-like program built by CMake whose one
header a break patch changes. The round catches the planted bug, the other tests pass, the source
comes back, and the objects built with the bug in are gone: a later build compiles them again even
when the sources come back with modification times older than those objects (the device tool
copies the tree over again before each call)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "break_tests.sh"

# "Target.Catches" fails when BUG is 1; "Other.Passes" always passes. The filter is the first
# argument GoogleTest would get; only its first character matters here ('-': everything else).
MAIN = r'''#include <stdio.h>
#include <string.h>
#include "bug.h"
int main(int argc, char** argv) {
  const char* filter = "*";
  for (int i = 1; i < argc; ++i)
    if (strncmp(argv[i], "--gtest_filter=", 15) == 0) filter = argv[i] + 15;
  const int target = filter[0] != '-';
  printf("[==========] Running 1 test from 1 test suite.\n");
  if (target && BUG) {
    printf("[  FAILED  ] Target.Catches (1 ms)\n[==========] 1 test from 1 test suite ran. (1 ms total)\n");
    printf("[  PASSED  ] 0 tests.\n");
    return 1;
  }
  printf("[       OK ] %s (1 ms)\n", target ? "Target.Catches" : "Other.Passes");
  printf("[==========] 1 test from 1 test suite ran. (1 ms total)\n[  PASSED  ] 1 test.\n");
  return 0;
}
'''
CMAKE = '''cmake_minimum_required(VERSION 3.16)
project(fake_break C)
add_executable(nsa_cuda_tests main.c)
set_target_properties(nsa_cuda_tests PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
'''
PATCH = '''# filter: *Target*
# round: 1
# the planted bug: BUG on
diff --git a/bug.h b/bug.h
--- a/bug.h
+++ b/bug.h
@@ -1 +1 @@
-#define BUG 0
+#define BUG 1
'''


NEEDS_TOOLS = pytest.mark.skipif(any(shutil.which(tool) is None for tool in ("cmake", "cc", "git")),
                                 reason="needs cmake, a C compiler and git")


def made_up_project(tmp_path: Path, other_test_passes: bool = True) -> tuple[Path, Path, dict]:
    src, build = tmp_path / "src", tmp_path / "build"
    (src / "tests" / "cuda" / "breaks").mkdir(parents=True)
    main = MAIN if other_test_passes else MAIN.replace("if (target && BUG)", "if (BUG)")
    (src / "main.c").write_text(main)
    (src / "bug.h").write_text("#define BUG 0\n")
    (src / "CMakeLists.txt").write_text(CMAKE)
    (src / "tests" / "cuda" / "breaks" / "bug_on.patch").write_text(PATCH)
    env = dict(os.environ, NSA_TEST_SHARDS="1", JOBS="1")
    subprocess.run(["cmake", "-S", str(src), "-B", str(build)], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build)], check=True, capture_output=True)
    return src, build, env


@NEEDS_TOOLS
def test_round_catches_and_leaves_no_broken_objects(tmp_path: Path) -> None:
    src, build, env = made_up_project(tmp_path)
    old = (build / "bin" / "nsa_cuda_tests").stat().st_mtime - 100

    r = subprocess.run(["bash", str(SCRIPT), str(build), str(src)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "caught: bug_on.patch: 1 failing test(s) in '*Target*'" in r.stdout, r.stdout
    assert "round 1, the other tests pass" in r.stdout, r.stdout
    assert (src / "bug.h").read_text() == "#define BUG 0\n"  # the source restored
    assert not (build / ".break_tests_start").exists()

    # The tree copied over again: its files older than anything built. The next build must still
    # give the program without the bug.
    for f in (src / "main.c", src / "bug.h", src / "CMakeLists.txt"):
        os.utime(f, (old, old))
    subprocess.run(["cmake", "--build", str(build)], check=True, capture_output=True)
    run = subprocess.run([str(build / "bin" / "nsa_cuda_tests"), "--gtest_filter=*Target*"], capture_output=True,
                         text=True)
    assert run.returncode == 0 and "[       OK ] Target.Catches" in run.stdout, run.stdout


@NEEDS_TOOLS
def test_other_tests_checked_unless_told_not_to(tmp_path: Path) -> None:
    # The planted bug breaks the other test too: the round fails, unless BREAK_OTHERS=0 leaves that
    # check out (each patch's own filter still caught).
    src, build, env = made_up_project(tmp_path, other_test_passes=False)
    r = subprocess.run(["bash", str(SCRIPT), str(build), str(src)], capture_output=True, text=True, env=env)
    assert r.returncode != 0, r.stdout
    assert "round 1, other tests fail too" in r.stdout, r.stdout

    r = subprocess.run(["bash", str(SCRIPT), str(build), str(src)], capture_output=True, text=True,
                       env=dict(env, BREAK_OTHERS="0"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "caught: bug_on.patch: 1 failing test(s) in '*Target*'" in r.stdout, r.stdout
    assert "round 1, the other tests: not run (BREAK_OTHERS=0)" in r.stdout, r.stdout
    assert (src / "bug.h").read_text() == "#define BUG 0\n"
