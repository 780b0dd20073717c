"""Each of the batch search's rules (``jupyter_cudamem/batchsearch.py``, ``RULES``) on a state where it
is the first that chooses.

The states are measured by the line (no recorded runs), so every expected batch is worked out by hand from
``growth.line``: two fits at 50 and 60 of ``200 MiB + 8 MiB x batch`` give a fixed part of 200 MiB, a slope of
8 MiB and a steepest slope of 8.8 MiB (each peak may sit 4 MiB off the line, over a spread of 10), anchored at
60's peak (680 MiB) plus its 4 MiB of uncertainty. The largest batch a peak target ``T`` allows is then
``60 + floor((T - 684 MiB) / 8.8 MiB)``, where ``T`` keeps ``margin`` of the room above 200 MiB unused.
"""

from __future__ import annotations

import re
from pathlib import Path

from jupyter_cudamem import batchsearch
from jupyter_cudamem.batchsearch import BatchSearch, Observation
from tests.fakes import MiB

LINE = "line through measured peaks: 200 MiB fixed + 8.000 MiB per sample"


def on_the_line(budget_mib: int, max_tries: int = 3, failed: int = 200) -> BatchSearch:
    """Two fits on ``200 MiB + 8 MiB x batch``, at 50 and 60; ``failed`` failed first."""
    search = BatchSearch(failed, budget_mib * MiB, max_tries=max_tries)
    for batch in (50, 60):
        search.record(batch, Observation(True, peak_bytes=(200 + 8 * batch) * MiB))
    return search


def test_probe_is_the_failed_batch_over_64_then_over_8_after_a_failed_probe():
    search = BatchSearch(640, 1000 * MiB)
    assert (search.next(), search.rule, search.reason) == (10, "probe", "probe: the failed 640 / 64")
    search.record(10, Observation(False))
    assert (search.next(), search.rule, search.reason) == (1, "probe", "probe: the failed 10 / 8")
    # A failure that needed twice the budget: the probe is half as large.
    twice = BatchSearch(640, 1000 * MiB, need_bytes=2000 * MiB)
    assert (twice.next(), twice.reason) == (5, "probe: the failed 640 / 128")


def test_bisect_without_a_peak_when_a_try_fitted_unmeasured():
    search = BatchSearch(640, 1000 * MiB)
    search.record(10, Observation(True))
    assert (search.next(), search.rule) == ((10 + 640) // 2, "bisect_without_a_peak")


def test_bisect_when_contradicted_after_a_failure_that_held_all_the_line_gave_it():
    search = BatchSearch(640, 1000 * MiB)
    search.record(10, Observation(True, peak_bytes=100 * MiB))
    # One peak through zero: 10 MiB a sample; 4% of 1,000 MiB kept, less 4 MiB of uncertainty: 10 + 85.
    assert (search.next(), search.rule) == (95, "largest_predicted")
    # It failed holding 950 MiB, more than the line's 954 MiB less the margin: no line.
    search.record(95, Observation(False, held_bytes=950 * MiB))
    assert (search.next(), search.rule) == ((10 + 95) // 2, "bisect_when_contradicted")


def test_halving_with_no_margin_on_the_last_rerun():
    # 1,045 MiB: with no margin 60 + floor(361 / 8.8) = 101 fits, so 100 (halving's) does; with the
    # 4% margin only 60 + floor(327.2 / 8.8) = 97.
    search = on_the_line(1045, max_tries=3)
    assert (search.next(), search.rule) == (100, "halving_with_no_margin_on_the_last_rerun")
    assert search.reason == f"{LINE}; 100, halving's, fits with no margin"


def test_halving_but_for_the_margin_while_reruns_are_left():
    # The same state with a rerun left after this one: with JITTER (0.5%) 60 + floor(356.8 / 8.8) = 100.
    search = on_the_line(1045, max_tries=4)
    assert (search.next(), search.rule) == (100, "halving_but_for_the_margin")
    assert search.reason == f"{LINE}; 100, halving's, fits but for the margin"


def test_largest_predicted_where_no_halving_batch_fits():
    # 900 MiB: with the margin 60 + floor(188 / 8.8) = 81; with none 84, below halving's 100.
    search = on_the_line(900)
    assert (search.next(), search.rule, search.reason) == (81, "largest_predicted", LINE)
    assert search._pending is not None and search._pending.predicted_peak == (684 + 8.8 * 21) * MiB


def test_largest_but_for_the_margin_where_the_margin_leaves_no_larger_batch():
    # 705 MiB: with the margin 60 + floor(0.8 / 8.8) = 60, no gain; with JITTER 60 + floor(18.5 / 8.8) = 62.
    search = on_the_line(705)
    assert (search.next(), search.rule) == (62, "largest_but_for_the_margin")
    assert search.reason == f"{LINE}; 62 fits but for the margin, and a rerun is left"


def test_halving_next_untried_ends_no_lower_than_halving():
    # 690 MiB: nothing above 60 fits even with JITTER (60 + floor(3.55 / 8.8)); halving's 100 is untried,
    # and a rerun is left after it.
    search = on_the_line(690, max_tries=4)
    assert (search.next(), search.rule) == (100, "halving_next_untried")
    assert search.reason == f"{LINE}; 100, halving's next batch, is untried"
    # On the last rerun it is not tried: the search ends on what fitted.
    last = on_the_line(690, max_tries=3)
    assert last.next() is None and last.stopped == f"{LINE}: 60, which fitted, is the largest batch predicted to fit"


def test_one_more_sample_after_one_run_whose_peak_left_room():
    # One fit, 600 MiB at 6: 100 MiB a sample through zero. Under 650 MiB the margin's target is 624 MiB:
    # 6 + floor(20 / 100) = 6, and with JITTER 6 + floor(42.75 / 100) = 6; the peak is below the target.
    search = BatchSearch(10, 650 * MiB)
    search.record(6, Observation(True, peak_bytes=600 * MiB))
    assert (search.next(), search.rule) == (7, "one_more_sample")
    # Under 610 MiB the peak is above the target (585.6 MiB): with two reruns left it is tried all the same (a
    # failure costs one, and the last confirms 6); with one left, no rule chooses and the search ends.
    spare = BatchSearch(10, 610 * MiB)
    spare.record(6, Observation(True, peak_bytes=600 * MiB))
    assert (spare.next(), spare.rule) == (7, "one_more_sample")
    full = BatchSearch(10, 610 * MiB, max_tries=2)
    full.record(6, Observation(True, peak_bytes=600 * MiB))
    assert full.next() is None
    assert full.stopped == "surest from 6's peak (line through it and zero): 6, which fitted, is the largest batch predicted to fit"


def test_the_docs_describe_every_rule_in_the_order_the_search_asks_them():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "oomfix.md").read_text()
    section = docs.split("## How the search chooses", 1)[1].split("\n## ", 1)[0]
    described = re.findall(r"^\d+\. \*\*`(\w+)`\*\*", section, flags=re.MULTILINE)
    assert described == [rule.__name__ for rule in batchsearch.RULES]
