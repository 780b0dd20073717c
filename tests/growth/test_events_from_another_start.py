"""A recorded run replayed from another start (``RecordedRun.events_from``): it lets go of what that start
holds where it let go of its own start's: the last run's optimizer state, which ``%oomfix``'s put-back holds
until the first step (``replay.with_released``), and the last run's values, where their names are bound
again (``replay.rebound_keys``)."""

from __future__ import annotations

from jupyter_cudamem.growth.fitting import fits_in_a_row
from jupyter_cudamem.growth.replay import ALLOC, FREE, StartSegment, keys_at, replay, start_keys, with_released
from jupyter_cudamem.growth.replay import RecordedRun
from jupyter_cudamem.units import GiB, MiB

WEIGHTS, STATE, OTHER_STATE = 1 << 34, 1 << 35, 1 << 36


def _start(state_at: int) -> tuple[StartSegment, ...]:
    return (StartSegment(WEIGHTS, False, ((1 * GiB, True),)), StartSegment(state_at, False, ((2 * GiB, True),)))


def test_the_frees_of_the_recorded_start_s_state_become_the_frees_of_the_other_start_s():
    events = [(ALLOC, 0, 100 * MiB, 0), (FREE, -2, 0, 0), (ALLOC, 1, 2 * GiB, 0), (FREE, 0, 0, 0)]
    assert with_released(events, {-2}, {-7}, at=2) == [
        (ALLOC, 0, 100 * MiB, 0), (FREE, -7, 0, 0), (ALLOC, 1, 2 * GiB, 0), (FREE, 0, 0, 0)]
    # A first step's run let nothing go: the other start's state goes before the step's first event.
    first = [(ALLOC, 0, 100 * MiB, 0), (ALLOC, 1, 2 * GiB, 0), (FREE, 0, 0, 0)]
    assert with_released(first, set(), {-7}, at=1) == [
        (ALLOC, 0, 100 * MiB, 0), (FREE, -7, 0, 0), (ALLOC, 1, 2 * GiB, 0), (FREE, 0, 0, 0)]


def test_a_first_step_s_run_replayed_where_the_state_is_held_lets_it_go_at_its_step():
    """A probe ran the cell's first step (no state at its start): the state its step made is left. The next
    try starts holding the state the put-back keeps until the step: replayed from there, the probe's run
    holds one copy of the state, not two, and keeps fitting run after run."""
    probe_start = (StartSegment(WEIGHTS, False, ((1 * GiB, True),)),)
    activations, state = 0, 1
    run = RecordedRun(start=probe_start,
                      events=((ALLOC, activations, 2 * GiB, 0), (FREE, activations, 0, 0), (ALLOC, state, 2 * GiB, 0)),
                      left=((OTHER_STATE, state),), steps=((2, 3),))
    next_start = _start(STATE)
    released = frozenset({STATE})
    events = run.events_from(next_start, released=released)
    held_state = start_keys(next_start)[STATE]
    assert events == [(ALLOC, activations, 2 * GiB, 0), (FREE, activations, 0, 0), (FREE, held_state, 0, 0),
                      (ALLOC, state, 2 * GiB, 0)]
    keys = keys_at(next_start, released)
    assert fits_in_a_row(events, next_start, 5 * GiB, released=keys)
    assert not fits_in_a_row(run.events_from(next_start), next_start, 5 * GiB, released=keys)  # two copies


def test_a_run_that_let_its_own_start_s_state_go_lets_the_other_start_s_go_instead():
    start = _start(STATE)
    own_state = start_keys(start)[STATE]
    run = RecordedRun(start=start,
                      events=((ALLOC, 0, 2 * GiB, 0), (FREE, 0, 0, 0), (FREE, own_state, 0, 0), (ALLOC, 1, 2 * GiB, 0)),
                      left=((STATE, 1),), steps=((3, 4),), released=frozenset({STATE}))
    # From its own start: as recorded, the state made anew where it was.
    assert run.events_from(start, released=frozenset({STATE})) == list(run.events)
    # From a start whose state lies elsewhere, beside a block that takes the run's own state's key there:
    # its state goes, and that block stays.
    other = (StartSegment(1 << 37, False, ((512 * MiB, True),)), *_start(OTHER_STATE))
    keys = start_keys(other)
    assert keys[WEIGHTS] == own_state
    events = run.events_from(other, released=frozenset({OTHER_STATE}))
    assert events[2] == (FREE, keys[OTHER_STATE], 0, 0)
    assert (FREE, own_state, 0, 0) not in events


