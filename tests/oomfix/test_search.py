"""The batch-size search policy against simulated memory models (jupyter_cudamem/batchsearch.py, growth/).

The models (``tests/oomfix/simulated.MemoryModel``) have a batch-independent part (half allocated
before the batch's tensors, half after, as a model built in the cell and its optimizer state are), a
few batch-sized tensors of random sizes, each rounded up to the allocator's 2 MiB blocks, and a 0.2%
jitter between runs. A failure reports what it held and what it asked for, as an OOM message does.

Measured with this file's grid (budget 6 GiB; largest fitting batch 40 to 20000; 1 to 20 tensors;
``grid`` below, 6 seeds a cell):
- fixed part 0-30% of the budget, starts 1.5x-64x (the goal's region): min 0.91, median 0.95, every
  case at 0.90 or better, at most 3 reruns, 2 when the fixed part is ~0 and the probe is large
  enough for rounding not to matter (the first prediction holds);
- fixed part 45-60%, starts 1.2x-2x: min 0.58, median 0.85 (1.5x-64x: min 0.60, median 0.90). The
  probe must fit at 64x, so at a low start it is 1/40-1/80 of the largest fitting batch; the surest
  batch from it is then only 1/f times larger, and two peaks 30-100 MiB apart give a slope that the
  allocator's rounding leaves 10-25% uncertain; the third try takes the steep end of that and lands low;
- starts of 200x (fixed 0-60%): median 0.95, min 0.19: the first probe fails, the second probe
  (8x lower) fits, and with a large fixed part the surest batch from it is the last try;
- the whole grid (fixed 0-60%, starts 1.2x-200x): median 0.93; never a batch that does not fit.
"""

from __future__ import annotations

import random
import statistics

import pytest

from jupyter_cudamem.growth import Growth, fit, lowest_slope, through_origin
from jupyter_cudamem.batchsearch import BatchSearch, Observation
from tests.fakes import GiB, MiB
from tests.oomfix.simulated import MemoryModel, run_search, search_outcome

BUDGET = 6 * GiB


def model_for(fixed_fraction: float, largest: int, tensors: int, seed: int, noise: float = 0.002) -> MemoryModel:
    rng = random.Random(seed)
    weights = [rng.uniform(0.2, 1.0) for _ in range(tensors)]
    per_sample = (1 - fixed_fraction) * BUDGET / largest
    return MemoryModel(fixed_fraction * BUDGET, [per_sample * w / sum(weights) for w in weights], BUDGET,
                       noise=noise, seed=seed)


def grid(fractions, ratios, seeds=range(6)):
    """``(fraction, ratio, quality, reruns, fits)`` for every case of the grid."""
    cases = []
    for fraction in fractions:
        for ratio in ratios:
            for seed in seeds:
                rng = random.Random(hash((fraction, ratio, seed)) & 0xFFFF)
                model = model_for(fraction, rng.choice([40, 300, 2000, 20000]), rng.choice([1, 3, 8, 20]), seed)
                true = model.largest_fitting(10**7)
                start = max(int(true * ratio), true + 1)
                found, reruns, _ = search_outcome(model, start, BUDGET)
                cases.append((fraction, ratio, (found or 0) / true, reruns, found is None or model.fits(found)))
    return cases


def test_the_goal_holds_where_the_fixed_part_is_up_to_30_percent():
    cases = grid([0.0, 0.1, 0.3], [1.5, 4, 16, 64])
    qualities = [q for _, _, q, _, _ in cases]
    assert all(reruns <= 3 for *_, reruns, _ in cases)
    assert all(fits for *_, fits in cases)
    assert min(qualities) >= 0.90, sorted(cases, key=lambda c: c[2])[:3]
    assert statistics.median(qualities) >= 0.95


