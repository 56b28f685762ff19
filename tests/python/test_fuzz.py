"""The package's fuzzer (fuzz_cases.py), a short run: 200 seeded cases of valid, awkward and invalid
calls through the NumPy functional API, the torch operators and the torch layer. Each must end in
a result that matches the reference backend or an nsa.Error naming the parameter it broke.
scripts/fuzz.sh runs the long one."""
from __future__ import annotations

import faulthandler

import pytest

import fuzz_cases

SEED = 1
CASES = 200


@pytest.mark.parametrize("index", range(CASES))
def test_case_ends_in_a_match_or_a_named_error(index):
    case = fuzz_cases.make_case(SEED, index)
    # The watchdog: a hang dumps every thread's stack and stops the run (the case is in the dump).
    faulthandler.dump_traceback_later(120, exit=True)
    try:
        outcome = fuzz_cases.run_case(case)
    except AssertionError as e:
        pytest.fail(f"{case.text} | mutation: {case.mutation}\n{e}", pytrace=False)
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert outcome in ("ok", "error")


def test_cases_are_reproducible():
    a, b = fuzz_cases.make_case(SEED, 7), fuzz_cases.make_case(SEED, 7)
    assert (a.text, a.mutation, a.expect) == (b.text, b.mutation, b.expect)


def test_the_fuzzer_sees_a_wrong_name_and_a_wrong_result():
    # A case that expects another parameter, and a check that fails, are both failures.
    case = fuzz_cases.make_case(SEED, 0)
    if case.expect is None:
        case.expect = "no such parameter"
    else:
        case.expect = case.expect + " (another)"
    with pytest.raises(AssertionError):
        fuzz_cases.run_case(case)
    valid = next(c for c in (fuzz_cases.make_case(SEED, i) for i in range(CASES)) if c.check is not None)

    def wrong(result):
        raise fuzz_cases.Mismatch("planted")

    valid.check = wrong
    with pytest.raises(AssertionError, match="planted"):
        fuzz_cases.run_case(valid)
