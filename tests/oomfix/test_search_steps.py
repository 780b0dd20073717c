"""The batch search with the optimizer's steps marked in the recorded history (``RecordedRun.stepped``).

The cell is a fine-tune's loop of four steps: a frozen 1 GiB of weights the cell does not build, four
256 MiB gradients made by each backward pass and freed by the next ``zero_grad()``, and an optimizer
whose foreach ``step()`` makes a parameter-sized temporary for each (freed within it). The batch's part
is 40 MiB of activations a sample. Its largest batch under 6 GiB is where a backward pass's activations
and gradients fill the cap; the step's 2 GiB do not grow with it. A probe at a few samples peaks in a
step, so a replay of that one run that scales the step's temporaries with the batch puts the next try
at a tenth of the largest batch.
"""

from __future__ import annotations

import pytest

from jupyter_cudamem.growth import FixedMemory, replay
from jupyter_cudamem.growth.fitting import fits_in_a_row
from jupyter_cudamem.growth.line import made_in_steps, step_gradients
from jupyter_cudamem.growth.replay import RecordedRun
from jupyter_cudamem.sources.torch_trace import read_trace_within, without_step_marks
from jupyter_cudamem.batchsearch import BatchSearch, Observation
from tests.fakes import GiB, MiB

# Nothing here runs a library whose version `make test-min` changes (tests/versioned.py).
pytestmark = pytest.mark.dependency_free

CAP = 6 * GiB
PARAMETER = 256 * MiB
PARAMETERS = 4
ACTIVATION = 40 * MiB
STEPS = 4
FIXED = FixedMemory(gradients_bytes=PARAMETERS * PARAMETER, tensor_bytes=frozenset({PARAMETER}),
                    gradient_sizes=(PARAMETER,) * PARAMETERS, trainable_sizes=(PARAMETER,) * PARAMETERS, trains=True)


def rows(batch: int) -> tuple[list[tuple[str, int, int, int]], list[tuple[int, int, int]]]:
    """The history of one run of the loop at ``batch``, as torch records it, and the steps' marks."""
    history: list[tuple[str, int, int, int]] = []
    marks: list[tuple[int, int, int]] = []
    addresses = iter(range(1 << 20, 1 << 40, 1 << 20))

    def alloc(size: int) -> int:
        address = next(addresses)
        history.append(("alloc", address, size, 0))
        return address

    def free(address: int, size: int) -> None:
        history.extend([("free_requested", address, size, 0), ("free_completed", address, size, 0)])

    gradients: list[int] = []
    for _ in range(STEPS):
        for gradient in gradients:  # zero_grad(set_to_none=True)
            free(gradient, PARAMETER)
        activations = [alloc(batch * ACTIVATION // 4) for _ in range(4)]
        gradients = [alloc(PARAMETER) for _ in range(PARAMETERS)]
        for activation in activations:
            free(activation, batch * ACTIVATION // 4)
        first, second = alloc(1), alloc(3)
        marks.append((0, first, second))
        free(second, 3)
        temporaries = [alloc(PARAMETER) for _ in range(PARAMETERS)]
        for temporary in temporaries:
            free(temporary, PARAMETER)
        free(first, 1)
    return history, marks


def observe(batch: int, marked: bool) -> Observation:
    history, marks = rows(batch)
    kept, spans = without_step_marks(history, marks if marked else [], 0)
    events, left, steps = read_trace_within(kept, (), spans=spans)
    run = replay.replay(events, (), CAP)
    if run.fits:
        return Observation(True, peak_bytes=run.peak_allocated_bytes,
                           recorded=RecordedRun((), tuple(events), left, steps=steps))
    return Observation(False, need_bytes=CAP + 1, held_bytes=run.allocated_at_failure_bytes)


def largest_fitting() -> int:
    """The largest batch whose run fits again and again (one run alone fits 128: the runs after it 102)."""
    def steady(batch: int) -> bool:
        history, marks = rows(batch)
        kept, spans = without_step_marks(history, marks, 0)
        return fits_in_a_row(read_trace_within(kept, (), spans=spans)[0], (), CAP)

    return max(b for b in range(1, 400) if steady(b))


def search_from(start: int, marked: bool) -> BatchSearch:
    search = BatchSearch(start, CAP, need_bytes=CAP + 1, fixed=FIXED)
    search.set_allocator((), CAP)
    while (batch := search.next()) is not None:
        search.record(batch, observe(batch, marked))
    return search


def test_the_marks_leave_the_run_and_say_what_each_step_made():
    history, marks = rows(2)
    kept, spans = without_step_marks(history, marks, 0)
    assert len(kept) == len(history) - STEPS * 6 and len(spans) == STEPS
    assert all(size not in (1, 3) for _, _, size, _ in kept)
    events, _, steps = read_trace_within(kept, (), spans=spans)
    made = [size for kind, key, size, _ in events if kind == "alloc" and key in made_in_steps(events, steps)]
    assert made == [PARAMETER] * PARAMETERS * STEPS
    gradients = step_gradients(events, FIXED, steps)
    assert len(gradients) == PARAMETERS * STEPS and not gradients & made_in_steps(events, steps)
    assert without_step_marks(history, [(1, *mark[1:]) for mark in marks], 0)[1] == []  # another device's


def test_a_pair_of_other_requests_at_a_marks_addresses_does_not_open_the_step():
    # The allocator gives freed blocks out again: the forward pass's two small tensors had the addresses
    # the step's mark gets later (on an H200, a ResNet-18 run was taken as its step from its sixth request).
    history, marks = rows(2)
    _, first, second = marks[0]
    forward = [("alloc", first, 512, 0), ("alloc", second, 512, 0), ("free_requested", first, 512, 0),
               ("free_completed", first, 512, 0), ("free_requested", second, 512, 0),
               ("free_completed", second, 512, 0)]
    kept, spans = without_step_marks(forward + history, marks, 0)
    assert spans == [(span[0] + len(forward), span[1] + len(forward))
                     for span in without_step_marks(history, marks, 0)[1]]
    assert kept[:len(forward)] == forward


def test_a_step_that_raised_runs_to_the_end_of_the_history():
    history, marks = rows(2)
    cut = max(i for i, row in enumerate(history) if row[1] == marks[-1][1] and row[0] == "alloc") + 4
    kept, spans = without_step_marks(history[:cut + 2], marks, 0)  # two temporaries made, then it raised
    assert spans[-1][1] == len(kept)


@pytest.mark.parametrize("ratio", [1.1, 1.5, 3, 10, 50])
def test_the_steps_requests_keep_their_size_and_the_search_lands_near_the_largest(ratio):
    largest = largest_fitting()
    assert 100 < largest < 130
    search = search_from(int(largest * ratio), marked=True)
    assert search.best is not None and search.best >= 0.9 * largest, [(a.batch, a.fitted) for a in search.attempts]
    assert len(search.attempts) <= 3


def test_without_the_marks_the_probes_replay_scales_the_steps_temporaries():
    largest = largest_fitting()
    unmarked = search_from(int(largest * 1.5), marked=False)
    marked = search_from(int(largest * 1.5), marked=True)
    assert unmarked.attempts[0].batch == marked.attempts[0].batch  # the same probe
    assert marked.attempts[1].batch >= 0.9 * largest
    assert unmarked.attempts[1].batch < 0.1 * largest
