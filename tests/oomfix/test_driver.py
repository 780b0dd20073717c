"""The rerun driver and strategies against a simulated cell on fake hardware (oomfix/driver.py, strategies.py)."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import gc

import traceback

import pytest

from jupyter_cudamem.batchsearch import BatchSearch
from jupyter_cudamem.cell.read import read_cell
from jupyter_cudamem.errors import CudaMemError
from jupyter_cudamem.oomfix.cleanup import CleanupResult
from jupyter_cudamem.hardware import headroom_bytes
from jupyter_cudamem.oomfix.driver import Driver
from jupyter_cudamem.advice import accumulation_plan, build_suggestions
from jupyter_cudamem.cell.traits import cell_traits
from jupyter_cudamem.oomfix.options import check_max_tries, check_strategies
from jupyter_cudamem.oomfix.strategies import Strategy
from jupyter_cudamem.units import format_bytes
from tests.fakes import FakeOutOfMemoryError, GiB, MiB
from tests.oomfix.simulated import OutOfMemoryError, SimulatedCell, capped_machine, fake_hardware

CNN = lambda b: 7.05 * MiB * b + 30 * MiB  # noqa: E731  the CNN measured on an H100, one Adam step

TRAINING_CELL = """batch_size = {batch}
train_step(batch_size)
model.train()
last_batch = batch_size  # a side effect the rerun repeats
"""


class _Model:
    def train(self):
        return self


def setup(peak=CNN, cap=6 * GiB, held=256 * MiB, hidden_limit=None, **driver_options):
    machine = capped_machine(cap, held_bytes=held)
    cell = SimulatedCell(machine, peak, hidden_limit_bytes=hidden_limit)
    namespace = {"model": _Model()}
    run = cell.run_source(namespace)
    cleanups = []

    def cleanup(error):
        cleanups.append(error)
        machine.empty_cache()

    driver = Driver(run, fake_hardware(machine), cleanup, autocast_dtype=lambda: "bfloat16", **driver_options)
    return machine, cell, namespace, run, driver, cleanups


def fail_first(run, source):
    error = run(source)
    assert error is not None and "CUDA out of memory" in str(error)
    return error


def test_linear_cell_is_fixed_near_the_largest_batch_in_three_reruns():
    machine, cell, namespace, run, driver, cleanups = setup()
    true_max = cell.largest_fitting(20000)
    source = TRAINING_CELL.format(batch=8 * true_max)
    outcome = driver.fix(read_cell(source), fail_first(run, source), namespace, freed_bytes=0)
    assert outcome.fitted and outcome.strategy == "batch"
    assert outcome.reruns <= 3
    assert 0.9 * true_max <= outcome.batch_after <= true_max
    assert outcome.batch_before == 8 * true_max
    # The fixed cell differs from the original in the batch only, and its run is what the namespace holds.
    assert outcome.fixed_source == source.replace(str(8 * true_max), str(outcome.batch_after))
    assert namespace["last_batch"] == outcome.batch_after
    assert f"-batch_size = {8 * true_max}" in outcome.diff and f"+batch_size = {outcome.batch_after}" in outcome.diff
    # Every try measured its peak above the start; the simulated cell saw exactly the tried batches.
    assert cell.calls[1:] == [t.batch for t in outcome.tries]
    for t in outcome.tries:
        if t.fitted:
            assert t.peak_bytes == pytest.approx(CNN(t.batch), rel=0.01)
    assert len(cleanups) == outcome.reruns  # cleaned up after every try
    assert machine.gpus[0].allocated == 256 * MiB  # nothing left allocated by the tries


def _cleaned(cache_bytes: int = 0, **by_name: int) -> CleanupResult:
    """What the magic's cleanup reports: freed from the output cache and per ``--del`` variable."""
    total = cache_bytes + sum(by_name.values())
    return CleanupResult(total, total, (), tuple(by_name), freed_output_cache_bytes=cache_bytes,
                         freed_by_name=dict(by_name))


def test_cleanup_alone_when_the_cleanup_freed_what_was_held_before_the_cell():
    machine, cell, namespace, run, driver, _ = setup(held=0)
    source = TRAINING_CELL.format(batch=600)  # 600 fits an empty card
    machine.allocate(0, 3 * GiB)  # an earlier cell's output, in Out, when the cell ran
    error = fail_first(run, source)
    machine.free(0, 3 * GiB)  # the cleanup the magic runs first
    outcome = driver.fix(read_cell(source), error, namespace, freed_bytes=3 * GiB, cleaned=_cleaned(3 * GiB))
    assert outcome.strategy == "cleanup" and outcome.reruns == 1
    assert outcome.fixed_source == source and outcome.diff == ""
    assert "fits unchanged after cleanup" in outcome.headline()
    assert "of what the cleanup freed, 3.00 GiB was held before the cell (the output cache)" in outcome.tries[0].reason


def test_a_deleted_variable_the_cell_does_not_bind_is_room_for_a_plain_rerun():
    machine, cell, namespace, run, driver, _ = setup(held=0)
    source = TRAINING_CELL.format(batch=600)
    machine.allocate(0, 3 * GiB)  # `features`, made in an earlier cell, deleted with --del
    error = fail_first(run, source)
    machine.free(0, 3 * GiB)
    outcome = driver.fix(read_cell(source), error, namespace, freed_bytes=3 * GiB, cleaned=_cleaned(features=3 * GiB))
    assert outcome.strategy == "cleanup"
    assert "(features)" in outcome.tries[0].reason