def test_the_whole_grid_never_reports_a_batch_that_does_not_fit_and_keeps_its_median():
    cases = grid([0.0, 0.3, 0.45, 0.6], [1.2, 1.5, 2, 4, 16, 64, 200], seeds=range(4))
    assert all(fits and reruns <= 3 for *_, reruns, fits in cases)
    assert statistics.median(q for _, _, q, _, _ in cases) >= 0.92
    # Documented in the module docstring: a large fixed part at a low start is the weak spot.
    low_start_heavy = [q for f, r, q, _, _ in cases if f >= 0.45 and r <= 2]
    assert min(low_start_heavy) >= 0.5


@pytest.mark.parametrize("ratio", [2, 4, 16, 64])
def test_without_a_fixed_part_the_first_prediction_holds_and_the_search_ends_with_nothing_predicted_above(ratio):
    # A probe of a few hundred samples: its peak is far above the allocator's rounding, so the surest
    # batch from it is already at the budget less the margin. The search goes on only while a larger
    # whole batch is predicted to fit (no minimum gain), and ends saying so.
    model = model_for(0.0, 20000, 8, seed=3)
    true = model.largest_fitting(10**6)
    found, reruns, search = search_outcome(model, int(true * ratio) + 1, BUDGET)
    assert found >= 0.93 * true and model.fits(found)
    assert search.attempts[1].fitted and search.attempts[1].batch >= 0.93 * true
    assert reruns <= 3
    assert search.stopped is not None and search.next() is None
    if reruns < 3:
        assert "largest batch predicted to fit" in search.stopped


def test_the_probe_assumes_no_ratio_and_a_failed_probe_probes_lower():
    search = BatchSearch(6400, BUDGET, need_bytes=BUDGET)
    first = search.next()
    assert first == 100 and search.reason.startswith("probe")
    search.record(first, Observation(False, need_bytes=BUDGET + MiB, held_bytes=BUDGET - MiB))
    assert search.next() == 12  # 8x lower
    # The failure's figures scale the probe: a need twice the budget halves it.
    assert BatchSearch(6400, BUDGET, need_bytes=2 * BUDGET).next() == 50


def test_the_stop_is_an_explicit_state_with_a_reason():
    search = BatchSearch(1000, 1 * GiB, max_tries=2)
    tried = []
    while (batch := search.next()) is not None:
        tried.append(batch)
        search.record(batch, Observation(False))
    assert len(tried) == 2 and search.max_tries == 2
    assert search.stopped == "the 2 tries allowed are spent" and search.next() is None
    caller = BatchSearch(1000, 1 * GiB)
    caller.stop("the changed cell failed otherwise")
    assert caller.next() is None and caller.stopped == "the changed cell failed otherwise"
    adjacent = BatchSearch(101, 10 * GiB, max_tries=5)
    adjacent.record(100, Observation(True, 1 * MiB))
    assert adjacent.next() is None and adjacent.stopped == "100 fits and 101 does not"


def test_fragmentation_is_corrected_by_what_a_failed_try_held():
    # The cap says 6 GiB, only 88% of it is usable: the line's batch fails, the next one fits. With three
    # batch-sized tensors the failing allocation is a third of the step, so what the failed try held
    # (the floor of the usable budget) is low and the midpoint lands at about 0.8 of the largest.
    model = model_for(0.1, 760, 3, seed=1)
    model.usable_bytes = 0.88 * BUDGET
    true = model.largest_fitting(10**6)
    found, reruns, search = search_outcome(model, 8 * 760, BUDGET, max_tries=4)
    assert [a.fitted for a in search.attempts] == [True, True, False, True]
    assert found >= 0.75 * true and model.fits(found)


@pytest.mark.parametrize("power", [1.3, 2.0])
def test_superlinear_peaks_fall_back_to_bisection_and_never_claim_a_failure(power):
    search = BatchSearch(4000, BUDGET, max_tries=6)
    peak = lambda b: 1 * MiB * b**power + 20 * MiB  # noqa: E731
    best = run_search(search, lambda b: Observation(True, int(peak(b))) if peak(b) <= BUDGET
                      else Observation(False, need_bytes=int(peak(b)), held_bytes=int(0.97 * BUDGET)))
    true = max(b for b in range(1, 4000) if peak(b) <= BUDGET)
    assert best is not None and peak(best) <= BUDGET and best >= 0.75 * true
    assert len(search.attempts) <= 6


