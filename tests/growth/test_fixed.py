"""Which requests of one recorded run do not grow with the batch (growth/line.py), on runs written out by
hand: a model of two weights, 4 MiB and 1 MiB, trained by an AdamW-like optimizer (two state tensors each)."""

from jupyter_cudamem.growth import FixedMemory, batch_independent_requests
import pytest

# Nothing here runs a library whose version `make test-min` changes (tests/versioned.py).
pytestmark = pytest.mark.dependency_free

MiB = 2**20
W1, W2 = 4 * MiB, 1 * MiB


def training(built: bool = False, trains: bool = True, state_made: bool = True) -> FixedMemory:
    return FixedMemory(
        parameters_bytes=W1 + W2 if built else 0,
        gradients_bytes=W1 + W2,
        optimizer_state_bytes=2 * (W1 + W2) if state_made else 0,
        tensor_bytes=frozenset({W1, W2}),
        gradient_sizes=(W1, W2) if trains else (),
        state_sizes=(W1, W1, W2, W2) if state_made else (),
        built_sizes=(W1, W2) if built else (),
        trains=trains,
    )


# Batch 1 of a transformer whose sequence is as long as it is wide: the activation (key 1) and its gradient
# (key 3) are the size of the 4 MiB weight. The weights' gradients are keys 4 and 5, the step makes state
# (6-9, left allocated) and a foreach temporary (10), and zero_grad frees the gradients at the end.
RUN = [
    ("alloc", 0, 3 * MiB, 0),   # the input: not a parameter's size
    ("alloc", 1, W1, 0),        # an activation the size of W1
    ("alloc", 2, 3 * MiB, 0),   # the loss's graph
    ("alloc", 3, W1, 0),        # the activation's gradient
    ("free", 2, 0, 0),
    ("alloc", 4, W1, 0),        # W1's gradient
    ("free", 3, 0, 0),
    ("free", 1, 0, 0),
    ("alloc", 5, W2, 0),        # W2's gradient
    ("free", 0, 0, 0),
    ("alloc", 6, W1, 0), ("alloc", 7, W1, 0), ("alloc", 8, W2, 0), ("alloc", 9, W2, 0),  # AdamW's state
    ("alloc", 10, W1, 0),       # a foreach temporary
    ("free", 10, 0, 0),
    ("free", 4, 0, 0), ("free", 5, 0, 0),  # zero_grad(set_to_none=True)
]
LEFT = {6, 7, 8, 9}


def test_the_gradients_freed_last_the_state_left_and_the_step_s_temporary_are_fixed_the_weight_sized_activation_is_not():
    assert batch_independent_requests(RUN, LEFT, training()) == {4, 5, 6, 7, 8, 9, 10}


def test_gradients_the_run_left_allocated_count_against_those_it_creates():
    # The same run without zero_grad at its end: W1's and W2's gradients are left with the state. No other
    # request of W1's size is a gradient, so the activation and its gradient still grow with the batch.
    kept = [event for event in RUN if event not in (("free", 4, 0, 0), ("free", 5, 0, 0))]
    assert batch_independent_requests(kept, LEFT | {4, 5}, training()) == {4, 5, 6, 7, 8, 9, 10}


def test_a_model_built_in_the_cell_is_fixed_and_is_not_taken_for_a_kept_gradient():
    built = [("alloc", 20, W1, 0), ("alloc", 21, W2, 0)] + RUN
    assert batch_independent_requests(built, LEFT | {20, 21}, training(built=True)) == {4, 5, 6, 7, 8, 9, 10, 20, 21}


def test_without_training_only_what_the_run_left_is_fixed():
    # Inference: no gradient is expected, so nothing freed is taken as one, whatever its size.
    assert batch_independent_requests(RUN, LEFT, training(trains=False)) == {6, 7, 8, 9}


def test_a_weight_sized_activation_s_gradient_after_the_last_parameter_gradient_still_grows():
    # The first layer's input gradient comes last in the backward pass: here after W2's gradient (key 5),
    # the size of W1, and freed before the step makes its state. Only the state and the step's temporary
    # after it are the step's.
    late = [
        ("alloc", 1, W1, 0),        # an activation the size of W1
        ("alloc", 4, W1, 0),        # W1's gradient
        ("alloc", 5, W2, 0),        # W2's gradient
        ("alloc", 3, W1, 0),        # the activation's gradient, after the last parameter's
        ("free", 1, 0, 0), ("free", 3, 0, 0),
        ("alloc", 6, W1, 0), ("alloc", 7, W1, 0), ("alloc", 8, W2, 0), ("alloc", 9, W2, 0),  # AdamW's state
        ("alloc", 10, W1, 0), ("free", 10, 0, 0),  # a foreach temporary
        ("free", 4, 0, 0), ("free", 5, 0, 0),
    ]
    assert batch_independent_requests(late, LEFT, training()) == {4, 5, 6, 7, 8, 9, 10}


def test_without_state_made_in_the_run_what_follows_the_last_gradient_is_the_step_s():
    # The state existed before the run (a later step): the foreach temporary after the last gradient is fixed.
    later_step = [("alloc", 1, W1, 0), ("alloc", 4, W1, 0), ("free", 1, 0, 0), ("alloc", 5, W2, 0),
                  ("alloc", 10, W1, 0), ("free", 10, 0, 0), ("free", 4, 0, 0), ("free", 5, 0, 0)]
    assert batch_independent_requests(later_step, set(), training(state_made=False)) == {4, 5, 10}


def test_without_state_made_an_activation_s_gradient_made_while_the_backward_pass_frees_activations_still_grows():
    # The state existed before the run; the last parameter's gradient (W2's) comes before the gradient of
    # an activation the size of W1, made while that activation lives: it grows with the batch. The foreach
    # temporary, made once the backward pass freed the activation, is the step's.
    late = [("alloc", 1, W1, 0), ("alloc", 4, W1, 0), ("alloc", 5, W2, 0),
            ("alloc", 3, W1, 0),        # the activation's gradient, after the last parameter's
            ("free", 1, 0, 0), ("free", 3, 0, 0),
            ("alloc", 10, W1, 0), ("free", 10, 0, 0),  # a foreach temporary
            ("free", 4, 0, 0), ("free", 5, 0, 0)]
    assert batch_independent_requests(late, set(), training(state_made=False)) == {4, 5, 10}
