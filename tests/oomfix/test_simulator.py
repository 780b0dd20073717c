"""``%oomfix``'s batch search against a randomized world that spans where users are (tests/oomfix/world.py):
largest fitting batch 1 to 100,000, batch-independent memory 0 to 90% of the card, the model built in the
cell or earlier, optimizer state made at the first step, loops of 1 to 4 steps a run, the optimizer's steps
marked in four fifths of the training runs (as a torch optimizer's hooks mark them), library workspaces that
change between runs, start ratios 1.05 to 100, every run played through the project's model of PyTorch's
caching allocator.

The goal (issues "where large models meet small batches" and "a fix that holds"): found >= largest - 1 where
the largest is 10 or less, else >= 0.90 of it, and never above the largest batch that keeps fitting (above
it the next runs fail), within 3 reruns, in 99% of models, at most 0.5% below halving. The truth is the steady
one: the largest batch whose run fits and so do the two after it, the first of them from its end with the
cache emptied, the next from where it left the allocator (``world.largest_fitting``); halving ends on the first halved batch that keeps fitting. This test
runs 10,000 models of its own seed, on every core (``world.many_cases``), and holds the search where it was
measured on them: 9,422 meet the goal (94.2%): 371 end above the largest batch that keeps fitting (their
last try fitted once, the runs after it do not); 70 end below halving where halving's end keeps fitting
(0.70%: issue 40 asks at most 0.5%, not met), 43 of them outside the goal. Counted as the sweep counts it: a
halving end above the largest batch that keeps fitting is no bar. Before the world drew loops and marked
steps (2026-11-30): 9,508, 316 above, 41 below halving (17 outside the goal); with loops and no marks, 102
below halving. A change that loses ground fails here.
"""

import statistics

import pytest

from tests.oomfix import superlinear, world

# Pure arithmetic over the simulated worlds: no library whose version `make test-min` changes runs here.
pytestmark = pytest.mark.dependency_free

MODELS = 10_000


def test_the_search_holds_its_measured_ground_across_the_space():
    cases = world.many_cases(MODELS, seed=7)
    assert len(cases) == MODELS
    met = sum(case.met_goal for case in cases)
    below_halving_and_goal = sum(case.worse_than_halving and not case.met_goal for case in cases)
    assert all(case.reruns <= 3 for case in cases)
    assert met >= 9_422, met
    assert below_halving_and_goal <= 43, below_halving_and_goal
    assert sum(case.worse_than_halving for case in cases) <= 70  # 0.70%: issue 40 asks at most 0.5%
    assert sum(case.found > case.largest for case in cases) <= 371
    small = [case.found / case.largest for case in cases if 10 < case.largest <= 64]
    heavy = [case.found / case.largest for case in cases if case.fixed_share >= 0.5]
    assert statistics.median(small) >= 0.98 and statistics.median(heavy) >= 0.98


def test_a_search_told_where_halving_ends_ends_there():
    # Halving ends on a batch that keeps fitting with its run's workspace, so a search told it, trying it up
    # to three times with the same draws, ends on it; one told the largest batch that keeps fitting (twice,
    # then the largest that fits with the largest workspace) never passes it. Measured on these 2,000: none
    # below halving (when halving was judged by one run, 1: its last run could fit a batch most draws fail).
    told = world.many_told(2_000, seed=7)
    assert all(case.given_halving in (0, case.halving) for case in told)
    assert all(case.given_largest <= case.largest for case in told)
    assert not [case for case in told if case.given_halving < case.halving]


def test_without_the_allocator_history_the_line_decides_within_three_reruns():
    # An old torch, or the user's own recording: only the line through the measured peaks. It cannot see
    # the phases of a step (a flat optimizer step under a steep backward pass), nor a loop's steps, and lands
    # lower: measured on these 300, a median of 0.67 of the largest batch (0.73 before the world drew loops;
    # benchmarks/oomfix_simulated.py measures it on 2,000 of its own seed).
    cases = world.cases(300, seed=11, recorded=False)
    assert all(case.reruns <= 3 and case.found >= 1 for case in cases)
    assert statistics.median(case.found / case.largest for case in cases) >= 0.67


def test_where_memory_grows_with_the_square_of_the_batch_the_search_follows_it():
    # Contrastive losses, attention across the batch (tests/oomfix/superlinear.py): measured on these 2,000,
    # all meet the goal and two end below halving (within 3% of the largest batch, where halving landed on
    # or next to it); before a failed try's requests were replayed and a request growing with a power of the
    # batch was put on that power, 134 met it and 1,736 ended below halving (a median of 0.24 of the largest).
    cases = superlinear.cases(2_000, seed=5)
    assert all(case.reruns <= 3 for case in cases)
    assert sum(case.met_goal for case in cases) >= 1_995
    assert sum(case.worse_than_halving for case in cases) <= 3
    assert statistics.median(case.found / case.largest for case in cases) >= 0.97
