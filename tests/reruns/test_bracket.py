"""The plan's calibration search (reruns/bracket.py) on a cell whose largest fitting batch is known."""

from jupyter_cudamem.reruns.bracket import bracket_largest
import pytest

# Nothing here runs a library whose version `make test-min` changes (tests/versioned.py).
pytestmark = pytest.mark.dependency_free


def runs_of(largest: int):
    tried = []

    def fits(batch: int) -> bool:
        tried.append(batch)
        return batch <= largest

    return fits, tried


def test_steps_up_from_a_low_guess_then_bisects_to_the_resolution():
    fits, tried = runs_of(300)
    found = bracket_largest(fits, 200, max_runs=12, step=1.25, resolution=0.005)
    # 200 fits, 250 fits, 312 fails; then halving the gap: 281, 296, 304, 300, 302, 301
    assert tried == [200, 250, 312, 281, 296, 304, 300, 302, 301]
    assert (found.fitted, found.failed, found.runs) == (300, 301, 9)


def test_steps_down_from_a_high_guess_and_stops_at_its_run_budget():
    fits, tried = runs_of(100)
    found = bracket_largest(fits, 1000, max_runs=4, step=1.25, resolution=0.005)
    assert tried == [1000, 800, 640, 512]
    assert (found.fitted, found.failed, found.runs) == (None, 512, 4)


def test_an_error_ends_the_search_with_what_it_knew():
    def fits(batch: int):
        return None if batch > 120 else True

    found = bracket_largest(fits, 100, max_runs=12, step=1.25, resolution=0.005)
    assert (found.fitted, found.failed, found.runs) == (100, None, 2)


def test_a_batch_of_one_that_fails_ends_it():
    found = bracket_largest(lambda batch: False, 1, max_runs=12, step=1.25, resolution=0.005)
    assert (found.fitted, found.failed, found.runs) == (None, 1, 1)
