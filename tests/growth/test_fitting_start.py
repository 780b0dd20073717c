"""``growth.fitting``: the bound from allocated bytes frees what the start holds where the run frees it
(jupyter_cudamem/growth/fitting.py ``held_at_start``, ``allocated_limit``, ``peak_allocated_bytes``)."""

from __future__ import annotations

from jupyter_cudamem.growth.fitting import _CARRIED, fits_in_a_row, fitting_from_one, held_at_start, next_run
from jupyter_cudamem.growth.replay import ALLOC, FREE, StartSegment, start_keys

MiB, GiB = 1 << 20, 1 << 30


def test_a_value_the_cell_binds_again_frees_its_old_block_in_the_bound_as_in_the_replay():
    # The last run's model (4 GiB) is still bound when the cell runs again; the cell builds a new one
    # (100 MiB, fixed), the old one goes as the name is bound again, then 100 MiB per sample of activations.
    start = (StartSegment(1 << 34, False, ((4 * GiB, True),)),)
    old = start_keys(start)[1 << 34]
    events = [(ALLOC, 0, 100 * MiB, 0), (FREE, old, 0, 0), (ALLOC, 1, 100 * MiB, 0), (FREE, 1, 0, 0)]
    fitting = fitting_from_one(events, 1, start, 6 * GiB, batch_independent={0})
    assert fitting is not None
    largest = fitting.largest(1000)
    assert fitting.fits(largest) and not fitting.fits(largest + 1)
    # Held to the end, the old block would leave room for 19. One run fits 60; the runs after it 59: the
    # cleanup after the proving rerun empties the cache, so the user's next run starts with the old model's
    # segment returned (``test_next_run_starts_where_...``).
    assert largest == 59
    assert held_at_start(start) == {old: 4 * GiB}


def test_next_run_starts_where_the_last_left_the_allocator_and_frees_what_it_made():
    # The last run's model (100 MiB) is bound as the cell runs again: 4,000 MiB of activations come and go,
    # then the new model, then the old one goes. The first run fits; its new model lands in the activations'
    # cached segment and pins it, so even with the cache emptied after it (the cleanup after the rerun) the
    # next run's activations need a segment of their own beside it: 8,000 MiB under a 6 GiB cap.
    start = (StartSegment(1 << 34, False, ((100 * MiB, True),)),)
    old = start_keys(start)[1 << 34]
    events = [(ALLOC, 1, 4000 * MiB, 0), (FREE, 1, 0, 0), (ALLOC, 0, 100 * MiB, 0), (FREE, old, 0, 0)]
    assert fits_in_a_row(events, start, 6 * GiB, runs=1)
    assert not fits_in_a_row(events, start, 6 * GiB, runs=2)
    # The next run frees the model this run made (key 0) where this run freed the old one.
    assert next_run(events, held_at_start(start))[3] == (FREE, _CARRIED - 0, 0, 0)
    smaller = [(ALLOC, 1, 3000 * MiB, 0), (FREE, 1, 0, 0), (ALLOC, 0, 100 * MiB, 0), (FREE, old, 0, 0)]
    assert fits_in_a_row(smaller, start, 6 * GiB)


def test_what_a_run_made_and_kept_is_not_made_again_by_the_next():
    # A first step's optimizer state (key 1) is made once and kept: the next run holds it, makes no second copy.
    events = [(ALLOC, 0, 3 * GiB, 0), (FREE, 0, 0, 0), (ALLOC, 1, 2 * GiB, 0)]
    assert next_run(events, {}) == events[:2]
    assert fits_in_a_row(events, (), 6 * GiB)


def test_the_state_a_step_made_where_the_held_state_was_released_stays_for_the_next_run():
    # The put-back held the last run's AdamW state (2 GiB) until the step began; the step released it and
    # made its own (key 1). The cell's next run neither frees the old nor makes a new one: its step updates
    # the state in place, which it holds through its forward and backward passes.
    start = (StartSegment(1 << 34, False, ((2 * GiB, True),)),)
    held_state = start_keys(start)[1 << 34]
    events = [(ALLOC, 0, 3 * GiB, 0), (FREE, 0, 0, 0), (FREE, held_state, 0, 0), (ALLOC, 1, 2 * GiB, 0)]
    released = frozenset({held_state})
    assert next_run(events, held_at_start(start), released) == events[:2]
    # Paired as a value bound again, the new state would be freed and made anew by every next run.
    assert next_run(events, held_at_start(start))[2:] == [(FREE, _CARRIED - 1, 0, 0), (ALLOC, 1, 2 * GiB, 0)]
    assert fits_in_a_row(events, start, 6 * GiB, released=released)
    assert not fits_in_a_row(events, start, 5 * GiB - 1, released=released)


def test_the_next_run_frees_the_last_gradients_the_run_left_not_the_state_of_their_size():
    """A loop that zeroes its gradients before the backward pass, state made at its first step: both of the
    gradients' size, both left. The block a next run frees where this run freed the start's gradients is
    the last made of that size (the last iteration's gradients), so the next run holds one set, not two."""
    grad = 64 * 2**20
    held = {-1: grad}                        # the last run's gradients
    events = [(ALLOC, 0, 512 * 2**20, 0),    # forward
              (FREE, -1, 0, 0),              # zero_grad
              (ALLOC, 1, grad, 0),           # backward: gradients
              (FREE, 0, 0, 0),
              (ALLOC, 2, grad, 0),           # the first step's state
              (ALLOC, 3, 512 * 2**20, 0),    # second iteration's forward
              (FREE, 1, 0, 0),               # zero_grad
              (ALLOC, 4, grad, 0),           # backward
              (FREE, 3, 0, 0)]
    again = next_run(events, held)
    assert (FREE, _CARRIED - 4, 0, 0) in again and (FREE, _CARRIED - 2, 0, 0) not in again
    assert (ALLOC, 2, grad, 0) not in again  # the state stays, not made again


def test_a_workspace_the_run_made_stays_for_the_next_run_not_made_in_place_of_a_small_block():
    """A run frees a small start block that nothing of its size replaces, and makes a library's workspace
    (a large block, cuBLAS's after the reruns renewed it) that it keeps. The next run keeps the workspace:
    a block of the other pool is another value, so it is not freed where the small one was and made again."""
    held = {-1: 512}
    workspace = 32 * MiB
    events = [(FREE, -1, 0, 0),                  # a small value the cell binds again, nothing made first
              (ALLOC, 0, 1200 * MiB, 0),         # an activation
              (ALLOC, 1, workspace, 0),          # the workspace, made at the first matmul and kept
              (FREE, 0, 0, 0)]
    again = next_run(events, held)
    assert (ALLOC, 1, workspace, 0) not in again and (FREE, _CARRIED - 1, 0, 0) not in again
    assert again == [(ALLOC, 0, 1200 * MiB, 0), (FREE, 0, 0, 0)]
