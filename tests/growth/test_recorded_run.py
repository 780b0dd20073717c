"""A try whose work fitted and whose last request, moving a joined result back to the GPU, ran out of memory
(``oomfix.smaller_batch``: the chunks' results then stay on the host): the search replays its work alone."""

from __future__ import annotations

from jupyter_cudamem.batchsearch import BatchSearch, Observation
from jupyter_cudamem.growth.replay import ALLOC, FREE, RecordedRun, StartSegment
from tests.fakes import MiB

CAP = 1024 * MiB
START = (StartSegment(0, False, ((64 * MiB, True),)),)  # the data, held
# Four chunks of one row (a 100 MiB activation each, freed) and the joined result moved back: 900 MiB.
CHUNKS = tuple(event for key in range(4) for event in ((ALLOC, key, 100 * MiB, 0), (FREE, key, 0, 0)))
FAILED = RecordedRun(START, CHUNKS + ((ALLOC, 4, 900 * MiB, 0),))


def test_the_request_that_raised_is_left_out_and_the_work_kept():
    assert FAILED.without_the_request_that_raised().events == CHUNKS


def test_a_try_whose_work_fitted_predicts_from_its_work():
    def search_after(run: RecordedRun) -> BatchSearch:
        search = BatchSearch(20, CAP - 64 * MiB)
        search.set_allocator(START, CAP)
        search.record(1, Observation(True, peak_bytes=100 * MiB, recorded=run))
        return search

    # With the request that raised, no batch replays; without it, 100 MiB a row fit nine rows under 960 MiB.
    assert search_after(FAILED).replayed_batch() == 0
    assert search_after(FAILED.without_the_request_that_raised()).replayed_batch() == 9
