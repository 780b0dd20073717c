from jupyter_cudamem.advice import measurement_hints
from jupyter_cudamem.measure import Meter

GiB = 1024**3


def _measure(hardware, action, **meter_options):
    meter = Meter(hardware, **meter_options)
    baseline = meter.start()
    action()
    return meter.stop(baseline)


def test_cached_blocks_hint(machine, hardware):
    def cell():
        machine.allocate(0, 6 * GiB)
        machine.free(0, 6 * GiB)

    hints = measurement_hints(_measure(hardware, cell))
    assert any("reserved grew 6.00 GiB more than allocated" in h and "empty_cache" in h for h in hints)


def test_near_full_card_hint(machine, hardware):
    hints = measurement_hints(_measure(hardware, lambda: machine.allocate(0, 74 * GiB)))
    assert any(h.startswith("peak is 92% of the card") for h in hints)


def test_left_allocated_and_outside_pytorch_hints(machine, hardware):
    def cell():
        machine.allocate(0, 2 * GiB)
        machine.gpus[0].outside_bytes += GiB

    hints = measurement_hints(_measure(hardware, cell))
    assert any("left 2.00 GiB allocated" in h for h in hints)
    assert any("outside PyTorch" in h for h in hints)


def test_quiet_cell_has_no_hints(machine, hardware):
    machine.gpus[0].has_context = True  # a context created earlier: nothing new outside PyTorch
    assert measurement_hints(_measure(hardware, lambda: machine.allocate(0, 10 * 1024**2))) == []


def test_oom_points_to_oomfix(machine, hardware):
    meter = Meter(hardware)
    measurement = meter.stop(meter.start(), error="OutOfMemoryError")
    assert "%oomfix" in measurement_hints(measurement)[0]


def test_first_use_names_the_cuda_context(machine, hardware):
    hints = measurement_hints(_measure(hardware, lambda: machine.allocate(0, 10 * 1024**2)))
    assert hints == [
        "512.00 MiB more in use outside PyTorch's allocator (the CUDA context created on first use, "
        "cuBLAS/cuDNN workspaces, CuPy, JAX or other libraries)"
    ]


def test_gradient_accumulation_goes_through_where_the_batch_lives():
    from jupyter_cudamem.advice import build_suggestions
    from jupyter_cudamem.batch import KnobKind
    from jupyter_cudamem.cell.traits import cell_traits

    trainer_cell = cell_traits("trainer.train()\n")  # the Trainer was built in an earlier cell
    code = build_suggestions("", trainer_cell, 64, 24, None, False, False, batch_home=KnobKind.TRAINER)[0].code
    assert code == "TrainingArguments(..., per_device_train_batch_size=16, gradient_accumulation_steps=4)"
    fit = build_suggestions("", cell_traits("trainer.fit(model, datamodule=dm)\n"), 256, 100, None, False, False,
                            batch_home=KnobKind.LIGHTNING)
    assert "accumulate_grad_batches=4" in fit[0].code and "batch_size=64" in fit[0].code
    assert build_suggestions("", trainer_cell, 64, 24, None, False, False)[0].code.startswith("accumulation_steps = 4")


def test_diagnosis_advice_is_written_here():
    from jupyter_cudamem.advice import EXPANDABLE, held_by_namespace_advice, too_big_advice

    assert too_big_advice(capped=True)[-1].startswith("raise the cap")
    assert held_by_namespace_advice([("old_model", 5 * GiB)]) == [
        "%oomfix --del old_model if you no longer need it (frees up to 5.00 GiB)"]
    assert EXPANDABLE == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


