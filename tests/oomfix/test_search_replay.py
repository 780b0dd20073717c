"""The batch search with the allocator's replay (search.BatchSearch.replayed_batch): a cell whose limit is
set by pieces of split segments, which a line on allocated bytes cannot see.

The cell, per batch ``b``: a tensor of ``b`` MiB is made and freed, a small buffer that lives on lands
in its segment (the allocator hands out the smallest free block that fits), then a ``5 b`` MiB tensor
needs a segment of its own. The first segment cannot be given back while the buffer lives in it, so the
step needs ``6 b`` MiB reserved for a ``5 b`` MiB allocated peak: 20% more, as the H100's MLP did
(``benchmarks/fit_limit.py``). The real allocator's behaviour is the replay's; the test plays the card
with ``replay.replay`` itself, so what it checks is how the search uses it, not the replay's fidelity
(``tests/gpu/test_replay_gpu.py`` checks that on the GPU).
"""

from __future__ import annotations

import pytest

from jupyter_cudamem.growth import replay
from jupyter_cudamem.batchsearch import BatchSearch, Observation
from jupyter_cudamem.growth.fitting import REPLAY_MARGIN, Fitting
from jupyter_cudamem.growth.replay import RecordedRun
from tests.fakes import GiB, MiB

CAP = 6 * GiB


def events(batch: int, per_sample: int = MiB) -> list[replay.Event]:
    return [("alloc", 0, batch * per_sample, 0), ("free", 0, 0, 0), ("alloc", 1, 2 * MiB, 0),
            ("alloc", 2, 5 * batch * per_sample, 0), ("free", 2, 0, 0), ("free", 1, 0, 0)]


def observe(batch: int, recorded: bool = True) -> Observation:
    run = replay.replay(events(batch), (), CAP)
    if run.fits:
        return Observation(True, peak_bytes=run.peak_allocated_bytes,
                           recorded=RecordedRun((), tuple(events(batch))) if recorded else None)
    return Observation(False, need_bytes=run.peak_allocated_bytes + 5 * batch * MiB, held_bytes=run.peak_allocated_bytes)


def largest_fitting() -> int:
    return max(b for b in range(1, 2000) if replay.replay(events(b), (), CAP).fits)


def search_from(start: int, recorded: bool) -> BatchSearch:
    search = BatchSearch(start, CAP, need_bytes=5 * start * MiB)
    while (batch := search.next()) is not None:
        search.set_allocator((), CAP)
        search.record(batch, observe(batch, recorded))
        search.set_allocator((), CAP)
    return search


@pytest.mark.parametrize("ratio", [1.5, 4, 16, 64])
def test_the_replay_keeps_the_line_from_overshooting_a_fragmented_limit(ratio):
    true = largest_fitting()
    assert 5 * true * MiB < 0.85 * CAP  # allocated bytes alone would allow far more
    search = search_from(int(true * ratio), recorded=True)
    assert all(a.fitted for a in search.attempts), [(a.batch, a.fitted, a.reason) for a in search.attempts]
    assert search.best >= (1 - REPLAY_MARGIN - 0.02) * true and len(search.attempts) <= 3
    assert any("replay" in a.reason for a in search.attempts)


def test_without_recordings_the_line_overshoots_the_same_limit():
    true = largest_fitting()
    search = search_from(int(true * 4), recorded=False)
    assert not all(a.fitted for a in search.attempts)
    assert search.best < 0.9 * true


def test_no_replay_without_the_allocators_state_or_a_recorded_fit():
    search = BatchSearch(4000, CAP, need_bytes=2 * CAP)
    search.record(40, observe(40))
    assert search.replayed_batch() is None  # no set_allocator yet
    search.set_allocator((), CAP)
    assert search.replayed_batch() == pytest.approx(largest_fitting(), abs=2)  # one run: proportional
    blind = BatchSearch(4000, CAP, need_bytes=2 * CAP)
    blind.set_allocator((), CAP)
    blind.record(40, observe(40, recorded=False))
    assert blind.replayed_batch() is None


