"""tools/check_wgmma_a_regs.py (gpu_check.sh's sass_check step) on made-up SASS: an HGMMA's A
registers overwritten inside a loop after it (check 1), or while its group may still be running,
before the WARPGROUP.DEPBAR that retires it (check 2); and the same code with the write where it is
safe."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "check_wgmma_a_regs.py"


def sass(*bodies: tuple[str, list[str]]) -> str:
    """cuobjdump -sass's layout: a header per function, one instruction a line at 16-byte steps."""
    out = ["", "Fatbin elf code:", "================", "arch = sm_90a", "", "\tcode for sm_90a"]
    for name, lines in bodies:
        out.append("\t\tFunction : " + name)
        out += ["        /*%04x*/                   %s ;" % (16 * i, line) for i, line in enumerate(lines)]
        out.append("\t\t..........")
    return "\n".join(out) + "\n"


def run(tmp_path: Path, text: str, *args: str) -> subprocess.CompletedProcess:
    f = tmp_path / "k.sass"
    f.write_text(text)
    return subprocess.run([sys.executable, str(TOOL), *args, str(f)], capture_output=True, text=True)


def expect_verdict(tmp_path: Path, lines: list[str], clobbered: bool, why: str) -> None:
    """One function `k` of `lines`: the exit status, its line and (clobbered) the reason named."""
    r = run(tmp_path, sass(("k", lines)))
    assert r.returncode == (1 if clobbered else 0), r.stdout + r.stderr
    assert ("CLOBBERED k" in r.stdout) == clobbered
    assert (why in r.stdout) == clobbered


# Two groups in flight, as dkv_ws_kernel's overlapped halves: group 0 reads R184..R187, group 1
# R152..R155; DEPBAR.LE gsb0, 1 retires group 0 only, DEPBAR.LE gsb0, 0 both.
def overlapped(write: str, where: int) -> list[str]:
    lines = [
        "WARPGROUP.ARRIVE",
        "HGMMA.64x128x16.F32.BF16 R24, R184, gdesc[UR8].tnspB, R24, gsb0",
        "F2FP.BF16.F32.PACK_AB R152, R1, R2",
        "WARPGROUP.ARRIVE",
        "HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR8].tnspB, R24, gsb0",
        "WARPGROUP.DEPBAR.LE gsb0, 0x1",
        "FADD R10, R11, R12",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "EXIT",
    ]
    return lines[:where] + [write] + lines[where:]


@pytest.mark.parametrize(
    "write, where, clobbered",
    [
        ("FADD R185, R1, R2", 2, True),  # group 0's A, before any wait
        ("FADD R185, R1, R2", 6, False),  # group 0's A after DEPBAR.LE 1: group 0 is done
        ("FADD R153, R1, R2", 6, True),  # group 1's A after DEPBAR.LE 1: group 1 may still run
        ("FADD R153, R1, R2", 8, False),  # after DEPBAR.LE 0
        ("STS [R153], R1", 6, False),  # a store reads R153, writes no register
    ],
)
def test_in_flight(tmp_path, write, where, clobbered):
    expect_verdict(tmp_path, overlapped(write, where), clobbered, "before its DEPBAR")


# A loop whose K-major HGMMA reads R60..R63 loaded before the loop (the Q fragments).
def loop(write_after: bool, redefine_before: bool) -> list[str]:
    body = [
        "LDS.128 R60, [R2]",  # 0x00: before the loop
        "WARPGROUP.ARRIVE",  # 0x10: loop head
    ]
    if redefine_before:
        body.append("LDS.128 R60, [R3]")
    body += [
        "HGMMA.64x64x16.F32.BF16 R24, R60, gdesc[UR8], R24, gsb0",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
    ]
    if write_after:
        body.append("IADD3 R61, R1, R2, RZ")
    body += ["ISETP.NE.AND P0, PT, R4, RZ, PT", "@P0 BRA 0x10", "EXIT"]
    return body


@pytest.mark.parametrize(
    "write_after, redefine_before, clobbered",
    [(True, False, True), (False, False, False), (True, True, False)],
)
def test_loop(tmp_path, write_after, redefine_before, clobbered):
    expect_verdict(tmp_path, loop(write_after, redefine_before), clobbered, "written later in the loop")


def test_every_function_reported(tmp_path):
    r = run(tmp_path, sass(("a", overlapped("FADD R10, R1, R2", 6)), ("b", overlapped("FADD R186, R1, R2", 3))))
    assert r.returncode == 1
    assert "ok        a" in r.stdout and "CLOBBERED b" in r.stdout