def test_accumulation_keeps_the_effective_batch_exactly_or_says_what_changes():
    """Over many (effective, fitted) pairs: an exact plan multiplies back to the effective batch with a
    micro-batch at or below what fitted and no smaller than the close fraction of it; otherwise the
    sentence states the arithmetic of both ways out, and that arithmetic holds."""
    import random
    import re

    from jupyter_cudamem.advice import accumulation_sentence
    from jupyter_cudamem.growth.accumulation import CLOSE_DIVISOR_FRACTION, accumulation_plan, largest_divisor_at_most

    pairs = [(1024, 205), (1024, 342), (1024, 300), (512, 200), (1021, 300), (997, 2), (6, 5), (2, 1), (7, 6)]
    chooser = random.Random(15)
    pairs += [(chooser.randint(2, 70_000), 0) for _ in range(1500)]
    pairs = [(e, f if f else chooser.randint(1, e - 1)) for e, f in pairs]
    exact = uneven = 0
    for effective, fitted in pairs:
        plan = accumulation_plan(effective, fitted)
        assert 1 <= plan.micro <= fitted, (effective, fitted, plan)
        sentence = accumulation_sentence(plan)
        if plan.exact:
            exact += 1
            assert plan.micro * plan.steps == effective and effective % plan.micro == 0
            assert plan.micro == largest_divisor_at_most(effective, fitted)
            assert plan.micro >= fitted * CLOSE_DIVISOR_FRACTION
            assert f"{plan.steps} x {plan.micro} = {effective}" in sentence and "exactly" in sentence
        else:
            uneven += 1
            assert largest_divisor_at_most(effective, fitted) < fitted * CLOSE_DIVISOR_FRACTION
            # the plain statement: a smaller last step (same effective batch) or a changed effective batch
            last = re.search(r"\((\d+) x (\d+) \+ (\d+) = (\d+);", sentence)
            assert last is not None, sentence
            steps, micro, rest, total = map(int, last.groups())
            assert steps * micro + rest == total == effective and 0 < rest < micro
            changed = re.search(r"effective batch changes to (\d+) \((\d+) x (\d+)\)", sentence)
            assert changed is not None, sentence
            assert int(changed[1]) == int(changed[2]) * int(changed[3]) != effective
        assert "nearest even split" not in sentence
    assert exact and uneven  # both branches were exercised


def test_accumulation_divisor_is_the_largest_that_fits():
    from jupyter_cudamem.growth.accumulation import accumulation_plan, largest_divisor_at_most

    for number in range(1, 400):
        for limit in range(1, number + 1):
            expected = max(d for d in range(1, limit + 1) if number % d == 0)
            assert largest_divisor_at_most(number, limit) == expected
    plan = accumulation_plan(1024, 342)  # the tutorial's case: 3 x 342 = 1026 was offered before
    assert (plan.micro, plan.steps, plan.exact) == (256, 4, True)
    prime = accumulation_plan(1021, 300)
    assert not prime.exact and (prime.micro, prime.steps, prime.last) == (300, 4, 121)


def test_the_retry_before_an_oom_is_not_called_fragmentation(machine, hardware):
    """PyTorch frees its cache and retries once before raising an OOM, even for a request larger than the
    cap: that retry alone gives no expandable_segments hint; a retry besides it does."""
    machine.gpus[0].has_context = True
    meter = Meter(hardware)
    baseline = meter.start()
    machine.gpus[0].num_alloc_retries += 1  # the failing allocation's own retry
    failed = measurement_hints(meter.stop(baseline, error="OutOfMemoryError"))
    assert not any("expandable_segments" in h for h in failed)
    baseline = meter.start()
    machine.gpus[0].num_alloc_retries += 2  # one earlier in the cell, then the failure's
    again = measurement_hints(meter.stop(baseline, error="OutOfMemoryError"))
    assert any(h.startswith("the allocator had to free its cache and retry 1 time(s)") for h in again)
    baseline = meter.start()
    machine.gpus[0].num_alloc_retries += 1  # a cell that ran: its retry is pressure or fragmentation
    machine.allocate(0, 10 * 1024**2)  # (a cell that touched the device: the report has it)
    assert any("retry 1 time(s)" in h and "expandable_segments" in h for h in measurement_hints(meter.stop(baseline)))


def test_empty_cache_is_advised_only_with_cached_memory_to_give_back():
    from jupyter_cudamem.advice import fragmentation_advice

    assert not any("empty_cache" in line for line in fragmentation_advice(0))
    assert not any("empty_cache" in line for line in fragmentation_advice(None))
    with_cache = fragmentation_advice(1536 * 1024**2)
    assert any("empty_cache()" in line and "gives back the 1.50 GiB cached but unallocated" in line
               for line in with_cache)
