"""The largest fitting batch by real runs (benchmarks/bisect_batch.py), with the steps of both benchmarks
that use it: the sweep's oracle (benchmarks/oomfix.py, doubling) and the plan's check (benchmarks/plan.py,
25% steps from the prediction). On CPU over ``fits = batch <= limit``."""

from __future__ import annotations

import math

import pytest

from benchmarks.bisect_batch import largest_fitting

pytestmark = pytest.mark.benchmark_smoke

DOUBLE = dict(up=lambda batch: 2 * batch)
PLAN = dict(  # benchmarks/plan.py's real_largest
    up=lambda batch: max(int(batch * 1.25), batch + 1),
    down=lambda batch: max(int(batch / 1.25), 1) if batch > 1 else 0,
)
LIMITS = [0, 1, 2, 3, 7, 15, 16, 17, 31, 37, 100, 127, 128, 129, 1000, 4097, 65535]


def _runs_agree(limit, runs):
    return all(fitted == (batch <= limit) for batch, fitted in runs) and len({b for b, _ in runs}) == len(runs)


@pytest.mark.parametrize("limit", LIMITS)
@pytest.mark.parametrize("start", [1, 2, 16, 100, 5000])
@pytest.mark.parametrize("steps", [DOUBLE, PLAN], ids=["doubling", "plan"])
def test_the_largest_fitting_batch_exactly_each_batch_run_once(limit, start, steps):
    found, runs = largest_fitting(lambda batch: batch <= limit, start, **steps)
    assert found == limit
    assert runs[0] == (start, start <= limit) and _runs_agree(limit, runs)
    if limit:
        assert (limit, True) in runs and (limit + 1, False) in runs  # both sides of the answer were run
    # never a scan: the steps move geometrically and the bisection halves
    assert len(runs) <= 6 * math.log2(max(limit, start, 2)) + 8


def test_the_sweeps_doubling_runs_as_before():
    # The oracle of benchmarks/oomfix.py from 16 (ORACLE_FIRST_PROBE): double until a failure, then bisect.
    assert largest_fitting(lambda b: b <= 50, 16, **DOUBLE)[1] == [
        (16, True), (32, True), (64, False), (48, True), (56, False), (52, False), (50, True), (51, False)]
    # 16 fails: bisection from 0, no doubling down.
    assert largest_fitting(lambda b: b <= 5, 16, **DOUBLE)[1] == [
        (16, False), (8, False), (4, True), (6, False), (5, True)]


def test_the_plans_steps_run_as_before():
    # From a prediction that fits: up by 25% until one fails, then bisect.
    assert largest_fitting(lambda b: b <= 130, 100, **PLAN)[1] == [
        (100, True), (125, True), (156, False), (140, False), (132, False), (128, True), (130, True), (131, False)]
    # From one that does not: down by 25% until one fits; below 1 nothing fits.
    assert largest_fitting(lambda b: b <= 70, 100, **PLAN)[1] == [
        (100, False), (80, False), (64, True), (72, False), (68, True), (70, True), (71, False)]
    assert largest_fitting(lambda b: False, 3, **PLAN) == (0, [(3, False), (2, False), (1, False)])


def test_a_batch_that_fits_past_the_limit_is_refused():
    with pytest.raises(RuntimeError, match="does not reach"):
        largest_fitting(lambda batch: True, 16, limit=1024, **DOUBLE)
    assert largest_fitting(lambda batch: batch <= 1000, 16, limit=1024, **DOUBLE)[0] == 1000
    with pytest.raises(ValueError, match="at least 1"):
        largest_fitting(lambda batch: True, 0, **DOUBLE)


@pytest.mark.parametrize("limit", [0, 1, 7, 29, 44])
@pytest.mark.parametrize("start", [1, 16, 40, 44])
def test_a_batch_known_to_fail_is_never_run(limit, start):
    # The steady oracle of benchmarks/oomfix.py under a single-run oracle of 44: 45 is known to fail.
    found, runs = largest_fitting(lambda batch: batch <= limit, start, up=lambda batch: 2 * batch,
                                  down=lambda batch: batch // 2, failing=45)
    assert found == limit and _runs_agree(limit, runs) and all(batch < 45 for batch, _ in runs)


def test_steps_up_stop_below_the_batch_known_to_fail():
    assert largest_fitting(lambda b: b <= 100, 40, up=lambda b: 2 * b, failing=45)[1] == [
        (40, True), (42, True), (43, True), (44, True)]
    with pytest.raises(ValueError, match="known to fail"):
        largest_fitting(lambda b: True, 45, up=lambda b: 2 * b, failing=45)
