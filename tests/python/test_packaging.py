"""The Python package as pip builds it: an sdist of the repository (the PEP 517 hook), then
`pip wheel` of that sdist without CUDA. The sdist must hold everything the build needs (a file
left out fails the wheel build), the build must say which backends it compiles, and the wheel
must carry the extension, the nsa program, the entry point, the licence and the project's version.

About a minute on 2 cores (the library is compiled once more); marked `packaging`, so
`pytest -m 'not packaging'` leaves it out. Needs the build backend (scikit-build-core, nanobind)
in this environment: the build runs without isolation, as scripts/test_python.sh's does."""
from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.packaging


def _project_version() -> str:
    return re.search(r"project\(nsa VERSION ([0-9.]+)", (ROOT / "CMakeLists.txt").read_text()).group(1)


def test_sdist_and_wheel(tmp_path):
    pytest.importorskip("scikit_build_core")
    pytest.importorskip("nanobind")
    version = _project_version()

    # The sdist, through the backend's PEP 517 hook (what `python -m build --sdist` calls).
    hook = "import sys; from scikit_build_core.build import build_sdist; print(build_sdist(sys.argv[1]))"
    r = subprocess.run([sys.executable, "-c", hook, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    sdist = tmp_path / r.stdout.strip().splitlines()[-1]
    assert sdist.name == f"nsa-{version}.tar.gz"
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in ("LICENSE", "CMakeLists.txt", "pyproject.toml", "cmake/install.cmake", "include/nsa/nsa.h",
                   "src/api.cpp", "python/src/nsa_ext.cpp", "python/nsa/_cli.py", "tools/nsa/main.cpp"):
        assert needed in names, f"{needed} is not in the sdist"
    assert not any(n.startswith("build/") for n in names), "build folders leaked into the sdist"

    # The wheel from the sdist, CPU only; -v shows CMake's output, as a user of `pip install -v` sees it.
    # This wheel is only inspected, so the files that are not CPU kernels (those keep their own -O3)
    # are compiled without optimisation: half the build time.
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL",
                                                                     str(os.cpu_count() or 2)))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps",
                        "--disable-pip-version-check", "-w", str(tmp_path / "wheels"),
                        "--config-settings=cmake.define.NSA_CUDA=OFF",
                        "--config-settings=cmake.define.CMAKE_CXX_FLAGS_RELEASE=-DNDEBUG", str(sdist)],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    log = r.stdout + r.stderr
    assert f"nsa {version}: building the reference and cpu backends (NSA_CUDA=OFF" in log
    assert re.search(r"\s-c\s+\S*tools/nsa/main\.cpp", log), "no compile commands in pip -v's output"

    wheel, = (tmp_path / "wheels").glob(f"nsa-{version}-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert any(re.fullmatch(r"nsa/_nsa\..*\.so", n) for n in names), names
        assert "nsa/_cli.py" in names and "nsa/__main__.py" in names
        exe = z.getinfo("nsa/bin/nsa")
        assert (exe.external_attr >> 16) & stat.S_IXUSR, "nsa/bin/nsa is not executable in the wheel"
        info = f"nsa-{version}.dist-info"
        metadata = z.read(f"{info}/METADATA").decode()
        assert f"\nVersion: {version}\n" in metadata
        assert "\nLicense-Expression: Apache-2.0\n" in metadata
        assert "Provides-Extra: torch" in metadata
        assert f"{info}/licenses/LICENSE" in names
        assert "nsa = nsa._cli:main" in z.read(f"{info}/entry_points.txt").decode()
        # The program itself runs from the wheel's copy.
        z.extract(exe, tmp_path / "unpacked")
    program = tmp_path / "unpacked" / "nsa" / "bin" / "nsa"
    program.chmod(0o755)
    r = subprocess.run([str(program), "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith(f"nsa {version}\n"), r.stdout + r.stderr
