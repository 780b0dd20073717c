"""``%oomfix``'s batch search against a randomized world that spans where users are (tests/oomfix/world.py):
largest fitting batch 1 to 100,000, batch-independent memory 0 to 90% of the card, the model built in the
cell or earlier, optimizer state made at the first step, library workspaces that change between runs,
start ratios 1.05 to 100, every run played through the project's model of PyTorch's caching allocator.

The goal (issue "where large models meet small batches"): found >= largest - 1 where the largest is 10 or
less, else >= 0.90 of it, within 3 reruns, in 99% of models, none below halving. The first half is met, the
second not: ``benchmarks/oomfix_simulated.py`` runs 10,000 such models of its own seed
(``benchmarks/results/oomfix_simulated.json`` says how many meet it and end below halving). This test runs
10,000 of another seed, on every core (``world.many_cases``), and holds the search where it was measured on
them: 9,936 meet the goal (99.4%; 9,923 before a failed try's own requests were replayed, 9,890 before a
predicted batch had to fit at its line's own sizes too, 9,877 before the replay paired leftover requests by
size); 40 end below halving (53 before a failed try's requests were replayed; 143 before those changes and
the last rerun's try of halving's batch where it fits with no margin; 82 before that try was made, by the
replay, whatever fitted below it, and before a weight-sized activation's gradient made after the last
parameter's was kept growing with the batch), 23 of them within the goal (a start near a power of two times
the largest batch lets halving land on or next to it; in 4 halving's run drew a smaller workspace and fitted
above the largest batch that fits without the jitter), 17 below it. A change that loses ground fails here.

"None below halving" cannot be held in this world by any search of three reruns: halving's last run can fit a
batch that most workspace draws fail, and a search told where halving ends, trying it three times, still ends
below it in some models (``test_even_a_search_told_where_halving_ends_can_end_below_it``).
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
    assert met >= 9_933, met
    assert below_halving_and_goal <= 19, below_halving_and_goal
    assert sum(case.worse_than_halving for case in cases) <= 42
    small = [case.found / case.largest for case in cases if 10 < case.largest <= 64]
    heavy = [case.found / case.largest for case in cases if case.fixed_share >= 0.5]
    assert statistics.median(small) >= 0.98 and statistics.median(heavy) >= 0.98


def test_even_a_search_told_where_halving_ends_can_end_below_it():
    # Why "none below halving" is not held above: a run's workspace is drawn anew (another algorithm), and
    # the allocator is not monotone in it, so halving's last run can fit a batch that fails with most draws.
    # A search told halving's own end, trying it up to three times, still ends below halving in some models
    # (measured: 1 of these 2,000; 1 of 10,000 of seeds 2026 and 7); one told the largest batch that fits
    # without the jitter (twice, then the largest that fits with the largest workspace) in more (5; 34 of
    # 10,000 of either seed, where the search ends below halving in 43 and 40).
    told = world.many_told(2_000, seed=7)
    assert all(case.given_halving in (0, case.halving) for case in told)
    assert all(case.given_largest <= case.largest for case in told)
    below = [case for case in told if case.given_halving < case.halving]
    assert below and all(case.halving > case.largest for case in below)


def test_without_the_allocator_history_the_line_decides_within_three_reruns():
    # An old torch, or the user's own recording: only the line through the measured peaks. It cannot see
    # the phases of a step (a flat optimizer step under a steep backward pass), and lands lower: measured
    # on these 300, a median of 0.73 of the largest batch (benchmarks/oomfix_simulated.py measures it on
    # 2,000 of its own seed).
    cases = world.cases(300, seed=11, recorded=False)
    assert all(case.reruns <= 3 and case.found >= 1 for case in cases)
    assert statistics.median(case.found / case.largest for case in cases) >= 0.70


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
