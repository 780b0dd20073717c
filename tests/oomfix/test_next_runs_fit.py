"""The batch the fix reports is replayed from the memory the last try leaves (``SmallerBatch``'s
``_next_runs_fit_up_to``): where the user's next run starts among pieces pinned by what the try keeps, the
batch that fitted in a try may not fit, and the largest that does is reported instead.

The cell is ``test_search_replay``'s (a ``b`` MiB tensor freed, a 2 MiB buffer that lives on, a ``5 b`` MiB
tensor) under 6 GiB, its replay played by ``replay.replay`` itself."""

from __future__ import annotations

import types

from jupyter_cudamem.growth import replay
from jupyter_cudamem.oomfix import smaller_batch
from jupyter_cudamem.oomfix.smaller_batch import SmallerBatch
from jupyter_cudamem.reruns.search import BatchSearch
from tests.fakes import GiB, MiB
from tests.oomfix.test_search_replay import CAP, largest_fitting, observe


def batch_strategy(segments: tuple[replay.StartSegment, ...], monkeypatch) -> SmallerBatch:
    runs = types.SimpleNamespace(recorder=types.SimpleNamespace(state=lambda device: segments),
                                 rebound_addresses=lambda source: frozenset())
    monkeypatch.setattr(smaller_batch, "reserved_limit_bytes", lambda hardware, device: CAP)
    return SmallerBatch(runs, hardware=None, margin=0.04, fixed=None, history=[])  # type: ignore[arg-type]


def searched() -> tuple[BatchSearch, int]:
    """A search whose tries at a tenth of the largest batch and at the largest fitted."""
    largest = largest_fitting()
    search = BatchSearch(4 * largest, CAP, need_bytes=2 * CAP)
    search.set_allocator((), CAP)
    for batch in (largest // 10, largest - 2):
        search.record(batch, observe(batch))
    return search, largest - 2


def test_a_batch_that_fits_from_the_memory_left_is_reported_as_it_is(monkeypatch):
    search, best = searched()
    assert batch_strategy((), monkeypatch)._next_runs_fit_up_to(search, best, "", 0) is None


def test_pieces_pinned_by_what_the_last_try_keeps_lower_the_batch_reported(monkeypatch):
    search, best = searched()
    # A 2 GiB segment held by a 2 MiB tensor in its middle: reserved against the cap, each free half too
    # small for the step's largest tensor near the limit.
    pinned = replay.StartSegment(1 << 40, False, ((1023 * MiB, False), (2 * MiB, True), (1023 * MiB, False)))
    held = batch_strategy((pinned,), monkeypatch)._next_runs_fit_up_to(search, best, "", 0)
    assert held is not None and 0.5 * best < held < best
    assert replay.replay(_events_at(held), (pinned,), CAP).fits and not replay.replay(_events_at(best), (pinned,), CAP).fits


def _events_at(batch: int) -> list[replay.Event]:
    from tests.oomfix.test_search_replay import events

    return events(batch)