def test_under_a_cap_the_room_a_deleted_variable_must_make_counts_pytorch_memory_only():
    # A 6 GiB cap; 2.5 GiB held by the model, 0.5 GiB by `features` (deleted with --del). The cell asks for
    # 3.30 GiB at once: under the cap PyTorch had 6 - 3 = 3 GiB left, so the allocation lacked 0.30 GiB,
    # and freeing 0.5 GiB makes room for the cell as written. NVML's figure for the process adds the
    # 512 MiB CUDA context, which the cap does not count: taken from the cap, it made the shortfall
    # 0.80 GiB and skipped the plain rerun for a smaller batch (or autocast) the cell did not need.
    machine = capped_machine(6 * GiB, held_bytes=int(2.5 * GiB))
    cell = SimulatedCell(machine, lambda batch: batch * MiB, chunks=1)
    namespace = {"model": _Model()}
    run = cell.run_source(namespace)
    driver = Driver(run, fake_hardware(machine), lambda error: machine.empty_cache(),
                    autocast_dtype=lambda: "bfloat16")
    machine.allocate(0, GiB // 2)  # features
    source = TRAINING_CELL.format(batch=3379)  # 3,379 MiB: 3.30 GiB
    error = fail_first(run, source)
    machine.free(0, GiB // 2)  # the cleanup the magic runs first, --del features
    machine.empty_cache()
    outcome = driver.fix(read_cell(source), error, namespace, freed_bytes=GiB // 2, cleaned=_cleaned(features=GiB // 2))
    assert [t.strategy for t in outcome.tries] == [Strategy.CLEANUP]
    assert outcome.fixed_source == source
    # The message words the request as 3.30 GiB: 0.30 GiB lacked, 307.20 MiB.
    assert "the allocation that failed lacked 307.20 MiB" in outcome.tries[0].reason


def test_what_the_failed_cell_made_is_no_room_for_a_plain_rerun():
    # The cleanup freed 3 GiB, all of it the failed cell's own (its traceback's frames, a variable the cell
    # binds): a rerun makes it again. Seen on the H100: BERT built in the failing cell, 5.3 GiB freed, the
    # plain rerun failed the same way.
    machine, cell, namespace, run, driver, _ = setup(held=0)
    source = "x = 1\n" + TRAINING_CELL.format(batch=4000)
    error = fail_first(run, source)
    outcome = driver.fix(read_cell(source), error, namespace, freed_bytes=3 * GiB, cleaned=_cleaned(x=3 * GiB))
    assert all(t.strategy == "batch" for t in outcome.tries)
    assert any("freed only what the failed cell had made" in note for note in outcome.notes)


def test_a_plain_rerun_needs_what_the_failed_allocation_lacked():
    machine, cell, namespace, run, driver, _ = setup(held=0)
    source = TRAINING_CELL.format(batch=4000)
    error = fail_first(run, source)
    # What the cell held when it started is not known: the failed allocation's shortfall decides.
    outcome = driver.fix(read_cell(source), error, namespace, cleaned=_cleaned(MiB))
    assert all(t.strategy == "batch" for t in outcome.tries)
    note = next(note for note in outcome.notes if "skipped a plain rerun" in note)
    assert "of what the cleanup freed, 1.00 MiB was held before the cell (the output cache), less than the" in note and "lacked" in note


def test_plain_rerun_is_skipped_when_cleanup_freed_too_little():
    _, cell, namespace, run, driver, _ = setup()
    source = TRAINING_CELL.format(batch=4000)
    outcome = driver.fix(read_cell(source), fail_first(run, source), namespace, freed_bytes=0)
    assert all(t.strategy == "batch" for t in outcome.tries)
    assert any("skipped a plain rerun" in note for note in outcome.notes)


def test_no_plain_rerun_when_the_cell_would_start_where_it_failed():
    # Fragmentation: the cap leaves 5.75 GiB, 5 GiB is usable. What the failure held plus what it asked
    # for is under the cap, but nothing was freed since the cell started: a rerun fails the same way.
    machine, cell, namespace, run, driver, _ = setup(hidden_limit=5 * GiB)
    true_max = cell.largest_fitting(20000)
    source = TRAINING_CELL.format(batch=int(1.3 * true_max))
    started = machine.gpus[0].allocated
    outcome = driver.fix(read_cell(source), fail_first(run, source), namespace, freed_bytes=0, allocated_before=started)
    assert [t.strategy for t in outcome.tries][0] == "batch"
    assert any("fail the same way" in note for note in outcome.notes)
    assert outcome.fitted and outcome.batch_after <= true_max


@pytest.mark.parametrize("state_with_the_activations", [True, False])
def test_state_a_fitted_try_leaves_is_counted_against_the_later_tries(state_with_the_activations):
    """The first step of an optimizer built in an earlier cell leaves its state (Adam: twice the weights)
    and the gradients: every later try starts that much higher. Seen on the H100 with ResNet-50 under
    autocast (250 MiB): peaks read from each try's own start put the third try over the cap.

    Gradients appear while the activations are alive (the state is part of the first try's peak);
    Adam's moments appear in ``step()``, after they are freed (it is not): either way no try may fail,
    and where the first peak includes the state the search lands as near as on any linear cell."""
    from tests.fakes import FakeTensor

    machine = capped_machine(6 * GiB, held_bytes=256 * MiB)
    cell = SimulatedCell(machine, CNN)
    namespace: dict = {}
    state_bytes = 600 * MiB

    def step(batch):
        if state_with_the_activations and "optimizer_state" not in namespace:
            state = FakeTensor(state_bytes, machine=machine)
            cell.train_step(batch)  # an OOM here frees the state with the step
            namespace["optimizer_state"] = state
        cell.train_step(batch)
        if "optimizer_state" not in namespace:
            namespace["optimizer_state"] = FakeTensor(state_bytes, machine=machine)

    namespace["step"] = step
    run = cell.run_source(namespace)
    driver = Driver(run, fake_hardware(machine), lambda error: machine.empty_cache(), strategies=("batch",))
    source = "batch_size = 3000\nstep(batch_size)\n"
    started = machine.gpus[0].allocated
    failure = fail_first(run, source)
    # The magic's cleanup, as before every fix: the failed cell's frames let go of what they held (here the
    # state its first step made before failing). Left to the garbage collector (the traceback is a cycle),
    # it went at a moment that depends on the tests run before, and the later tries' start with it.
    traceback.clear_frames(failure.__traceback__)
    outcome = driver.fix(read_cell(source), failure, namespace, freed_bytes=0, allocated_before=started)
    true_max = cell.largest_fitting(20000)  # with the state allocated, as every try after the first
    assert outcome.tries[0].start_above_reference_bytes == 0
    assert all(t.start_above_reference_bytes == state_bytes for t in outcome.tries[1:])
    assert all(t.fitted for t in outcome.tries), outcome.text()
    assert outcome.batch_after <= true_max
    if state_with_the_activations:
        assert outcome.batch_after >= 0.9 * true_max


def test_the_search_reads_where_the_next_try_starts_after_the_state_is_put_back():
    """An optimizer from an earlier cell, without state when the cell failed: each fitted try's first step
    makes Adam's moments (after the activations are freed), and ``before_rerun`` (the Restorer) puts the
    optimizer back without them before the next try. The search must read the allocator and the level
    after that put-back: read before, the moments count as held through the next try's forward pass (an
    H100 put a ViT-B/16 fine-tune at 40 where 48 fits). When the search then ends, the best is rerun, so the
    namespace holds one run of it."""
    from tests.fakes import FakeTensor

    machine = capped_machine(6 * GiB, held_bytes=256 * MiB)
    cell = SimulatedCell(machine, CNN)
    namespace: dict = {}
    state_bytes = 300 * MiB

    def step(batch):
        cell.train_step(batch)
        namespace.setdefault("optimizer_state", FakeTensor(state_bytes, machine=machine))
        namespace["last_batch"] = batch

    def put_back():  # the optimizer as it was when the cell failed: no state
        namespace.pop("optimizer_state", None)
        gc.collect()

    namespace["step"] = step
    run = cell.run_source(namespace)
    driver = Driver(run, fake_hardware(machine), lambda error: machine.empty_cache(), strategies=("batch",),
                    before_rerun=put_back)
    source = "batch_size = 3000\nstep(batch_size)\n"
    started = machine.gpus[0].allocated
    true_max = cell.largest_fitting(20000)  # from the start the failed cell had: no state held
    outcome = driver.fix(read_cell(source), fail_first(run, source), namespace, freed_bytes=0, allocated_before=started)
    assert all(t.start_above_reference_bytes == 0 for t in outcome.tries), outcome.text()
    assert all(t.fitted for t in outcome.tries) and outcome.reruns <= 3, outcome.text()
    # Read before the put-back, the line is raised by the state (362 MiB fixed, not 62): 757 where 830 fits.
    assert 0.95 * true_max <= outcome.batch_after <= true_max, true_max
    # The namespace holds one run of the reported batch, its state included.
    assert namespace["last_batch"] == outcome.batch_after and "optimizer_state" in namespace
    assert outcome.tries[-1].batch == outcome.batch_after


def test_fragmentation_is_corrected_within_three_reruns():
    # The cap leaves 5.75 GiB, but only 5 GiB is usable in practice.
    _, cell, namespace, run, driver, _ = setup(hidden_limit=5 * GiB)
    true_max = cell.largest_fitting(20000)
    source = TRAINING_CELL.format(batch=8 * true_max)
    outcome = driver.fix(read_cell(source), fail_first(run, source), namespace, freed_bytes=0)
    assert outcome.reruns <= 3 and outcome.fitted
    assert 0.85 * true_max <= outcome.batch_after <= true_max
    # Each failed try carries the fragments its OOM message reported, and the search planned on them.
    failed = [t for t in outcome.tries if not t.fitted]
    assert failed and all(t.stuck_bytes == 6 * GiB - 256 * MiB - 5 * GiB for t in failed)
    assert outcome.tries[-1].fitted


def test_quadratic_cell_never_reports_a_batch_that_does_not_fit():
    quadratic = lambda b: 0.05 * MiB * b * b + 10 * MiB  # noqa: E731
    _, cell, namespace, run, driver, _ = setup(peak=quadratic, max_tries=6)
    source = TRAINING_CELL.format(batch=3000)
    outcome = driver.fix(read_cell(source), fail_first(run, source), namespace, freed_bytes=0)
    assert outcome.reruns <= 6 and outcome.fitted
    assert cell.fits(outcome.batch_after)
    assert outcome.batch_after >= 0.5 * cell.largest_fitting(3000)
    assert namespace["last_batch"] == outcome.batch_after  # a failed last try is followed by a rerun of the best


def test_max_tries_is_never_exceeded():
    _, cell, namespace, run, driver, _ = setup(peak=lambda b: 100 * GiB, max_tries=2)
    source = TRAINING_CELL.format(batch=512)
    outcome = driver.fix(read_cell(source), fail_first(run, source), namespace, freed_bytes=0)
    assert outcome.reruns == 2 and not outcome.fitted and outcome.fixed_source is None
    assert "nothing fitted after 2 reruns" in outcome.headline()
    assert len(cell.calls) == 3


def test_a_non_oom_error_in_a_rerun_stops_the_search():
    _, cell, namespace, run, driver, _ = setup(max_tries=5)
    source = "batch_size = 4096\ntrain_step(batch_size)\nassert batch_size == 4096, 'the model needs 4096'\n"
    outcome = driver.fix(read_cell(source), fail_first(run, source), namespace, freed_bytes=0)
    assert outcome.reruns == 1 and not outcome.fitted
    assert outcome.tries[0].error.startswith("AssertionError: the model needs 4096")
    assert any("failed with AssertionError" in note for note in outcome.notes)


def test_a_failure_that_is_not_an_oom_is_refused():
    _, _, namespace, _, driver, _ = setup()
    with pytest.raises(CudaMemError, match="not a GPU out-of-memory error"):
        driver.fix(read_cell("x = 1\n"), ValueError("bad shape"), namespace)


class _FakeAutocastTorch:
    """A ``torch`` whose autocast halves the simulated activations, as bfloat16 does."""

    bfloat16 = "bfloat16"

    def __init__(self):
        self.active = False
        self.entered = []

    @contextlib.contextmanager
    def autocast(self, device, dtype):
        self.entered.append((device, dtype))
        self.active = True
        try:
            yield
        finally:
            self.active = False


def test_autocast_fixes_a_cell_with_no_batch():
    fake_torch = _FakeAutocastTorch()
    peak = lambda b: (3 * GiB if fake_torch.active else 7 * GiB)  # noqa: E731
    _, cell, namespace, run, driver, _ = setup(peak=peak, held=0)
    namespace.update(torch=fake_torch, weights=[2, 3], x=4)
    source = "outputs = [w * x for w in weights]  # no batch here\ntrain_step(1)\n"
    outcome = driver.fix(read_cell(source), fail_first(run, source), namespace, freed_bytes=0)
    assert outcome.strategy == "autocast" and outcome.reruns == 1
    assert fake_torch.entered == [("cuda", "bfloat16")]
    assert outcome.fixed_source == (
        'with torch.autocast("cuda", dtype=torch.bfloat16):\n'
        "    outputs = [w * x for w in weights]  # no batch here\n    train_step(1)\n"
    )
    assert any(note.startswith("no batch size in the cell") for note in outcome.notes)
    # Nothing in the cell looks like a model's forward pass: no inference advice.
    assert not any(s.title == "torch.no_grad() for inference" for s in outcome.suggestions)


def test_strategy_selection_and_bad_options():
    _, cell, namespace, run, _, _ = setup()
    machine = cell.machine
    driver = Driver(run, fake_hardware(machine), lambda e: None, strategies=("autocast",),
                    autocast_dtype=lambda: "float16")
    namespace["torch"] = _FakeAutocastTorch()
    source = TRAINING_CELL.format(batch=4000)
    outcome = driver.fix(read_cell(source), fail_first(run, source), namespace, freed_bytes=0)
    assert [t.strategy for t in outcome.tries] == [Strategy.AUTOCAST]
    assert check_strategies("batch, autocast") == (Strategy.BATCH, Strategy.AUTOCAST)
    assert all(type(s) is Strategy for s in check_strategies("cleanup batch") + check_strategies(None))
    assert check_strategies(None) == ("cleanup", "batch", "autocast")
    assert check_strategies(["autocast", "batch", "autocast"]) == ("autocast", "batch")
    with pytest.raises(CudaMemError, match="unknown strategy 'halve'; choose from cleanup, batch, autocast"):
        check_strategies("halve")
    assert check_max_tries(5) == 5 and check_max_tries("2") == 2
    for bad in (0, -1, "x", 1.5, "３", "1_0"):
        with pytest.raises(CudaMemError, match="max_tries must be"):
            check_max_tries(bad)
    with pytest.raises(CudaMemError):
        Driver(run, fake_hardware(machine), lambda e: None, max_tries=0)


def test_headroom_is_the_cap_less_what_is_held():
    machine = capped_machine(6 * GiB, held_bytes=1 * GiB)
    hardware = fake_hardware(machine)
    assert headroom_bytes(hardware, 0) == 5 * GiB
    machine.gpus[0].other_process_bytes = 79 * GiB - 512 * MiB  # another process fills the card
    assert headroom_bytes(hardware, 0) == 80 * GiB - (79 * GiB - 512 * MiB) - 512 * MiB - 1 * GiB


def test_gradient_accumulation_keeps_the_effective_batch():
    assert (accumulation_plan(512, 200).micro, accumulation_plan(512, 200).steps) == (128, 4)
    assert (accumulation_plan(512, 128).micro, accumulation_plan(512, 128).steps) == (128, 4)
    assert (accumulation_plan(512, 256).micro, accumulation_plan(512, 256).steps) == (256, 2)
    traits = cell_traits("loss = model(x).sum()\nloss.backward()\noptimizer.step()\n")
    suggestions = build_suggestions("", traits, 512, 128, "bfloat16", fragmented=False, autocast_fitted=False)
    accumulation = next(s for s in suggestions if s.title == "gradient accumulation")
    assert "accumulation_steps = 4" in accumulation.code and "batch_size=128" in accumulation.code
    assert "4 steps of 128" in accumulation.why
    hf = cell_traits("args = TrainingArguments('o', per_device_train_batch_size=64)\ntrainer.train()\n")
    code = build_suggestions("", hf, 64, 24, None, False, False)[0].code
    assert code == "TrainingArguments(..., per_device_train_batch_size=16, gradient_accumulation_steps=4)"


def test_advice_fits_the_cell():
    inference = cell_traits("y = model(x)\n")
    titles = [s.title for s in build_suggestions("", inference, None, None, "bfloat16", True, False)]
    assert titles == ["torch.no_grad() for inference", "expandable segments"]
    already = cell_traits("with torch.no_grad():\n    y = model(x)\n")
    assert build_suggestions("", already, None, None, None, False, False) == ()
    training = cell_traits("loss.backward()\n")
    titles = [s.title for s in build_suggestions("", training, None, None, "float16", False, True)]
    assert titles == ["activation checkpointing", "GradScaler for float16 training"]


def test_outcome_renders_as_text_and_html():
    _, cell, namespace, run, driver, _ = setup()
    source = TRAINING_CELL.format(batch=6000)
    outcome = driver.fix(read_cell(source), fail_first(run, source), namespace, freed_bytes=0)
    assert repr(outcome).splitlines()[:3] == list(outcome.lead())
    text = repr(replace(outcome, verbose=True))
    assert text.splitlines()[:3] == list(outcome.lead()) and outcome.headline() in text
    assert "smaller batch" in text and "a small first try" in text and "+batch_size = " in text
    html = outcome._repr_html_()
    assert html.count("<tr>") == outcome.reruns + 1
    assert "background:#e6ffed" in html and "gradient accumulation" in html


def test_plain_rerun_is_judged_by_what_the_cell_itself_needed():
    # The traceback held the cell's own partial work: freeing it does not make a plain rerun fit.
    machine, cell, namespace, run, driver, _ = setup(held=256 * MiB)
    source = TRAINING_CELL.format(batch=4000)
    error = fail_first(run, source)
    outcome = driver.fix(read_cell(source), error, namespace, freed_bytes=5 * GiB, allocated_before=256 * MiB)
    assert outcome.tries[0].strategy == "batch"
    assert any(note.startswith("skipped a plain rerun: the cell needs at least") for note in outcome.notes)
    # Memory held from before the cell (an older output, say) was freed: now a plain rerun can fit.
    _, cell, namespace, run, driver, _ = setup(held=256 * MiB)
    cell.machine.allocate(0, 3 * GiB)
    source = TRAINING_CELL.format(batch=600)
    error = fail_first(run, source)
    cell.machine.free(0, 3 * GiB)
    outcome = driver.fix(read_cell(source), error, namespace, freed_bytes=3 * GiB, allocated_before=256 * MiB + 3 * GiB,
                         cleaned=_cleaned(3 * GiB))
    assert [t.strategy for t in outcome.tries] == ["cleanup"] and outcome.fitted


def test_a_failed_try_leaves_nothing_behind():
    """A try whose backward() runs out of memory has already bound ``loss``, and with it the
    autograd graph of the forward pass. Seen on the H100: left bound, that graph made the next try
    fail too and stayed allocated after %oomfix. Failed tries are undone."""
    from jupyter_cudamem.reruns.set_aside import restore_bindings

    machine = capped_machine(4 * GiB)
    namespace: dict = {"kept": "the user's own"}

    class Graph:  # a loss tensor's autograd graph: the forward's activations, freed with it
        def __init__(self, size):
            machine.allocate(0, size)
            self.size = size

        def __del__(self):
            machine.free(0, getattr(self, "size", 0))  # nothing when its own allocation failed

    def run(source):
        batch = int(source.split("=", 1)[1].split("\n", 1)[0])
        try:
            namespace["loss"] = Graph(batch * MiB)  # forward done: loss holds the graph
            backward = batch * MiB + (600 * MiB if batch > 1500 else 0)  # a workspace past some size
            machine.allocate(0, backward)
            machine.free(0, backward)
            namespace["loss"] = 0.5  # backward frees the graph; the loss value remains
            namespace["trained_batch"] = batch
            return None
        except FakeOutOfMemoryError as error:
            return OutOfMemoryError(str(error))

    source = "batch_size = 8192\nloss = train(batch_size)\n"
    driver = Driver(run, fake_hardware(machine), lambda error: machine.empty_cache(), strategies=("batch",))
    outcome = driver.fix(read_cell(source), fail_first(run, source), namespace, freed_bytes=0)
    assert outcome.fitted and outcome.reruns <= 3
    # The line (2 MiB per item) predicts about 1966, which fails in backward; the next try fits
    # only if the failed try's graph is gone.
    assert [t.fitted for t in outcome.tries] == [True, False, True]
    assert namespace["trained_batch"] == outcome.batch_after and namespace["kept"] == "the user's own"
    assert machine.gpus[0].allocated == 0  # no graph of a failed try is alive

    before = {"a": 1, "b": [2]}
    after = {"a": 1, "b": [3], "c": 4, "_": "output cache"}
    assert sorted(restore_bindings(after, before)) == ["_", "b", "c"]  # the output cache's "_" included
    assert after == {"a": 1, "b": [2]}


CONFIG_CELL = 'config = {"lr": 1e-3,\n          "batch_size": 8192}\n'
CONFIG_USE = 'train_step(config["batch_size"])\nlast_batch = config["batch_size"]\n'


def test_a_batch_in_an_earlier_cell_is_changed_where_it_lives_and_shown_as_its_cell_diff():
    machine, cell, namespace, run, driver, _ = setup()
    namespace["config"] = {"lr": 1e-3, "batch_size": 8192}
    history = ["", CONFIG_CELL, CONFIG_USE]
    true_max = cell.largest_fitting(20000)
    outcome = driver.fix(read_cell(CONFIG_USE), fail_first(run, CONFIG_USE), namespace, freed_bytes=0,
                         history=history, cell_number=2)
    assert outcome.fitted and outcome.strategy == "batch" and outcome.reruns <= 3
    assert 0.9 * true_max <= outcome.batch_after <= true_max
    assert namespace["config"]["batch_size"] == outcome.batch_after == namespace["last_batch"]
    assert [d.label for d in outcome.cell_diffs] == ["In[1]"]
    assert f'+          "batch_size": {outcome.batch_after}}}' in outcome.diff
    assert outcome.paste.startswith("# In[1] with batch") and f'"batch_size": {outcome.batch_after}}}' in outcome.paste
    assert outcome.fixed_source == CONFIG_USE  # the failed cell itself is unchanged


def test_when_no_batch_fits_the_value_is_put_back_where_it_lives():
    _, cell, namespace, run, driver, _ = setup(peak=lambda b: 100 * GiB, max_tries=2)
    namespace["config"] = {"lr": 1e-3, "batch_size": 8192}
    outcome = driver.fix(read_cell(CONFIG_USE), fail_first(run, CONFIG_USE), namespace, freed_bytes=0,
                         history=["", CONFIG_CELL, CONFIG_USE], cell_number=2)
    assert not outcome.fitted and outcome.reruns == 2
    assert namespace["config"]["batch_size"] == 8192 and outcome.cell_diffs == () and outcome.paste is None


def test_the_oom_is_parsed_once_per_try_and_the_finder_runs_once(monkeypatch):
    from jupyter_cudamem.batch import finder
    from jupyter_cudamem.oomfix import driver as driver_module, tries as tries_module, whole_data

    calls = {"parse": 0, "find": 0, "whole data": 0}
    real_parse, real_find, real_whole = driver_module.parse_oom, driver_module.find_batch, finder.covers_whole_data

    def whole(*args, **kwargs):
        calls["whole data"] += 1
        return real_whole(*args, **kwargs)

    monkeypatch.setattr(finder, "covers_whole_data", whole)
    monkeypatch.setattr(whole_data, "covers_whole_data", whole)

    def parse(error):
        calls["parse"] += 1
        return real_parse(error)

    def find(*args, **kwargs):
        calls["find"] += 1
        return real_find(*args, **kwargs)

    monkeypatch.setattr(driver_module, "parse_oom", parse)  # the failed cell's OOM
    monkeypatch.setattr(tries_module, "parse_oom", parse)  # each try's
    monkeypatch.setattr(driver_module, "find_batch", find)
    _, cell, namespace, run, driver, _ = setup(hidden_limit=5 * GiB)
    source = TRAINING_CELL.format(batch=6000)
    outcome = driver.fix(read_cell(source), fail_first(run, source), namespace, freed_bytes=0)
    failed = sum(1 for t in outcome.tries if not t.fitted)
    assert calls["find"] == 1 and calls["whole data"] == 1  # the finder decides whether the batch is the data
    assert calls["parse"] == 1 + failed  # the original failure once, each failed try once


def _count_parses(monkeypatch):
    """Every ``ast.parse`` of the package, counted by the text parsed (``parse_cell`` and leftovers call it),
    from an empty memo of ``parse_cell`` (this test's own: what earlier tests parsed is not in it)."""
    import ast
    from collections import Counter
    from functools import lru_cache

    from jupyter_cudamem.cell import source as cell_source

    memo = cell_source._parse
    monkeypatch.setattr(cell_source, "_parse", lru_cache(maxsize=memo.cache_info().maxsize)(memo.__wrapped__))
    counts: Counter[str] = Counter()
    real = ast.parse

    def parse(text, *args, **kwargs):
        counts[text] += 1
        return real(text, *args, **kwargs)

    monkeypatch.setattr(ast, "parse", parse)
    return counts


def _trees_as_parsed(sources, transform, counts) -> bool:
    """Whether the trees ``parse_cell`` hands out for ``sources`` (from its memo: nothing is parsed again)
    are still what ``ast.parse`` makes of them: every reader shares one tree, so none may change it."""
    import ast

    from jupyter_cudamem.cell.source import parse_cell

    parses = sum(counts.values())
    trees = [parse_cell(s).tree for s in sources]
    assert sum(counts.values()) == parses
    return all(ast.dump(tree) == ast.dump(ast.parse(transform(s))) for tree, s in zip(trees, sources))


def test_a_fix_parses_the_failed_cell_once_and_no_try(monkeypatch):
    # A batch fix of three tries: the failed cell is read once (``read_cell``: its names, reads and traits;
    # the finder and the whole-data check share its tree through ``parse_cell``'s memo), and each try's
    # source, which changes only the batch, is run but never parsed.
    _, cell, namespace, run, driver, _ = setup(hidden_limit=5 * GiB)
    source = TRAINING_CELL.format(batch=6000)
    error = fail_first(run, source)
    counts = _count_parses(monkeypatch)
    outcome = driver.fix(read_cell(source), error, namespace, freed_bytes=0)
    assert outcome.reruns == 3 and outcome.strategy == "batch"
    assert len({source} | {t.source for t in outcome.tries}) == 4  # three texts besides the failed cell's
    assert counts == {cell.transform(source): 1}
    assert _trees_as_parsed([source], cell.transform, counts)


def test_the_failed_cell_is_parsed_once_when_autocast_wraps_it(monkeypatch):
    fake_torch = _FakeAutocastTorch()
    peak = lambda b: (3 * GiB if fake_torch.active else 7 * GiB)  # noqa: E731
    _, cell, namespace, run, driver, _ = setup(peak=peak, held=0)
    namespace.update(torch=fake_torch, weights=[2, 3], x=4)
    source = "outputs = [w * x for w in weights]\ntrain_step(1)\n"
    error = fail_first(run, source)
    counts = _count_parses(monkeypatch)
    outcome = driver.fix(read_cell(source), error, namespace, freed_bytes=0)
    assert outcome.strategy == "autocast" and outcome.fixed_source != source
    assert counts == {cell.transform(source): 1}  # the wrapped cell is run, not parsed again
    assert _trees_as_parsed([source], cell.transform, counts)


def test_the_outcome_says_what_does_not_grow_with_the_batch_read_from_the_namespace():
    import torch

    from jupyter_cudamem.attribution.probe import TensorProbe

    counts_cpu = TensorProbe((torch.Tensor,), (torch.nn.Module,), (torch.optim.Optimizer,), on_device=lambda t: True)
    machine, cell, namespace, run, driver, _ = setup(probe=counts_cpu)
    net = torch.nn.Linear(1000, 250)  # 250,250 float32: 1,001,000 bytes
    namespace.update(net=net, optimizer=torch.optim.AdamW(net.parameters()))
    # trains: .backward() and a step; it reads net and optimizer (a model it never read would count nothing)
    source = TRAINING_CELL.format(batch=4000) + "net.zero_grad()\noptimizer.step()\n"
    outcome = driver.fix(read_cell(source), fail_first(run, source), namespace, freed_bytes=0)
    note = next(note for note in outcome.notes if note.startswith("does not grow with the batch"))
    assert "977.54 KiB of gradients its backward pass makes" in note
    assert "1.91 MiB of optimizer state its first step makes" in note
    assert "parameters the cell builds" not in note  # built in an earlier cell: below the reference level


def test_autocast_is_not_tried_on_a_trainer_or_around_a_step_of_an_earlier_cell():
    _, cell, namespace, run, _, _ = setup()
    driver = Driver(run, fake_hardware(cell.machine), lambda e: None, strategies=("autocast",),
                    autocast_dtype=lambda: "bfloat16")
    namespace["torch"] = _FakeAutocastTorch()
    exec("class Trainer:\n    def train(self):\n        train_step(4000)\ntrainer = Trainer()\n", namespace)
    source = "trainer.train()\n"
    outcome = driver.fix(read_cell(source), fail_first(run, source), namespace, freed_bytes=0)
    assert outcome.tries == () and not outcome.fitted
    assert any(note.startswith("autocast not tried: a Trainer trains in this cell") and "bf16=True" in note
               for note in outcome.notes)
    # ``fit_one`` steps the optimizer (an earlier cell defined it): wrapping its call would put the step inside.
    exec("class Adam:\n    def step(self):\n        pass\noptimizer = Adam()\n"
         "def fit_one(n):\n    train_step(n)\n    optimizer.step()\n", namespace)
    source = "fit_one(4000)\n"
    driver = Driver(run, fake_hardware(cell.machine), lambda e: None, strategies=("autocast",),
                    autocast_dtype=lambda: "bfloat16")
    outcome = driver.fix(read_cell(source), fail_first(run, source), namespace, freed_bytes=0)
    assert outcome.tries == ()
    assert any("wrap the forward pass and the loss in torch.autocast inside that function" in n for n in outcome.notes)


def test_a_trainers_accumulation_advice_is_its_gradient_accumulation_steps():
    _, cell, namespace, run, driver, _ = setup()
    exec(
        "import dataclasses\n"
        "@dataclasses.dataclass\n"
        "class TrainingArguments:\n"
        "    per_device_train_batch_size: int = 4000\n"
        "class Trainer:\n"
        "    def __init__(self, args):\n"
        "        self.args, self._train_batch_size = args, args.per_device_train_batch_size\n"
        "    def train(self):\n"
        "        train_step(self._train_batch_size)\n"
        "trainer = Trainer(TrainingArguments())\n",
        namespace,
    )
    source = "trainer.train()\n"  # the Trainer was built in an earlier cell: the batch is its argument
    outcome = driver.fix(read_cell(source), fail_first(run, source), namespace, freed_bytes=0)
    assert outcome.fitted and outcome.strategy == "batch" and outcome.batch_after < 4000
    accumulation = next(s for s in outcome.suggestions if s.title == "gradient accumulation")
    assert accumulation.code.startswith("TrainingArguments(..., per_device_train_batch_size=")
    assert "gradient_accumulation_steps=" in accumulation.code and "for i, (x, y)" not in accumulation.code


class _GraphPools:
    """CUDA graph trees' pools refilled by every try (a reduce-overhead model records a graph per batch):
    64 KiB per sample of the batch run."""

    def __init__(self, allocator, cell):
        self.allocator, self.train_step = allocator, cell.train_step

    def __call__(self, batch):
        self.allocator.graph_pool_bytes = batch * 64 * 1024
        self.train_step(batch)


@pytest.mark.parametrize("last_fails", [False, True])
def test_cuda_graph_pools_are_reset_before_each_try_and_after_a_failed_last_one(last_fails):
    machine, cell, namespace, run, driver, _ = setup(peak=(lambda b: 100 * GiB) if last_fails else CNN, max_tries=2)
    allocator = driver.hardware.allocator
    namespace["train_step"] = _GraphPools(allocator, cell)
    source = TRAINING_CELL.format(batch=8 * 700)
    error = fail_first(run, source)
    outcome = driver.fix(read_cell(source), error, namespace, freed_bytes=0)
    calls = [c for c in allocator.calls if c.split(":")[0] in ("release_graph_pools", "renew_workspaces")]
    # Each try starts with the pools reset, then cuBLAS's workspaces made anew; a failed last try is followed
    # by one more reset, so the model's next call finds trees that work.
    assert calls[:2 * len(outcome.tries)] == ["release_graph_pools:0", "renew_workspaces:0"] * len(outcome.tries)
    assert calls[2 * len(outcome.tries):] == (["release_graph_pools:0"] if last_fails else [])
    assert outcome.tries[-1].fitted is not last_fails
    # One note, with the most a reset freed: the pool of the failed batch's run, or of the largest try's.
    most = format_bytes(max([5600] + [t.batch for t in outcome.tries]) * 64 * 1024)
    notes = [n for n in outcome.notes if n.startswith("torch.compile's CUDA graphs")]
    assert notes == [f'torch.compile\'s CUDA graphs (mode="reduce-overhead") held up to {most} in memory pools no '
                     "other allocation uses: reset (torch.compiler.reset()) before each rerun, which compiles again"]


def test_without_cuda_graph_pools_nothing_is_reset_or_said():
    _, cell, namespace, run, driver, _ = setup()
    source = TRAINING_CELL.format(batch=8 * 700)
    outcome = driver.fix(read_cell(source), fail_first(run, source), namespace, freed_bytes=0)
    assert outcome.fitted and not any("CUDA graphs" in note for note in outcome.notes)


def test_what_does_not_grow_counts_only_the_parameters_the_cell_trains():
    # Notebook 00: `layers`, a list of modules the cell never touches, was counted as gradients its backward
    # pass makes (192.23 MiB for a model of 64.17 MiB). The cell reads `model`, and `step` reads `opt`.
    import torch

    model, layers = torch.nn.Linear(4, 4), [torch.nn.Linear(8, 8)]
    opt = torch.optim.SGD(model.parameters())
    namespace = {"model": model, "layers": layers, "opt": opt, "torch": torch}
    exec("def step():\n    opt.step()\n", namespace)
    read = Driver._trained_ids(read_cell("loss = model(torch.ones(2, 4)).sum()\nloss.backward()\nstep()\n",
                                         lambda source: source), namespace)
    assert read == {id(p) for p in model.parameters()} | {id(opt)}


def _fixed_with_the_answer_below_the_best(monkeypatch, search_tries: int):
    """The training cell fixed with the search ended after ``search_tries`` and its answer 2 below the
    largest batch that fitted: the outcome, the namespace, the cell as written, its batch and that largest."""
    monkeypatch.setattr(BatchSearch, "answer", property(lambda search: (search.best or 0) - 2 if search.best else None))
    choose = BatchSearch._choose

    def ending_after(search):
        if len(search.attempts) >= search_tries:
            search.stop("the test's end")
            return None
        return choose(search)

    monkeypatch.setattr(BatchSearch, "_choose", ending_after)
    machine, cell, namespace, run, driver, cleanups = setup()
    written = 8 * cell.largest_fitting(20000)
    source = TRAINING_CELL.format(batch=written)
    outcome = driver.fix(read_cell(source), fail_first(run, source), namespace, freed_bytes=0)
    searched = max(t.batch for t in outcome.tries[:search_tries] if t.fitted and t.batch)
    return outcome, namespace, source, written, searched


@pytest.mark.parametrize("search_tries", [3, 2])
def test_a_batch_whose_own_run_does_not_keep_fitting_is_not_reported(monkeypatch, search_tries):
    # The replay of the last fitted try's own run (``Tries.answer``) says a batch 2 below it keeps fitting:
    # where the search ends with a rerun left, that batch is rerun (and is what the kernel holds); without
    # one, it is reported as the replay's, not as fitted, and the cell is for the user to run.
    outcome, namespace, source, written, searched = _fixed_with_the_answer_below_the_best(monkeypatch, search_tries)
    assert outcome.fitted and outcome.batch_after == searched - 2
    assert outcome.fixed_source == source.replace(str(written), str(outcome.batch_after))
    assert any("keeps fitting in that replay" in note for note in outcome.notes)
    last = outcome.tries[-1]
    if search_tries == 2:  # the rerun left proves it, and the kernel holds its run
        assert last.fitted and last.batch == outcome.batch_after
        assert namespace["last_batch"] == outcome.batch_after
        assert "fitted" in outcome.lead()[1] and "replay of its own requests" not in outcome.lead()[1]
    else:
        assert last.batch == searched and last.source != outcome.fixed_source
        assert any("run the fixed cell to get its results" in note for note in outcome.notes)
        what_fixed = outcome.lead()[1]
        assert f"Fixed with batch {outcome.batch_after}" in what_fixed and "replay of its own requests" in what_fixed


def test_a_confirming_rerun_whose_own_run_does_not_keep_fitting_is_not_reported_either(monkeypatch):
    # The rerun at the batch the replay of the last fit gave (2 below it) fitted once, but the replay of its
    # own run, from where it began (after the larger try's run), says 3 less keeps fitting: that batch is
    # reported, as the replay's, with both runs' notes, and the cell is for the user to run.
    monkeypatch.setattr(BatchSearch, "kept", lambda search, batch: batch - 3)
    outcome, _, source, written, searched = _fixed_with_the_answer_below_the_best(monkeypatch, 2)
    last = outcome.tries[-1]
    assert last.fitted and last.batch == searched - 2 and len(outcome.tries) == 3
    assert outcome.fitted and outcome.batch_after == searched - 5
    assert outcome.fixed_source == source.replace(str(written), str(searched - 5))
    kept = [note for note in outcome.notes if "keeps fitting in that replay" in note]
    assert kept == [f"rerun #2 at {searched} fitted once, but its own requests, replayed run after run as your next "
                    f"runs make them, run out of memory: {searched - 2} keeps fitting in that replay",
                    f"rerun #3 at {searched - 2} fitted once, but its own requests, replayed run after run as your "
                    f"next runs make them, run out of memory: {searched - 5} keeps fitting in that replay"]
    assert any("run the fixed cell to get its results" in note for note in outcome.notes)
    assert "replay of its own requests" in outcome.lead()[1]
