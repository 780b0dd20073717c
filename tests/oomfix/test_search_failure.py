"""The batch search replays a failed try's own requests (``Tries.paired_failure``): a one-run replay from a
small probe scales tensors of fixed size with the batch, and the blocks it then places are no bound in the
allocator; the requests a failed try made before it raised say which tensors those are.

The step is one the project's simulator drew (``tests/oomfix/world.py``, seed 2026): a model built in the
cell (three weights, 0.43 GiB), SGD with momentum, and a 180 MiB tensor of fixed size kept for the backward
pass, under an 8 GiB cap; its largest batch that keeps fitting is 1,101, and the cell failed at 51,796.
"""

from __future__ import annotations

from jupyter_cudamem.growth.replay import StartSegment, replay
from jupyter_cudamem.growth.replay import RecordedRun
from jupyter_cudamem.batchsearch import Attempt, BatchSearch, Observation
from tests.oomfix import world
from tests.oomfix.test_search_replay import events, observe
import pytest

# Nothing here runs a library whose version `make test-min` changes (tests/versioned.py).
pytestmark = pytest.mark.dependency_free

STEP = world.Step(
    cap_bytes=8 * world.GiB, parameters=(54714882, 206735426, 203082309), built_in_cell=True, training=True,
    state_per_parameter=1, state_exists=False, grads_kept=False, temporaries=(), input_per_sample=287058.7146935743,
    activations=((0.0, 1746067.8708212054), (0.0, 1658479.9563685653), (188273441.68127903, 0.0)),
    workspace_bytes=8 * world.MiB, noise=0.5)
START, SEED = 51796, 442


def tries(search: BatchSearch) -> list[tuple[int, bool]]:
    return [(a.batch, a.fitted) for a in search.attempts]


def test_the_search_lands_below_the_batch_that_keeps_fitting_with_or_without_a_failed_try():
    # One run fits up to 1,115, and so do the runs after it: the cleanup after the proving rerun empties the
    # cache, so the fixed 180 MiB tensor and the model's blocks do not land in segments the last run left
    # (from those, 1,101). The try above it fails; with its own requests or without, the last try fits.
    largest = world.largest_fitting(STEP)
    assert largest == 1115
    for recorded in (True, False):
        found, reruns, search = world.search(STEP, START, seed=SEED, failures_recorded=recorded)
        assert reruns == 3 and search.attempts[-1].fitted, tries(search)
        assert 0.9 * largest <= found <= largest, tries(search)


def probed() -> BatchSearch:
    """A search of ``test_search_replay``'s cell under 6 GiB from a failure at 4,000, its probe fitted."""
    search = BatchSearch(4000, 6 * world.GiB, need_bytes=5 * 4000 * world.MiB)
    search.set_allocator((), 6 * world.GiB)
    probe = search.next()
    assert probe is not None
    search.record(probe, observe(probe))
    return search


def test_a_failure_the_replay_of_its_own_requests_fits_is_not_trusted():
    # The try failed (memory outside PyTorch, a workspace drawn larger) where its own requests, replayed,
    # fit: the replay does not see what made it fail, so the search does not take it for a bound.
    search = probed()
    failed_batch = search.next()
    assert failed_batch is not None
    as_recorded = RecordedRun((), tuple(events(failed_batch)))  # every request, and all of them fit
    search.record(failed_batch, Observation(False, need_bytes=3 * world.GiB, held_bytes=2 * world.GiB,
                                            recorded=as_recorded))
    assert search.paired_failure() is None
    assert search.next() is not None and "up to its failure" not in search.reason


def test_a_failure_whose_requests_replay_to_it_is_paired():
    search = probed()
    too_big = 2000
    failing = replay(events(too_big), (), 6 * world.GiB)
    assert not failing.fits and failing.failed_at is not None
    as_recorded = RecordedRun((), tuple(events(too_big)[:failing.failed_at + 1]))
    search.record(too_big, Observation(False, need_bytes=failing.allocated_at_failure_bytes + 5 * too_big * world.MiB,
                                       held_bytes=failing.allocated_at_failure_bytes, recorded=as_recorded))
    paired = search.paired_failure()
    assert isinstance(paired, Attempt) and paired.batch == too_big
    batch = search.next()
    assert batch is not None and f"the one that failed at {too_big} up to its failure" in search.reason
    assert replay(events(batch), (), 6 * world.GiB).fits


def test_a_paired_failure_is_paired_once_for_every_margin_the_search_asks(monkeypatch):
    from jupyter_cudamem.growth import fitting

    pairings = []
    real = fitting.paired_with_failure

    def counted(*args, **kwargs):
        pairings.append((args[1], args[3]))  # the fitted run's batch, the failed one's
        return real(*args, **kwargs)

    monkeypatch.setattr(fitting, "paired_with_failure", counted)
    search = probed()
    probe = search.attempts[0].batch
    too_big = 2000
    failing = replay(events(too_big), (), 6 * world.GiB)
    assert failing.failed_at is not None
    as_recorded = RecordedRun((), tuple(events(too_big)[:failing.failed_at + 1]))
    search.record(too_big, Observation(False, need_bytes=failing.allocated_at_failure_bytes + 5 * too_big * world.MiB,
                                       held_bytes=failing.allocated_at_failure_bytes, recorded=as_recorded))
    assert search.paired_failure() is not None and search.next() is not None  # asks at several margins
    assert pairings == [(probe, too_big)]
    held = (StartSegment(1 << 40, False, ((20 * world.MiB, True),)),)
    search.set_allocator(held, 6 * world.GiB)  # a try left a segment: the runs are read from there again
    search.replayed(0.0)
    assert pairings == [(probe, too_big)] * 2
