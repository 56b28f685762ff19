#!/usr/bin/env python3
"""Checks the SASS of sm_90a kernels for wgmma A-operand registers that are overwritten while a
wgmma may still read them.

1. Loops. A wgmma with A in registers (HGMMA Rd, Ra, gdesc...) reads Ra..Ra+3. When those
   registers hold values loaded before a loop (the Q fragments of the attention kernels) and the
   HGMMA sits in the loop, they must stay intact for the next iteration. ptxas (CUDA 13.0) was seen
   to give them to other values inside the loop when the loop was their last use (docs/cuda.md,
   "wgmma"): every iteration after the first then multiplied garbage. Reported per kernel: each
   K-major HGMMA (no .tnspB: Q K^T) whose A registers are not redefined in the loop before it but
   are written after it within the loop.
2. In flight. A wgmma reads its A registers until the WARPGROUP.DEPBAR that retires its group
   (HGMMAs up to one marked gsb0 form a group; DEPBAR.LE gsb0, N leaves the newest N groups
   pending). Reported: an instruction between an HGMMA with register A (any, .tnspB included) and
   that DEPBAR, in address order, that writes one of its A registers. Kernels that issue the next
   products before waiting for the previous ones (dkv_ws_kernel's overlapped halves) depend on it.

    cuobjdump -sass file.cubin > file.sass      (or: nvcc -cubin ... ; cuobjdump -sass ...)
    tools/check_wgmma_a_regs.py file.sass       exit status 1 when a kernel is clobbered
    tools/check_wgmma_a_regs.py --all file.sass check 1 for the MN-major (.tnspB) ones too; HGMMAs
                                                with A from shared memory (gdesc) have no A
                                                registers: skipped

Heuristic: destinations are the first operand (stores, branches and barriers skipped); widths from
.64/.128/WIDE/LDSM .4 suffixes; loops are backward branches; check 2 follows address order, not
branches.
"""
import re
import sys

ALL = False

SKIP = ("ST", "RED", "ATOM", "BRA", "BAR", "ISETP", "FSETP", "DEPBAR", "WARPGROUP", "EXIT", "BSYNC", "BSSY",
        "WARPSYNC", "LDGSTS", "CALL", "RET", "NOP", "YIELD", "SYNCS", "FENCE", "MEMBAR", "PLOP3")


def instructions(body):
    return [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", body)]


def destination(text):
    op = text.split()
    if op and op[0].startswith("@"):
        op = op[1:]
    if len(op) < 2 or op[0].startswith(SKIP) or op[0].startswith("HGMMA"):
        return None
    m = re.match(r"R(\d+)", op[1])
    if not m:
        return None
    width = 4 if ".128" in op[0] or (op[0].startswith("LDSM") and ".4" in op[0]) else 2 if (".64" in op[0] or "WIDE" in op[0]) else 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def a_registers(s):
    """An HGMMA's A registers Ra..Ra+3 (None: A from shared memory, a descriptor)."""
    m = re.search(r"HGMMA\S*\s+R\d+,\s*R(\d+)", s)
    return set(range(int(m.group(1)), int(m.group(1)) + 4)) if m else None


def check(name, ins):
    back = []
    for a, s in ins:
        m = re.search(r"BRA 0x([0-9a-f]+)", s)
        if m and int(m.group(1), 16) < a:
            back.append((int(m.group(1), 16), a))
    bad = []
    for h, s in ins:
        if not s.startswith("HGMMA") or ("tnspB" in s and not ALL):
            continue
        regs = a_registers(s)
        if regs is None:  # A from shared memory (gdesc): no registers to clobber
            continue
        for t, b in (lb for lb in back if lb[0] <= h <= lb[1]):
            defs = [(a, r) for a, s2 in ins if t <= a <= b for r in (destination(s2) or set()) & regs]
            for r in regs:
                if not any(a < h for a, rr in defs if rr == r) and any(a > h for a, rr in defs if rr == r):
                    bad.append("HGMMA at %#x: R%d written later in the loop [%#x, %#x]" % (h, r, t, b))
    return bad


def check_in_flight(ins):
    bad = []
    groups = 0  # groups committed so far (an HGMMA marked gsb0 closes one)
    pending = []  # (address, A registers, group index) of register-A HGMMAs not known retired
    for a, s in ins:
        if s.startswith("WARPGROUP.DEPBAR"):
            m = re.search(r"gsb0,\s*(0x[0-9a-f]+|\d+)", s)
            keep = int(m.group(1), 0) if m else 0
            pending = [p for p in pending if p[2] >= groups - keep]
            continue
        if s.startswith("HGMMA"):
            regs = a_registers(s)
            if regs is not None:
                pending.append((a, regs, groups))
            if "gsb0" in s:
                groups += 1
            continue
        for r in destination(s) or set():
            for h, regs, _ in pending:
                if r in regs:
                    bad.append("HGMMA at %#x: R%d written at %#x before its DEPBAR" % (h, r, a))
    return bad


def main(path):
    text = open(path).read()
    failed = False
    for body in re.split(r"\n\s*Function : ", text)[1:]:
        name = body.split("\n", 1)[0].strip()
        ins = instructions(body)
        bad = check(name, ins) + check_in_flight(ins)
        failed |= bool(bad)
        print(("CLOBBERED " if bad else "ok        ") + name + ("\n    " + bad[0] if bad else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    # --all: also the MN-major (.tnspB) HGMMAs with register A (P V, and the backward's P^T dO, dS^T Q)
    ALL = "--all" in sys.argv[1:]
    sys.exit(main([x for x in sys.argv[1:] if x != "--all"][0]))
