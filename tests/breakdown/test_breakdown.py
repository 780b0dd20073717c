"""``breakdown``: the tracker's figures made to sum to the allocator's peak (pure arithmetic)."""

from __future__ import annotations

from jupyter_cudamem.breakdown import (
    OTHER_MODULE,
    Category,
    Phase,
    TrackedPeak,
    breakdown_at_peak,
    breakdowns_for,
)
import pytest

# Nothing here runs a library whose version `make test-min` changes (tests/versioned.py).
pytestmark = pytest.mark.dependency_free

MiB = 1024**2


def tracked(held, phase=Phase.BACKWARD, device="cuda:0"):
    return TrackedPeak(device=device, held=held, phase=phase)


def test_other_takes_what_the_tracker_did_not_see():
    seen = tracked({
        (Category.PARAMETERS, "model.encoder"): 40 * MiB,
        (Category.ACTIVATIONS, "model.encoder"): 30 * MiB,
        (Category.GRADIENTS, "model.head"): 5 * MiB,
        (Category.TEMPORARIES, ""): 10 * MiB,
    })
    breakdown = breakdown_at_peak(100 * MiB, seen)
    assert breakdown.categories == {
        Category.PARAMETERS: 40 * MiB,
        Category.GRADIENTS: 5 * MiB,
        Category.OPTIMIZER_STATE: 0,
        Category.ACTIVATIONS: 30 * MiB,
        Category.TEMPORARIES: 10 * MiB,
        Category.OTHER: 15 * MiB,  # 100 - 85
    }
    # modules: the encoder 70, the head 5, and "other" the temporaries of no module plus the 15 unseen
    assert breakdown.modules == {"model.encoder": 70 * MiB, "model.head": 5 * MiB, OTHER_MODULE: 25 * MiB}
    assert list(breakdown.modules)[-1] == OTHER_MODULE
    assert breakdown.tracked_bytes == 85 * MiB and not breakdown.scaled
    assert breakdown.dominant is Category.PARAMETERS
    assert breakdown.phase is Phase.BACKWARD


def test_the_trackers_own_other_is_not_counted_twice():
    # 20 MiB of inputs made outside any model are in the allocator's peak already
    seen = tracked({(Category.OTHER, ""): 20 * MiB, (Category.PARAMETERS, "m"): 30 * MiB})
    breakdown = breakdown_at_peak(60 * MiB, seen)
    assert breakdown.categories[Category.OTHER] == 30 * MiB
    assert breakdown.categories[Category.PARAMETERS] == 30 * MiB
    assert sum(breakdown.categories.values()) == 60 * MiB


def test_more_tracked_than_the_peak_is_scaled_down_to_it_exactly():
    # a peak counter not reset for the cell can read below what the tracker counted
    seen = tracked({(Category.PARAMETERS, "m"): 3, (Category.ACTIVATIONS, "m"): 3, (Category.TEMPORARIES, ""): 3})
    breakdown = breakdown_at_peak(7, seen)
    assert breakdown.scaled and breakdown.tracked_bytes == 9
    categories = breakdown.categories
    assert sum(categories.values()) == 7 and categories[Category.OTHER] == 0
    # 7/9 of 3 is 2.33 each: two get 2 and the leftover byte goes to one of them
    assert sorted(categories[c] for c in (Category.PARAMETERS, Category.ACTIVATIONS, Category.TEMPORARIES)) == [2, 2, 3]


def test_modules_beyond_the_largest_join_other():
    held = {(Category.PARAMETERS, f"model.layer{i}"): (i + 1) * MiB for i in range(5)}
    breakdown = breakdown_at_peak(20 * MiB, tracked(held), max_modules=2)
    assert breakdown.modules == {"model.layer4": 5 * MiB, "model.layer3": 4 * MiB, OTHER_MODULE: 11 * MiB}
    assert breakdown.categories[Category.PARAMETERS] == 15 * MiB  # folding moves rows, not categories


def test_as_dict_names_every_category_and_the_expected_model_state():
    seen = TrackedPeak("cuda:0", {(Category.OPTIMIZER_STATE, "m"): 8}, Phase.OPTIMIZER_STEP,
                       expected={Category.PARAMETERS: 4, Category.OPTIMIZER_STATE: 8})
    record = breakdown_at_peak(16, seen).as_dict()
    assert record["categories"] == {"parameters": 0, "gradients": 0, "optimizer_state": 8, "activations": 0,
                                    "temporaries": 0, "other": 8}
    assert record["expected"] == {"parameters": 4, "gradients": 0, "optimizer_state": 8}
    assert record["phase"] == "optimizer step"


def test_breakdowns_pair_devices_by_name_or_one_to_one():
    one = tracked({(Category.PARAMETERS, "m"): 4}, device="cpu")
    [paired] = breakdowns_for({"cuda:0": 10}, {"cpu": one})
    assert paired.peak_bytes == 10
    two = {"cuda:0": tracked({}, device="cuda:0"), "cuda:1": tracked({(Category.PARAMETERS, "m"): 4}, device="cuda:1")}
    found = breakdowns_for({"cuda:1": 10, "cuda:2": 5}, two)
    assert [b.device for b in found] == ["cuda:1", "cuda:2"]
    # cuda:2 had a peak but no tensor the tracker saw: all of it is other
    assert found[1].categories[Category.OTHER] == 5 and found[1].tracked_bytes == 0
    [nothing] = breakdowns_for({"cuda:0": 7}, {})
    assert nothing.categories[Category.OTHER] == 7 and nothing.phase is Phase.OUTSIDE


def test_other_is_split_into_outside_models_before_the_cell_and_unseen():
    # 100 MiB peak; the tracker saw 50 of parameters (30 of them bound to names as the cell started) and
    # 12 of inputs outside any model; 40 MiB were allocated at the start: 30 of the model, 10 of data
    seen = TrackedPeak("cuda:0", {(Category.PARAMETERS, "m"): 50 * MiB, (Category.OTHER, ""): 12 * MiB},
                       Phase.FORWARD, tracked_at_start=30 * MiB)
    breakdown = breakdown_at_peak(100 * MiB, seen, allocated_at_start=40 * MiB)
    assert breakdown.categories[Category.OTHER] == 50 * MiB
    parts = breakdown.other_parts
    assert (parts.outside_models, parts.before_cell, parts.unseen) == (12 * MiB, 10 * MiB, 28 * MiB)
    assert breakdown_at_peak(100 * MiB, seen).other_parts is None


def test_other_parts_never_exceed_other():
    # more allocated before the cell than the rest can hold: the parts are capped, unseen is 0
    seen = TrackedPeak("cuda:0", {(Category.PARAMETERS, "m"): 90, (Category.OTHER, ""): 4}, Phase.FORWARD)
    parts = breakdown_at_peak(100, seen, allocated_at_start=50).other_parts
    assert (parts.outside_models, parts.before_cell, parts.unseen) == (4, 6, 0)