def test_growth_fits_a_line_with_an_intercept_and_bounds_its_slope():
    line = fit([(16, 118 * MiB), (32, 231 * MiB), (64, 456 * MiB)])  # the H100 CNN's measured peaks
    assert isinstance(line, Growth) and abs(line.peak(1024) - 7221 * MiB) / (7221 * MiB) < 0.02
    with_model = fit([(100, 3000 * MiB + 100 * 5 * MiB), (300, 3000 * MiB + 300 * 5 * MiB)])
    assert with_model.fixed_bytes == pytest.approx(3000 * MiB) and with_model.per_sample_bytes == pytest.approx(5 * MiB)
    assert with_model.largest_batch(6000 * MiB, sure=False) == 600
    assert 590 <= with_model.largest_batch(6000 * MiB) < 600  # the steepest slope rounding allows
    assert fit([(50, 100 * MiB)]) == through_origin(50, 100 * MiB)
    flat = fit([(10, 500 * MiB), (12, 500 * MiB)])  # a slope hidden by rounding is at most what it allows
    assert flat.per_sample_bytes == 0 and flat.per_sample_high_bytes == pytest.approx(8 * MiB / 2)
    steep = fit([(10, 100 * MiB), (11, 110 * MiB)])  # rounding allows the origin's slope: that bounds it
    assert steep == through_origin(11, 110 * MiB)
    assert fit([]) is None
    assert lowest_slope([(10, 100.0)], [(20, 300.0)]) == 20.0


def test_what_the_next_try_starts_with_counts_against_the_surest_batch():
    # The probe measured 6 MiB per sample above its own start; it left 1 GiB (optimizer state) that the
    # next try starts with. The surest batch must fit on top of it, not in the whole budget.
    per_sample = 6 * MiB

    def after_probe(level):
        search = BatchSearch(6400, BUDGET, need_bytes=BUDGET + GiB)
        probe = search.next()
        search.record(probe, Observation(True, peak_bytes=probe * per_sample))
        search.set_level(level)
        return search.next()

    empty, after_state = after_probe(0), after_probe(1 * GiB)
    assert per_sample * empty <= BUDGET and 1 * GiB + per_sample * after_state <= BUDGET
    assert empty - after_state >= 0.95 * GiB / per_sample  # the state's worth of samples less
    assert 1 * GiB + per_sample * after_state >= 0.93 * BUDGET  # still near the budget


def test_a_line_through_tries_that_started_higher_is_read_from_one_level():
    # The probe started at the reference; the second try started 500 MiB higher (state the probe left)
    # and its peak is given above the reference. The line through both never predicts past the budget.
    search = BatchSearch(20000, BUDGET, need_bytes=BUDGET + GiB)
    first = search.next()
    search.record(first, Observation(True, peak_bytes=first * 4 * MiB + 100 * MiB))
    search.set_level(500 * MiB)
    second = search.next()
    search.record(second, Observation(True, peak_bytes=500 * MiB + 100 * MiB + second * 4 * MiB, start_bytes=500 * MiB))
    third = search.next()
    assert third is not None and 600 * MiB + third * 4 * MiB <= BUDGET


def fragmenting_model(fragments: float, seed: int = 2) -> MemoryModel:
    # Three batch-sized tensors (the largest near a fifth of the step, as an LSTM's or an MLP's are) and a
    # small fixed part; at the peak the allocator holds ``fragments`` of the largest tensor in pieces.
    return model_for(0.05, 1000, 3, seed, noise=0.0) if fragments == 0 else MemoryModel(
        0.05 * BUDGET, [0.95 * BUDGET / 1000 * w for w in (0.45, 0.35, 0.2)], BUDGET, seed=seed, fragments=fragments)