def test_a_loop_lets_the_last_run_s_output_go_where_it_binds_the_name_the_first_time():
    """``for step in range(3): out = f(x)``: the last run's output goes at the first iteration's binding, not at
    the last one's (which made the block the run left where the next start holds the output)."""
    old_output, other_output = 1 << 34, 1 << 36
    start = (StartSegment(old_output, False, ((1 * GiB, True),)),)
    own = start_keys(start)[old_output]
    events = ((ALLOC, 0, 1 * GiB, 0), (FREE, own, 0, 0),   # the first binding lets the old output go
              (ALLOC, 1, 1 * GiB, 0), (FREE, 0, 0, 0),
              (ALLOC, 2, 1 * GiB, 0), (FREE, 1, 0, 0))
    run = RecordedRun(start=start, events=events, left=((other_output, 2),), remade=(frozenset({old_output}),))
    # From a start holding the output the run left, 1 GiB at another address.
    next_start = (StartSegment(other_output, False, ((1 * GiB, True),)),)
    held = start_keys(next_start)[other_output]
    made = run.events_from(next_start, (frozenset({other_output}),))
    assert made[:2] == [(ALLOC, 0, 1 * GiB, 0), (FREE, held, 0, 0)]
    assert (ALLOC, 2, 1 * GiB, 0) in made  # the new output is made where the old one was
    assert replay(made, next_start, 2 * GiB).fits
    # A run whose start held no output (set aside before the first try) shows no binding to go by: the old
    # output goes when the block the run left where it lies is made, and the loop holds two outputs and
    # makes a third: three under a cap of two.
    first_try = RecordedRun(start=(), events=tuple(e for e in events if e[1] != own), left=((other_output, 2),))
    late = first_try.events_from(next_start, (frozenset({other_output}),))
    assert late[3:5] == [(ALLOC, 2, 1 * GiB, 0), (FREE, held, 0, 0)]
    assert not replay(late, next_start, 2 * GiB).fits


def test_a_window_of_a_long_run_lets_the_held_state_go_before_it_begins():
    """A window (``whole=False``) is recorded after the cell's first step: the state the put-back held went
    then, before the window's own events (the prologue that remakes what the run held when it began)."""
    start = _start(STATE)
    window = RecordedRun(start=start, events=((ALLOC, 0, 2 * GiB, 0), (ALLOC, 1, 1 * GiB, 0), (FREE, 1, 0, 0)),
                         whole=False, carried=frozenset({0}), steps=((2, 3),))
    events = window.events_from(start, released=frozenset({STATE}))
    assert events[0] == (FREE, start_keys(start)[STATE], 0, 0)
    assert replay(events, start, 4 * GiB).fits  # the weights, the state the window carries, one step's temporary


def test_a_loop_that_zeroes_its_gradients_first_lets_the_other_start_s_gradients_go():
    """``zero_grad()`` before the backward pass: the last run's gradients are in the start, the run frees
    them and leaves its own. Replayed from the start after it (which holds those, beside a smaller block
    of another batch's value that shifts every larger block's key), it frees the gradients that start
    holds, once, and peaks where it peaked from its own."""
    old_grad, new_grad, small_value = 1 << 34, 1 << 35, 1 << 33
    start = (StartSegment(WEIGHTS, False, ((1 * GiB, True),)), StartSegment(old_grad, False, ((1 * GiB, True),)))
    own = start_keys(start)
    events = ((ALLOC, 0, 2 * GiB, 0),              # the forward's activations
              (FREE, own[old_grad], 0, 0),         # zero_grad: the last run's gradients go
              (ALLOC, 1, 1 * GiB, 0),              # the backward makes new ones
              (FREE, 0, 0, 0))
    run = RecordedRun(start=start, events=events, left=((new_grad, 1),))
    after = (StartSegment(small_value, False, ((20 * MiB, True),)),
             StartSegment(WEIGHTS, False, ((1 * GiB, True),)), StartSegment(new_grad, False, ((1 * GiB, True),)))
    there = start_keys(after)
    assert there[WEIGHTS] == own[old_grad]  # by key alone the run would free the weights
    made = run.events_from(after)
    assert (FREE, there[new_grad], 0, 0) in made and (FREE, there[WEIGHTS], 0, 0) not in made
    assert (ALLOC, 1, 1 * GiB, 0) in made  # made anew, not taken as held
    own_peak = replay(list(events), start, 8 * GiB).peak_allocated_bytes
    assert replay(made, after, 8 * GiB).peak_allocated_bytes == own_peak + 20 * MiB


def test_the_other_start_s_keys_are_given_where_the_recorded_state_is_let_go_not_before():
    """An image in the other start may be the number of a recorded state's key: it is freed all the same."""
    events = [(ALLOC, 0, 100 * MiB, 0), (FREE, -3, 0, 0), (FREE, -2, 0, 0), (ALLOC, 1, 2 * GiB, 0)]
    assert with_released(events, {-2}, {-7}, at=3, keys={-3: -2}) == [
        (ALLOC, 0, 100 * MiB, 0), (FREE, -2, 0, 0), (FREE, -7, 0, 0), (ALLOC, 1, 2 * GiB, 0)]
