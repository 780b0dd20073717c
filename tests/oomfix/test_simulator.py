"""``%oomfix``'s batch search against a randomized world that spans where users are (tests/oomfix/world.py):
largest fitting batch 1 to 100,000, batch-independent memory 0 to 90% of the card, the model built in the
cell or earlier, optimizer state made at the first step, library workspaces that change between runs,
start ratios 1.05 to 100, every run played through the project's model of PyTorch's caching allocator.

The goal (issue "where large models meet small batches"): found >= largest - 1 where the largest is 10
or less, else >= 0.90 of it, within 3 reruns, in 99% of models, none below halving. Not met yet:
``benchmarks/oomfix_simulated.py`` runs 10,000 such models (``benchmarks/results/oomfix_simulated.json``:
98.7% meet it, 1.5% end below halving, median 0.985). This test runs 1,500 of another seed (98.9%, 20
below halving, measured) and holds the search there, so that a change that loses ground fails here.
"""

import statistics

from tests.oomfix import world

MODELS = 1500


def test_the_search_holds_its_measured_ground_across_the_space():
    cases = world.cases(MODELS, seed=7)
    met = sum(case.met_goal for case in cases) / len(cases)
    worse = sum(case.worse_than_halving for case in cases)
    assert all(case.reruns <= 3 for case in cases)
    assert met >= 0.985, met
    assert worse <= 0.015 * len(cases), worse
    small = [case.found / case.largest for case in cases if 10 < case.largest <= 64]
    heavy = [case.found / case.largest for case in cases if case.fixed_share >= 0.5]
    assert statistics.median(small) >= 0.95 and statistics.median(heavy) >= 0.95


def test_without_the_allocator_history_the_line_decides_within_three_reruns():
    # An old torch, or the user's own recording: only the line through the measured peaks. It cannot see
    # the phases of a step (a flat optimizer step under a steep backward pass), and lands lower: measured
    # by benchmarks/oomfix_simulated.py, a median of 0.63 of the largest batch on this world (0.59 on these).
    cases = world.cases(300, seed=11, recorded=False)
    assert all(case.reruns <= 3 and case.found >= 1 for case in cases)
    assert statistics.median(case.found / case.largest for case in cases) >= 0.55