def test_a_failed_try_whose_bytes_fit_steepens_the_line_by_its_fragments_per_sample():
    model = fragmenting_model(0.7)
    true = model.largest_fitting(10**6)
    search = BatchSearch(true * 16, BUDGET, need_bytes=2 * BUDGET, max_tries=4)
    search.record(100, model.observe(100))
    search.record(true // 2, model.observe(true // 2))
    tried = true + 20  # a try the line put just past the limit: its bytes fit, the fragments did not
    failed = model.observe(tried)
    assert not failed.fitted and failed.need_bytes <= BUDGET and failed.stuck_bytes
    steepest_before = search.growth().per_sample_bytes
    search.record(tried, failed)
    assert search.usable_bytes == BUDGET  # the budget stands: the fragments grow with the batch
    assert search.growth().per_sample_bytes == pytest.approx(steepest_before + failed.stuck_bytes / tried)
    nxt = search.next()
    assert model.fits(nxt) and nxt >= 0.93 * true
    # The same failure without the fragments' figure is not put down to fragments.
    blind = BatchSearch(true * 16, BUDGET, need_bytes=2 * BUDGET, max_tries=4)
    blind.record(100, model.observe(100))
    blind.record(true // 2, model.observe(true // 2))
    blind.record(tried, Observation(False, need_bytes=failed.need_bytes, held_bytes=failed.held_bytes))
    assert blind.growth().per_sample_bytes == steepest_before


@pytest.mark.parametrize("start", [32, 44, 87])
def test_fragments_of_a_try_far_above_the_next_are_taken_per_sample_not_whole(start):
    # The H100's figures for GPT-2 medium's generate() over 96 prompts a batch at a time (the sweep's
    # gpt2_medium_generate_in_batches; too long to record, so no replay): the probe at 1 peaked 140 MiB
    # above its start, the try the line put at 30 failed holding 4,200 MiB with 1,812 MiB reserved but
    # unusable (each decoding step's key/value cache a little larger than the one it freed). Taken whole
    # off a budget of 4,757 MiB, those fragments put the last try at 18, where 29 fits and halving ends on
    # 21 or 22; per sample of the try's 30, at 22.
    search = BatchSearch(start, 4757 * MiB, need_bytes=4513 * MiB, stuck_bytes=328 * MiB)
    assert search.next() == 1
    search.record(1, Observation(True, peak_bytes=140 * MiB))
    second = search.next()
    assert second in (30, 31)
    search.record(second, Observation(False, need_bytes=2955 * MiB, held_bytes=4200 * MiB, stuck_bytes=1812 * MiB))
    assert search.next() == 22


def test_a_failure_past_the_budget_is_not_put_down_to_fragments():
    search = BatchSearch(4000, BUDGET, need_bytes=2 * BUDGET, stuck_bytes=2 * GiB)
    assert search.growth() is None and search._stuck_per_sample == 0  # the need exceeds the budget
    search.record(10, Observation(True, 100 * MiB))
    search.record(600, Observation(False, need_bytes=BUDGET + GiB, held_bytes=BUDGET - GiB, stuck_bytes=GiB))
    assert search.usable_bytes == BUDGET  # not lowered by the fragments: the line was short, not the budget


@pytest.mark.parametrize("fragments", [0.4, 0.7, 1.0])
@pytest.mark.parametrize("ratio", [1.02, 1.1])
def test_a_failed_cell_near_its_limit_gives_the_fragments_per_sample(fragments, ratio):
    # A cell that failed just above its limit, on fragments: every try plans on them, so none fails.
    model = fragmenting_model(fragments)
    true = model.largest_fitting(10**6)
    start = max(int(true * ratio), true + 1)
    while model.run(start)[0]:
        start += 1
    found, reruns, search = search_outcome(model, start, BUDGET)
    assert search.stuck_bytes and search.need_bytes <= BUDGET
    assert all(a.fitted for a in search.attempts), [(a.batch, a.fitted) for a in search.attempts]
    assert found >= 0.90 * true and reruns <= 3


@pytest.mark.parametrize("ratio", [16, 64])
def test_fragments_seen_by_the_second_try_keep_the_third_within_reach(ratio):
    # The second try lands past the limit (the line cannot see the fragments); the third plans on them.
    worst = []
    for seed in range(6):
        model = MemoryModel(0.05 * BUDGET, [0.95 * BUDGET / 1000 * w for w in (0.45, 0.35, 0.2)], BUDGET,
                            seed=seed, fragments=0.7, noise=0.002)
        true = model.largest_fitting(10**6)
        found, reruns, search = search_outcome(model, true * ratio, BUDGET)
        worst.append((found or 0) / true)
        assert found is not None and model.fits(found) and reruns <= 3
    assert min(worst) >= 0.90, worst


def _tries_of(max_tries: int) -> tuple[list[int], int | None]:
    # 100 MiB a sample, nothing fixed, 1,200 MiB to use: 12 fits exactly, and the 4% margin says 11.
    search = BatchSearch(192, 1200 * MiB, max_tries=max_tries)
    tries = []
    while (batch := search.next()) is not None:
        tries.append(batch)
        search.record(batch, Observation(batch <= 12, peak_bytes=100 * MiB * batch if batch <= 12 else None,
                                         need_bytes=None if batch <= 12 else 100 * MiB * batch))
    return tries, search.best


def test_with_a_rerun_left_the_search_tries_the_batch_halving_would_end_on_just_above_its_best():
    # Halving from 192 tries 96, 48, 24 and then 12, which fits: a rerun of 12 ends the search on no less than
    # halving ends on, fitted or not (were it to fail, halving's next would be 6).
    assert _tries_of(4) == ([3, 11, 12], 12)
    # Not on the last rerun: were it to fail, no rerun would be left to run the best batch again (the driver
    # does, so that the model holds one run of the cell it reports).
    assert _tries_of(3) == ([3, 11], 11)


def _tries_within(budget_mib: int, start: int) -> list[tuple[int, str]]:
    # 100 MiB a sample, nothing fixed: the largest batch that fits is budget // 100.
    search = BatchSearch(start, budget_mib * MiB, max_tries=3)
    tries = []
    while (batch := search.next()) is not None:
        fits = 100 * batch <= budget_mib
        tries.append((batch, search.reason))
        search.record(batch, Observation(fits, peak_bytes=100 * MiB * batch if fits else None,
                                         need_bytes=None if fits else 100 * MiB * batch))
    return tries


def test_on_the_last_rerun_a_batch_of_halvings_that_fits_with_no_margin_is_tried():
    # 12 fits with 5 MiB to spare, less than the margin's share: the margin's batch is 11. Halving from 192
    # (96, 48, 24, 12) ends on 12; the last rerun tries it, and should it fail, 11 is more than its next (6).
    tries = _tries_within(1205, 192)
    assert [batch for batch, _ in tries] == [3, 11, 12]
    assert "12, halving's, fits with no margin" in tries[-1][1]
    # From 208 halving tries 13 (which cannot fit) and ends on 6: the search ends on 11, the last rerun kept.
    assert [batch for batch, _ in _tries_within(1205, 208)] == [3, 11]


def test_by_the_line_halvings_batch_that_fits_with_no_margin_is_tried_only_above_twice_what_fitted():
    # 1 MiB a sample in 204 MiB, no replay: the line fits 200 (halving's from 400) with no margin. The line
    # is no bound, so its failure must cost nothing against halving: tried after 100 fitted, not after 99.
    def last_choice(second: int) -> int | None:
        search = BatchSearch(400, 204 * MiB, max_tries=3)
        for batch in (6, second):
            search.record(batch, Observation(True, peak_bytes=batch * MiB))
        return search.next()

    assert last_choice(100) == 200
    assert last_choice(99) == 191  # the margin's
