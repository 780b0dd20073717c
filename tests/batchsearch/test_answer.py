"""The batch a search reports (``Tries.answer``): the largest that fitted, unless the replay of that try's
own recorded run, run after run as the cell's next runs make it, runs out of memory."""

from __future__ import annotations

from jupyter_cudamem.batchsearch import BatchSearch, Observation
from jupyter_cudamem.growth.replay import ALLOC, FREE, StartSegment, block_bytes
from jupyter_cudamem.growth.replay import RecordedRun
from tests.fakes import MiB

CAP = 100 * MiB
# The try starts holding the 30 MiB output a smaller try bound (start key -1), and binds a new output.
START = (StartSegment(0, False, ((30 * MiB, True),)),)


def search_after(events: list) -> BatchSearch:
    search = BatchSearch(100, CAP)
    search.set_allocator(START, CAP)
    search.record(60, Observation(True, peak_bytes=90 * MiB, recorded=RecordedRun(START, tuple(events))))
    return search


def test_a_try_that_fits_once_but_not_while_holding_its_own_last_output_is_not_the_answer():
    # `out = f(x)`: the new 60 MiB output is made while the old one is bound. The try held a 30 MiB one and
    # fitted; the next run holds the try's own 60 MiB: 120 MiB under a 100 MiB cap.
    search = search_after([(ALLOC, 0, 60 * MiB, 0), (FREE, -1, 0, 0)])
    assert search.best == 60
    answer = search.answer
    assert answer is not None and answer < 60
    assert 2 * block_bytes(answer * MiB) <= CAP  # the old output and the new one, at once
    assert 2 * block_bytes((answer + 2) * MiB) > CAP  # and no lower than the replay needs


def test_a_try_whose_next_runs_fit_too_is_the_answer():
    # `del out` first: the old output goes before the new one is made.
    assert search_after([(FREE, -1, 0, 0), (ALLOC, 0, 60 * MiB, 0)]).answer == 60


def test_without_a_recording_the_largest_that_fitted_is_the_answer():
    search = BatchSearch(100, CAP)
    search.record(60, Observation(True, peak_bytes=90 * MiB))
    assert search.answer == search.best == 60


def test_the_run_that_confirms_the_batch_is_judged_as_the_tries_are():
    # The try at 60 let the old output go first; the rerun confirming 60 (recorded after it, from a start
    # holding the same output) makes the new one while the old is bound: its next runs do not fit.
    search = search_after([(FREE, -1, 0, 0), (ALLOC, 0, 60 * MiB, 0)])
    assert search.answer == 60
    search.record(60, Observation(True, peak_bytes=90 * MiB,
                                  recorded=RecordedRun(START, ((ALLOC, 0, 60 * MiB, 0), (FREE, -1, 0, 0)))))
    answer = search.answer
    assert answer is not None and answer < 60


def test_a_recorded_run_keeps_where_it_began_the_values_bound_again_and_the_state_held_for_the_step():
    search = BatchSearch(100, CAP)
    remade, released = (frozenset({0}),), frozenset({1 << 30})
    search.set_allocator(START, CAP, remade, released)
    attempt = search.record(60, Observation(True, peak_bytes=90 * MiB, recorded=RecordedRun(START, ())))
    recorded = attempt.observation.recorded
    assert recorded is not None and recorded.remade == remade and recorded.released == released




def test_a_confirming_rerun_below_the_answer_is_judged_by_its_own_run():
    # 60 makes its new output while the old is bound: by its requests, about 50 keeps fitting (two outputs).
    search = search_after([(ALLOC, 0, 60 * MiB, 0), (FREE, -1, 0, 0)])
    assert 49 <= search.answer <= 50
    # The rerun at 50 that confirms it also makes a 10 MiB workspace it keeps: its next run holds it, the
    # old output and the new one, 110 MiB. By its own requests (the workspace scaled with the batch, erring
    # small: under 10 MiB, in a 20 MiB segment of its own) 40 keeps fitting (20 + 40 + 40 MiB reserved).
    search.record(50, Observation(True, peak_bytes=60 * MiB, recorded=RecordedRun(
        START, ((ALLOC, 1, 10 * MiB, 0), (ALLOC, 0, 50 * MiB, 0), (FREE, -1, 0, 0)))))
    assert search.kept(50) == 40 and search.kept(60) == search.answer
    # A try below it whose own run keeps fitting is the least it is; a run that keeps fitting is kept whole.
    search.record(47, Observation(True, peak_bytes=77 * MiB,
                                  recorded=RecordedRun(START, ((FREE, -1, 0, 0), (ALLOC, 0, 47 * MiB, 0)))))
    assert search.kept(50) == 47 and search.kept(47) == 47
