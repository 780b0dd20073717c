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
    assert code == "TrainingArguments(..., per_device_train_batch_size=22, gradient_accumulation_steps=3)"
    fit = build_suggestions("", cell_traits("trainer.fit(model, datamodule=dm)\n"), 256, 100, None, False, False,
                            batch_home=KnobKind.LIGHTNING)
    assert "accumulate_grad_batches=3" in fit[0].code
    assert build_suggestions("", trainer_cell, 64, 24, None, False, False)[0].code.startswith("accumulation_steps = 3")


def test_diagnosis_advice_is_written_here():
    from jupyter_cudamem.advice import EXPANDABLE, held_by_namespace_advice, too_big_advice

    assert too_big_advice(capped=True)[-1].startswith("raise the cap")
    assert held_by_namespace_advice([("old_model", 5 * GiB)]) == [
        "%oomfix --del old_model if you no longer need it (frees up to 5.00 GiB)"]
    assert EXPANDABLE == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
