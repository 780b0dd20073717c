"""The caching-allocator replay: rounding, pools, splitting, the cap's refusal, traces, and the batch search."""

import pytest

from jupyter_cudamem.growth.fitting import fits_in_a_row, fitting_from_one, paired_fittings, paired_with_failure
from jupyter_cudamem.growth.fitting import growth_lines, law_through, power_of_the_batch
from jupyter_cudamem.growth.replay import StartSegment, block_bytes, held_elsewhere, replay, segment_bytes, start_keys
from jupyter_cudamem.sources.torch_trace import events_from_trace, read_trace

MiB = 1 << 20


def test_requests_round_to_512_bytes_and_segments_by_pool():
    assert block_bytes(1) == 512
    assert block_bytes(513) == 1024
    assert segment_bytes(MiB) == 2 * MiB  # the small pool's segment
    assert segment_bytes(MiB + 512) == 20 * MiB  # large requests under 10 MiB share 20 MiB
    assert segment_bytes(10 * MiB) == 10 * MiB
    assert segment_bytes(10 * MiB + 512) == 12 * MiB  # rounded up to 2 MiB


def test_small_requests_share_a_segment_and_a_nearly_exact_large_block_is_not_split():
    small = replay([("alloc", 0, 600 * 1024, 0), ("alloc", 1, 600 * 1024, 0)], [], 1 << 40)
    assert small.segment_allocs == (2 * MiB,)
    # 19.5 MiB in a 20 MiB free block leaves 0.5 MiB, too little to split off: the whole block is handed out.
    large = replay([("alloc", 0, 2 * MiB, 0), ("free", 0, 0, 0), ("alloc", 1, 19 * MiB + MiB // 2, 0)], [], 1 << 40)
    assert large.segment_allocs == (20 * MiB,)
    assert large.peak_allocated_bytes == 20 * MiB


def test_a_refused_segment_releases_the_cached_ones_and_retries():
    events = [("alloc", 0, 40 * MiB, 0), ("free", 0, 0, 0), ("alloc", 1, 50 * MiB, 0)]
    result = replay(events, [], 64 * MiB)
    assert result.fits
    assert result.segment_frees == (40 * MiB,)
    assert result.peak_reserved_bytes == 50 * MiB


def fragmenting(batch: int) -> list:
    """A freed block split by a smaller tensor that outlives it: the piece left cannot take the next one."""
    return [("alloc", 0, 2 * batch * MiB, 0), ("free", 0, 0, 0),
            ("alloc", 2, batch * MiB, 0),  # lands in the freed block and splits it
            ("alloc", 3, 4 * batch * MiB, 0)]  # larger than the free piece: a new segment


def test_fragmentation_refuses_what_allocated_bytes_would_fit():
    cap = 600 * MiB
    result = replay(fragmenting(101), [], cap)
    assert not result.fits and result.failed_at == 3
    allocated_at_failure = 101 * MiB + 4 * 101 * MiB
    assert allocated_at_failure < cap  # a line on allocated bytes says it fits
    assert replay(fragmenting(100), [], cap).fits


def test_the_same_requests_fit_when_the_small_tensor_is_gone_first():
    events = fragmenting(101)
    events.insert(3, ("free", 2, 0, 0))  # the split block merges back and is released on refusal
    assert replay(events, [], 600 * MiB).fits


def test_a_start_segments_free_piece_takes_a_small_request_without_a_new_segment():
    start = [StartSegment(address=1 << 30, small=True, blocks=((1024, True), (2 * MiB - 1024, False)))]
    result = replay([("alloc", 0, 4096, 0)], start, 1 << 40)
    assert result.segment_allocs == ()
    assert result.peak_allocated_bytes == 1024 + 4096


def test_bisection_finds_the_fragmentation_limit_from_two_small_runs():
    # One run reserves 2b + 4b = 6b MiB at its end (the split block cannot be released): b = 100 under
    # 600 MiB, where the allocated peak (5b MiB) would allow 120. The next run holds the b and 4b it left
    # and asks for another 2b segment: 8b, so b = 75 keeps fitting (76 under 612 MiB).
    assert [replay(fragmenting(b), (), 600 * MiB).fits for b in (100, 101)] == [True, False]
    assert paired_fittings(fragmenting(10), 10, fragmenting(20), 20, [])(600 * MiB, 0.0).largest() == 75
    assert paired_fittings(fragmenting(20), 20, fragmenting(10), 10, [])(612 * MiB, 0.0).largest() == 76


def test_a_batch_fits_only_where_its_line_sizes_fit_too_not_only_the_margins():
    # A tensor of 0.995 MiB a sample, then an 11 MiB one. At batch 10 the first is 9.95 MiB, under 10 MiB:
    # it takes a share of a 20 MiB segment, and with the other's 12 MiB the run needs 32 MiB of a 30 MiB
    # cap. 1% or 2% larger it passes 10 MiB and gets a 12 MiB segment of its own: 24 MiB fits.
    def run(batch: int, scale: float = 1.0) -> list:
        return [("alloc", 0, int(0.995 * MiB * batch * scale), 0), ("alloc", 1, 11 * MiB, 0),
                ("free", 1, 0, 0), ("free", 0, 0, 0)]

    cap = 30 * MiB
    assert [replay(run(10, scale), (), cap).fits for scale in (1.0, 1.01, 1.02)] == [False, True, True]
    paired = paired_fittings(run(4), 4, run(8), 8, ())
    assert paired is not None and not paired(cap, 0.02).fits(10)  # the next run's sizes are likeliest its line's


def test_runs_that_are_not_one_program_give_no_prediction():
    shrinking = [("alloc", 0, 2 * MiB, 0)]
    assert paired_fittings([("alloc", 0, 40 * MiB, 0)], 10, shrinking, 20, []) is None
    assert paired_fittings(fragmenting(10), 10, fragmenting(10), 10, []) is None


def test_requests_that_do_not_grow_fit_up_to_the_search_limit():
    fixed = [("alloc", 0, 8 * MiB, 0)]
    assert paired_fittings(fixed, 10, fixed, 20, [])(600 * MiB, 0.0).largest(1000) == 1000


def test_an_extra_request_in_one_run_is_taken_as_proportional_to_the_batch():
    # The larger run holds a workspace the smaller did not ask for; it scales with the batch (the
    # conservative guess), so the limit is where 6b MiB of tensors plus 2b of workspace reach the cap.
    first = [("alloc", 0, 6 * 10 * MiB, 0)]
    second = [("alloc", 0, 6 * 20 * MiB, 0), ("alloc", 1, 2 * 20 * MiB, 0), ("free", 1, 0, 0)]
    lines, share, unpaired = growth_lines(first, 10, second, 20)
    assert unpaired == (1,)
    assert share == 6 / 8
    assert lines[1][3:] == (0.0, 2 * MiB, 1.0)
    assert paired_fittings(first, 10, second, 20, [])(800 * MiB, 0.0).largest() == 100


def test_an_extra_request_known_not_to_grow_keeps_its_size():
    # A loop whose smaller run skipped one optimizer step (GradScaler's first, on an overflow): the larger
    # run's step made a 200 MiB temporary the smaller never asked for. The step's requests are the
    # parameters' size at every batch (``growth.line.made_in_steps``), so it keeps its size, as one run's do.
    first = [("alloc", 0, 6 * 10 * MiB, 0), ("free", 0, 0, 0)]
    second = [("alloc", 0, 6 * 20 * MiB, 0), ("free", 0, 0, 0), ("alloc", 1, 200 * MiB, 0), ("free", 1, 0, 0)]
    lines, _, unpaired = growth_lines(first, 10, second, 20, batch_independent={1})
    assert unpaired == () and lines[2][3:] == (200 * MiB, 0.0, 1.0)
    assert paired_fittings(first, 10, second, 20, [], batch_independent={1})(600 * MiB, 0.0).largest() == 100
    # Not known to keep its size, it is taken as 10 MiB a sample, and the largest batch as 60.
    assert paired_fittings(first, 10, second, 20, [])(600 * MiB, 0.0).largest() == 60


def chunked(rows: int, chunk: int) -> list:
    """A cell that runs its model over chunks of ``rows`` rows (8 MiB of work a row, freed each chunk) and
    then joins all rows' results (4 MiB a row: a request of the same size at every chunk size)."""
    events, key = [], 0
    for start in range(0, rows, chunk):
        size = min(chunk, rows - start)
        events += [("alloc", key, 8 * MiB * size, 0), ("free", key, 0, 0)]
        key += 1
    return events + [("alloc", key, 4 * MiB * rows, 0)]


def test_a_join_after_a_loop_whose_passes_change_with_the_batch_is_batch_independent():
    # 12 rows in chunks of 1 and of 2: the passes shift the join against another event of the other run;
    # its size, left over once in each run, is the same tensor at both chunk sizes, not one that grows.
    lines, share, unpaired = growth_lines(chunked(12, 1), 1, chunked(12, 2), 2)
    assert unpaired == ()
    assert share == 1.0 and lines[-1][3:] == (48 * MiB, 0.0, 1.0)
    # The largest chunk is where 8 MiB a row of work reaches the cap beside the join the last run left
    # (48 MiB): 6 rows, where one run alone fits all 12 (its join comes after the work).
    assert paired_fittings(chunked(12, 1), 1, chunked(12, 2), 2, [])(96 * MiB, 0.0).largest() == 6
    assert paired_fittings(chunked(120, 1), 1, chunked(120, 2), 2, [])(600 * MiB, 0.0).largest() == 15
    # A size left over more often in one run than in the other is not paired by size: of two joins where
    # the other run made one, one pairs, the other stays proportional (the conservative guess).
    twice = chunked(12, 2) + [("alloc", 99, 48 * MiB, 0)]
    joins = [line[3:] for line in growth_lines(chunked(12, 1), 1, twice, 2).lines if line[0] == "alloc" and line[3] + line[4] * 2 == 48 * MiB]
    assert sorted(joins) == [(0.0, 24 * MiB, 1.0), (48 * MiB, 0.0, 1.0)]


def test_a_trace_becomes_events_keyed_by_allocation_and_freed_when_completed():
    start = [StartSegment(address=1000 * 512, small=True, blocks=((512, True), (2 * MiB - 512, False)))]
    trace = [
        ["segment_alloc", 10 << 30, 20 * MiB, 0],
        ["alloc", 10 << 30, 3 * MiB, 0],
        ["free_requested", 10 << 30, 3 * MiB, 0],
        ["free_completed", 10 << 30, 3 * MiB, 0],
        ["free_completed", 1000 * 512, 512, 0],  # a block that was allocated at the start
        ["oom", None, 64 * MiB, 0],  # caught (cuDNN's workspace probe)
        ["alloc", 10 << 30, 3 * MiB, 0],
        ["oom", None, 80 * MiB, 0],  # the one that raised
    ]
    events = events_from_trace(trace, start, failed=True)
    assert events == [("alloc", 0, 3 * MiB, 0), ("free", 0, 0, 0), ("free", -1, 0, 0),
                      ("try", 3, 64 * MiB, 0), ("alloc", 4, 3 * MiB, 0), ("alloc", 5, 80 * MiB, 0)]
    result = replay(events, start, 60 * MiB)
    assert result.refused_tries == (3,)
    assert not result.fits and result.failed_at == 5


def test_what_a_run_left_counts_once_only_where_the_next_start_holds_that_very_block():
    trace = [
        ["alloc", 10 << 30, 3 * MiB, 0],   # the data, set aside before the next run: made again there
        ["alloc", 11 << 30, 40 * MiB, 0],  # AdamW's state, kept: the next run does not make it again
    ]
    events, left = read_trace(trace, ())
    assert left == ((10 << 30, 0), (11 << 30, 1))
    kept_state = StartSegment(address=11 << 30, small=False, blocks=((40 * MiB, True),))
    assert held_elsewhere(events, left, [kept_state]) == [("alloc", 0, 3 * MiB, 0)]
    # The driver gave the data's freed address to another block (cuBLAS's workspace): not the data.
    workspace_there = StartSegment(address=10 << 30, small=False, blocks=((32 * MiB, True),))
    assert held_elsewhere(events, left, [workspace_there]) == events
    # A block the allocator left unsplit by less than 1 MiB is still that request's.
    unsplit = StartSegment(address=11 << 30, small=False, blocks=((40 * MiB + 512 * 1024, True),))
    assert held_elsewhere(events, left, [unsplit]) == [("alloc", 0, 3 * MiB, 0)]


def test_a_value_the_cell_binds_again_is_made_anew_while_the_last_runs_is_held():
    """The cell's output, still bound from its last run, is held until the run binds the name again: the
    new one is made while the old one is held, then the old one goes (the steady state of a cell run
    again and again), while the optimizer's state, kept, is not made again."""
    trace = [
        ["alloc", 20 << 30, 30 * MiB, 0],  # activations
        ["alloc", 10 << 30, 50 * MiB, 0],  # the output, bound to a name the cell binds again
        ["free_completed", 20 << 30, 30 * MiB, 0],
        ["alloc", 11 << 30, 40 * MiB, 0],  # AdamW's state
    ]
    events, left = read_trace(trace, ())
    start = [StartSegment(address=10 << 30, small=False, blocks=((50 * MiB, True),)),
             StartSegment(address=11 << 30, small=False, blocks=((40 * MiB, True),))]
    old_output = start_keys(start)[10 << 30]  # the key the replay gives the old output's block
    made = held_elsewhere(events, left, start, remade=frozenset({10 << 30}))
    assert made == [("alloc", 0, 30 * MiB, 0), ("alloc", 1, 50 * MiB, 0), ("free", old_output, 0, 0), ("free", 0, 0, 0)]
    # At its peak the run holds the old output, the state, the activations and the new output.
    assert replay(made, start, 1 << 40).peak_allocated_bytes == (50 + 40 + 30 + 50) * MiB
    # Taken as held (not made again), the new output would not count at all.
    assert replay(held_elsewhere(events, left, start), start, 1 << 40).peak_allocated_bytes == (50 + 40 + 30) * MiB


def test_runs_too_different_to_pair_cheaply_pair_only_their_common_ends(monkeypatch):
    from jupyter_cudamem.growth import fitting as module

    first = ["alloc"] + ["alloc", "free"] * 50 + ["free"]
    second = ["alloc"] + ["alloc", "free", "alloc", "free", "free"] * 30 + ["free"]
    full = module._common_runs(first, second)
    monkeypatch.setattr(module, "MAX_PAIRING_WORK", 100)
    ends = module._common_runs(first, second)
    assert len(full) > len(ends) and ends == [(0, 0, 5), (100, 150, 2)]  # the common prefix and suffix


def _step_events(batch: int, layers: int, extra_at: int | None = None) -> list:
    """A training step's shape: per layer an activation (batch-sized) and a weight-sized gradient; a
    workspace request inserted after layer ``extra_at`` (another cuBLAS algorithm at this batch)."""
    events, key = [], 0
    for layer in range(layers):
        events.append(("alloc", key, (layer % 7 + 1) * 4096 * batch, 0))
        events.append(("alloc", key + 1, (layer % 5 + 1) * 65536, 0))
        events.append(("free", key, 0, 0))
        key += 2
        if layer == extra_at:
            events += [("alloc", 10**6, 3 * 1024 * 1024, 0), ("free", 10**6, 0, 0)]
    return events


def test_long_runs_with_a_few_extra_requests_are_walked_into_pairs_when_too_long_for_difflib(monkeypatch):
    from jupyter_cudamem.growth import fitting as module

    first, second = _step_events(1, 400), _step_events(2, 400, extra_at=5)
    monkeypatch.setattr(module, "MAX_PAIRING_WORK", 50_000)  # below the middles' product: difflib is not used
    assert len(first) * len(second) > module.MAX_PAIRING_WORK
    partner = module.match(first, 1, second, 2)
    allocations = [i for i, event in enumerate(second) if event[0] == "alloc"]
    paired = [i for i in allocations if partner[i] is not None]
    assert len(paired) >= len(allocations) - 2  # all but the inserted workspace and the request beside it
    assert all(first[partner[i]][2] in (second[i][2], second[i][2] // 2) for i in paired)
    # Runs that never agree (another chunking throughout) stop within the bound, nearly unpaired.
    other = [("alloc", k, 4096 * 3 + k % 3, 0) if k % 2 == 0 else ("free", k - 1, 0, 0) for k in range(2400)]
    assert sum(p is not None for p in module.match(first, 1, other, 2)) < len(other) // 10


def test_a_run_that_lets_go_of_the_last_runs_values_pairs_with_a_first_run_that_had_none(monkeypatch):
    # ViT-L built in its cell, on an H200: the steady try lets go of the last run's weights, gradients and
    # AdamW state (hundreds of frees in a row, blocks made before it) where the first run frees nothing;
    # past the walk's window the two never aligned again, the forward and backward went unpaired and were
    # scaled whole with the batch, and the search stopped at 8 where 22 keeps fitting.
    from jupyter_cudamem.growth import fitting as module

    monkeypatch.setattr(module, "MAX_PAIRING_WORK", 50_000)  # walked, as runs of a large model are
    first = _step_events(1, 400)
    let_go = [("free", -1 - k, 0, 0) for k in range(3 * module.RESYNC_WINDOW)]
    second = _step_events(2, 400, extra_at=390)  # and a workspace of its own near the end
    second = second[:30] + let_go + second[30:]
    partner = module.match(first, 1, second, 2)
    allocations = [i for i, event in enumerate(second) if event[0] == "alloc"]
    paired = [i for i in allocations if partner[i] is not None]
    assert len(paired) >= len(allocations) - 2  # all but the workspace and the request beside it
    assert all(first[partner[i]][2] in (second[i][2], second[i][2] // 2) for i in paired)
    assert all(partner[i] is None for i in range(30, 30 + len(let_go)))


def masked(batch: int) -> list:
    """A 64 MiB tensor of fixed size (a mask) kept through a run whose tensors grow as ``fragmenting``'s."""
    return [("alloc", 9, 64 * MiB, 0)] + fragmenting(batch) + [("free", 9, 0, 0)]


def test_a_failed_runs_requests_up_to_its_failure_tell_the_fixed_from_the_growing():
    cap = 600 * MiB
    truth = max(b for b in range(1, 200) if fits_in_a_row(masked(b), (), cap))  # 67; one run alone: 89
    failed = replay(masked(150), (), cap)
    assert not failed.fits and failed.failed_at is not None
    # What PyTorch records of a failed run: its requests up to the one that raised, then what it gave back
    # while the error unwound.
    prefix = masked(150)[:failed.failed_at + 1] + [("free", 9, 0, 0)]
    under = paired_with_failure(masked(4), 4, prefix, 150, ())
    one = fitting_from_one(masked(4), 4, (), cap)
    assert under is not None and one is not None
    paired = under(cap, 0.0)
    assert paired.largest(149) == truth
    assert not paired.fits(150)  # it replays the failure, as the search requires before it trusts it
    assert one.largest(149) < 0.8 * truth  # one run scales the mask with the batch


def test_no_pairing_with_a_failure_at_or_below_the_run_that_fitted():
    assert paired_with_failure(masked(40), 40, masked(40), 40, ()) is None
    assert paired_with_failure(masked(40), 40, masked(20), 20, ()) is None


def test_a_batch_by_batch_tensor_is_paired_on_its_power_of_the_batch():
    # A contrastive loss's logits, float32: 4 bytes per pair of samples, at 223 and 16,254.
    assert power_of_the_batch(4 * 223**2, 223, 16_254, 4 * 16_254**2) == 2
    assert law_through(4 * 223**2, 223, 4 * 16_254**2, 16_254) == pytest.approx((0.0, 4.0, 2.0))
    # On the H100's recorded ResNet-50 runs at 223 and 447, a bottleneck's fourfold channels grow by 8.02, about
    # the cube of the ratio: not a whole multiple of either power, two tensors paired by position.
    assert power_of_the_batch(16_441_344, 223, 447, 131_825_664) is None
    assert power_of_the_batch(512, 223, 447, 2048) is None


def test_logits_after_a_failure_are_replayed_on_the_square_of_the_batch():
    # Batch-major tensors of 4 KiB a sample, then a batch x batch matrix of logits and its softmax.
    def step(batch: int) -> list:
        return [("alloc", 0, 4096 * batch, 0), ("alloc", 1, 4 * batch * batch, 0), ("alloc", 2, 4 * batch * batch, 0),
                ("free", 2, 0, 0), ("free", 1, 0, 0), ("free", 0, 0, 0)]

    cap = 2 * 1024 * MiB
    truth = max(b for b in range(1000, 30_000, 50) if replay(step(b), (), cap).fits)
    failed = replay(step(40_000), (), cap)
    assert not failed.fits and failed.failed_at == 1  # the logits raised; the softmax was never asked for
    paired = paired_with_failure(step(200), 200, step(40_000)[:2], 40_000, ())
    assert paired is not None and truth - 50 <= paired(cap, 0.0).largest(39_999) <= truth + 50
    one = fitting_from_one(step(200), 200, (), cap)
    assert one is not None and one.largest(39_999) > 2 * truth  # one run scales the logits with the batch


def test_state_made_where_the_put_back_held_the_last_run_s_is_made_not_held():
    """The put-back holds the last run's optimizer state until the step begins; the step lets it go and
    makes its own in the very blocks it left: new blocks at held addresses, which the run makes and keeps."""
    trace = [
        ["alloc", 20 << 30, 30 * MiB, 0],            # activations
        ["free_completed", 20 << 30, 30 * MiB, 0],
        ["free_completed", 11 << 30, 40 * MiB, 0],   # the held state goes as the step begins
        ["alloc", 11 << 30, 40 * MiB, 0],            # the step's state, where the held state was
    ]
    start = [StartSegment(address=11 << 30, small=False, blocks=((40 * MiB, True),))]
    events, left = read_trace(trace, start)
    assert left == ((11 << 30, 3),)  # keys are the trace's rows
    made = held_elsewhere(events, left, start, let_go={11 << 30})
    assert made == events
    end = replay(made, start, 1 << 40, keep_end=True).end
    assert end is not None and sum(size for s in end[0] for size, taken in s.blocks if taken) == 40 * MiB
    # Not said to be released, the block is taken as held: its request is dropped, and with it the state.
    assert held_elsewhere(events, left, start) == events[:3]
