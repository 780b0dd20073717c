"""The simulated world's loops (``tests/oomfix/world.py``): what a run of a cell that loops over its step
allocates, as a real loop of a forward, backward and optimizer step would, and where its steps are marked."""

import dataclasses

import pytest

from tests.oomfix import world

pytestmark = pytest.mark.dependency_free

MiB = world.MiB
PARAMETERS = (64 * MiB, 32 * MiB)


def loop(steps: int, marked: bool = True, grads_kept: bool = False) -> world.Step:
    return world.Step(cap_bytes=8 * world.GiB, parameters=PARAMETERS, built_in_cell=False, training=True,
                      state_per_parameter=2, state_exists=False, grads_kept=grads_kept, temporaries=(0,),
                      input_per_sample=MiB, activations=((0.0, 3 * MiB),), workspace_bytes=0, noise=0.0,
                      steps=steps, marked=marked)


def made_within(events, span):
    first, after = span
    return sorted(size for kind, _, size, _ in events[first:after] if kind == "alloc")


def test_the_first_step_makes_the_state_and_every_later_one_holds_it():
    step = loop(3)
    events, stays = step.events(8, False, None)
    marks = step.marks(False)
    assert len(marks) == 3
    # AdamW's two moments of each parameter in the first step, with its foreach temporary; later steps
    # make only the temporary.
    assert made_within(events, marks[0]) == sorted([*PARAMETERS, *PARAMETERS, PARAMETERS[0]])
    assert made_within(events, marks[1]) == made_within(events, marks[2]) == [PARAMETERS[0]]
    freed = {key for kind, key, _, _ in events if kind == "free"}
    state = [key for kind, key, _, _ in events[marks[0][0]:marks[0][1]] if kind == "alloc" and key in stays]
    assert len(state) == 4 and not freed & set(state)
    # The gradients are made again in every pass (zero_grad(set_to_none=True) freed the last pass's).
    gradients = [size for kind, _, size, _ in events if kind == "alloc" and size in PARAMETERS]
    assert len(gradients) == 3 * len(PARAMETERS) + 4 + 3


def test_each_pass_input_is_freed_once_the_next_is_bound():
    events, _ = loop(2).events(8, False, None)
    inputs = [key for kind, key, size, _ in events if kind == "alloc" and size == 8 * MiB]
    assert len(inputs) == 2
    second_made = next(i for i, e in enumerate(events) if e[1] == inputs[1] and e[0] == "alloc")
    first_freed = next(i for i, e in enumerate(events) if e[1] == inputs[0] and e[0] == "free")
    assert first_freed == second_made + 1


def test_kept_gradients_are_made_once_and_left_for_the_next_run():
    events, stays = loop(3, grads_kept=True).events(8, False, None)
    gradients = [key for kind, key, size, _ in events if kind == "alloc" and size in PARAMETERS]
    assert len(gradients) == len(PARAMETERS) + 4 + 3  # one set of gradients, the state, three temporaries
    assert sum(stays.get(key) is not None for key in gradients) == len(PARAMETERS) + 4


def test_a_run_that_fails_keeps_the_marks_of_the_steps_it_began():
    step = loop(3)
    events, _ = step.events(8, False, None)
    second = step.marks(False)[1]
    cap = world.replay(events[:second[0] + 1], (), 10 * world.GiB).peak_allocated_bytes
    small = dataclasses.replace(step, cap_bytes=cap)
    failed = world.run(small, 8, False, None)
    assert not failed.fitted
    assert len(failed.recorded.steps) >= 1
    assert all(first < len(failed.recorded.events) for first, _ in failed.recorded.steps)
    assert all(after <= len(failed.recorded.events) for _, after in failed.recorded.steps)


def test_an_unmarked_run_has_no_marks_and_a_marked_single_step_one():
    assert loop(1, marked=False).marks(False) == ()
    assert len(loop(1).marks(False)) == 1