def test_a_search_the_replay_ends_says_so():
    # Two runs, the second at what the replay predicts: a third is tried only while the replay predicts
    # a larger whole batch with its margin, and the stop says which batch fitted and why no larger one.
    true = largest_fitting()
    search = BatchSearch(4 * true, CAP, need_bytes=5 * 4 * true * MiB)
    search.set_allocator((), CAP)
    search.record(true // 20, observe(true // 20))
    while (batch := search.next()) is not None:
        search.record(batch, observe(batch))
    assert search.best is not None and search.best >= 0.95 * true
    if len(search.attempts) < 3:
        assert "allocator's replay" in search.stopped and f"{search.best}, which fitted" in search.stopped
    else:
        assert search.stopped == "the 3 tries allowed are spent"


class _WindowedReplay(BatchSearch):
    """A search whose replay fits every batch up to 200 (less the margin) and, alone above them, 250: a
    window of the allocator's, where the batches between fail."""

    def replayed(self, margin: float = 0.0) -> Fitting:
        largest = int(200 / (1 + margin))
        return Fitting(lambda batch: batch <= largest or batch == 250, lambda most, at_least: min(largest, most))


def test_a_batch_the_replay_fits_alone_above_failing_ones_is_not_taken_for_one_that_fits():
    search = _WindowedReplay(2000, CAP)
    search.set_allocator((), CAP)
    search.record(31, Observation(True, peak_bytes=31 * MiB, recorded=RecordedRun((), tuple(events(31)))))
    # 250 is halving's (2,000 / 8) and its replay fits, but 201 to 249 do not: not "fits but for the margin".
    assert search.next() == int(200 / (1 + REPLAY_MARGIN)), search.reason


class _ExactReplay(BatchSearch):
    """A search whose replay fits every batch up to 200 with no margin (fewer with one)."""

    def replayed(self, margin: float = 0.0) -> Fitting:
        largest = int(200 / (1 + margin))
        return Fitting(lambda batch: batch <= largest, lambda most, at_least: min(largest, most))


def test_on_the_last_rerun_halvings_batch_that_fits_with_no_margin_is_tried_after_a_low_second_try():
    # Halving from 400 ends on 200. The second try (60) fitted below halving's next batch under 200 (100):
    # should 200 fail, the search ends below where halving would; the margin's batch (196) ends below it
    # whenever 200 fits. The replay says 200 fits: the last rerun tries it (it tried 196 before).
    search = _ExactReplay(400, CAP)
    search.set_allocator((), CAP)
    for batch in (6, 60):
        search.record(batch, Observation(True, peak_bytes=batch * MiB, recorded=RecordedRun((), tuple(events(batch)))))
    assert search.next() == 200, search.reason
    assert "200, halving's, fits with no margin" in search.reason


def test_two_recorded_runs_are_paired_once_for_every_margin_and_again_after_a_new_run(monkeypatch):
    from jupyter_cudamem.growth import fitting

    pairings = []
    real = fitting.paired_fittings

    def counted(*args):
        pairings.append(args[1::2][:2])  # the two batches
        return real(*args)

    monkeypatch.setattr(fitting, "paired_fittings", counted)
    search = BatchSearch(4000, CAP, need_bytes=2 * CAP)
    search.set_allocator((), CAP)
    search.record(10, observe(10))
    search.record(40, observe(40))
    margins = [search.replayed(margin).largest(3999) for margin in (0.0, 0.005, REPLAY_MARGIN)]
    assert pairings == [(10, 40)]
    assert margins[0] >= margins[1] >= margins[2] > 40  # each margin its own replays
    search.record(80, observe(80))
    search.replayed(0.0)
    assert pairings == [(10, 40), (40, 80)]
    held = (replay.StartSegment(1 << 40, False, ((20 * MiB, True),)),)
    search.set_allocator(held, CAP)  # a try left a segment: the runs are read from there again
    search.replayed(0.0)
    assert pairings == [(10, 40), (40, 80), (40, 80)]


def test_a_replays_reason_names_its_own_allowance_not_a_margin_the_user_sets():
    # OomFix.margin (the search's ``margin``) is the share of the room a prediction by the line leaves unused;
    # a replay's prediction takes its per-sample requests 2% larger instead, and its reason says that.
    search = _WindowedReplay(2000, CAP)
    search.set_allocator((), CAP)
    search.record(31, Observation(True, peak_bytes=31 * MiB, recorded=RecordedRun((), tuple(events(31)))))
    assert search.next() == 196  # 200 / 1.02
    assert search.reason.startswith("the allocator's replay of the tries fits up to 196 with its per-sample requests "
                                    "2% larger (the replay's allowance for the next run)"), search.reason
    assert "margin" not in search.reason
