"""``%oomfix`` and ``%%oomfix`` in a real InteractiveShell, with a simulated cell whose OOM carries a
real torch message, on fake hardware (jupyter_cudamem/magics/oomfix.py)."""

from __future__ import annotations


import pytest
from tests.oomfix.shells import shell_without_failures
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

import jupyter_cudamem.magics as magics
from jupyter_cudamem.magics.oomfix import OomFix
from jupyter_cudamem.ipython_state import recorder_for
from tests.fakes import FakeAllocator, FakeNvml, FakeTensor, GiB, MiB, fake_probe
from tests.oomfix.simulated import SimulatedCell, capped_machine, fake_hardware
from jupyter_cudamem.hardware import Hardware

CNN = lambda b: 7.05 * MiB * b + 30 * MiB  # noqa: E731

FAILING_CELL = """batch_size = 6000
train_step(batch_size)
finished_with = batch_size
"""


@pytest.fixture
def env():
    shell = shell_without_failures()
    shell.rl_next_input = None
    machine = capped_machine(6 * GiB, held_bytes=128 * MiB)
    cell = SimulatedCell(machine, CNN)
    extension = magics.load(shell, fake_hardware(machine))
    magic = extension.get(OomFix)
    magic.probe = fake_probe()
    shell.user_ns.update(train_step=cell.train_step, keep_me=42, machine=machine, FakeTensor=FakeTensor, MiB=MiB, GiB=GiB)
    yield shell, machine, cell, magic
    magics.unload(shell)


def run(shell, source):
    return shell.run_cell(source, store_history=True)


def usage_error(shell, line):
    """Run a magic line as a cell; return the one-line error it gave."""
    result = shell.run_cell(line, store_history=True)
    assert isinstance(result.error_in_exec, UsageError), result.error_in_exec
    message = str(result.error_in_exec)
    assert "\n" not in message
    return message


def test_oomfix_fixes_the_last_failed_cell(env, capsys):
    shell, machine, cell, magic = env
    failed = run(shell, FAILING_CELL)
    assert type(failed.error_in_exec).__name__ == "OutOfMemoryError"
    capsys.readouterr()
    outcome = shell.run_line_magic("oomfix", "--yes -o")
    true_max = cell.largest_fitting(6000)
    assert outcome.fitted and outcome.strategy == "batch" and outcome.reruns <= 3
    assert 0.9 * true_max <= outcome.batch_after <= true_max
    assert shell.user_ns["finished_with"] == outcome.batch_after  # the rerun really ran in the namespace
    assert shell.user_ns["keep_me"] == 42
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err  # the tries' OOMs are results, not tracebacks
    # Three lines first: what failed and why, what fixed it with its proof, the change to make.
    failed_line, fixed_line, change_line = out.out.splitlines()[:3]
    assert failed_line.startswith("In[") and "ran out of GPU memory: it needs more than the 6.00 GiB per-process cap" in failed_line
    assert fixed_line.startswith(f"Fixed with batch {outcome.batch_after} (was 6000): the rerun at batch {outcome.batch_after} "
                                 "fitted, peak ")
    assert change_line == (f"Change In[{failed.execution_count}]: batch_size = 6000  ->  batch_size = {outcome.batch_after} "
                           "(--apply puts it in the next input; the kernel already holds what it made)")
    assert "--verbose" in out.out and " #  strategy" not in out.out  # the tries table is behind --verbose
    assert shell.rl_next_input is None  # nothing put in the next input without --apply
    assert machine.gpus[0].allocated == 128 * MiB
    assert recorder_for(shell).last is None  # fixed: %oomfix again would have nothing to do


def test_apply_puts_the_fixed_cell_in_the_next_input(env, capsys):
    shell, _, _, _ = env
    run(shell, FAILING_CELL)
    outcome = shell.run_line_magic("oomfix", "--yes --apply -o")
    assert shell.rl_next_input == outcome.fixed_source
    assert outcome.fixed_source.startswith(f"batch_size = {outcome.batch_after}\n")
    assert "in the next input" in capsys.readouterr().out


def test_cleanup_frees_the_output_cache_and_a_plain_rerun_fits(env):
    shell, machine, cell, _ = env
    run(shell, "FakeTensor(3 * GiB, machine=machine)\n")  # displayed, so IPython's Out keeps it
    failed = run(shell, "train_step(600)\nfinished_with = 600\n")  # 4.2 GiB more does not fit beside it
    assert failed.error_in_exec is not None
    assert machine.gpus[0].allocated == 128 * MiB + 3 * GiB
    outcome = shell.run_line_magic("oomfix", "--yes -o")
    assert outcome.freed_bytes == 3 * GiB
    assert outcome.strategy == "cleanup" and outcome.reruns == 1 and not outcome.changed
    assert shell.user_ns["finished_with"] == 600 and machine.gpus[0].allocated == 128 * MiB


def test_cleanup_frees_what_the_failed_traceback_held(env):
    shell, machine, cell, _ = env
    run(shell, "def step(n):\n    big = FakeTensor(3 * GiB, machine=machine)\n    train_step(n)\n")
    run(shell, "step(6000)\n")
    assert machine.gpus[0].allocated == 128 * MiB + 3 * GiB  # the traceback keeps `big` alive
    outcome = shell.run_line_magic("oomfix", "--yes --strategy batch --max-tries 1 -o")
    assert outcome.freed_bytes == 3 * GiB
    assert machine.gpus[0].allocated == 128 * MiB  # and every try's frames were released too


def test_not_an_oom_is_one_line_and_does_nothing(env):
    shell, machine, cell, _ = env
    run(shell, "x = 1\nraise ValueError('shapes do not match')\n")
    message = usage_error(shell, "%oomfix --yes")
    assert message == "the last failure was ValueError, not a GPU out-of-memory error; %oomfix did nothing"
    assert cell.calls == [] and shell.user_ns["x"] == 1


def test_no_failure_at_all(env):
    shell, _, _, _ = env
    assert "no failed cell to fix" in usage_error(shell, "%oomfix")


def test_without_yes_and_without_stdin_it_asks_for_yes_and_changes_nothing(env, monkeypatch):
    shell, machine, cell, _ = env
    run(shell, "def step(n):\n    big = FakeTensor(3 * GiB, machine=machine)\n    train_step(n)\n")
    run(shell, "step(6000)\n")
    calls = list(cell.calls)

    def no_stdin(prompt=""):
        raise EOFError

    monkeypatch.setattr("builtins.input", no_stdin)
    message = usage_error(shell, "%oomfix")
    assert "add --yes" in message
    assert cell.calls == calls  # nothing rerun
    assert machine.gpus[0].allocated == 128 * MiB + 3 * GiB  # nothing freed either


def test_the_question_is_asked_and_no_means_no(env, monkeypatch, capsys):
    shell, _, cell, _ = env
    run(shell, FAILING_CELL)
    monkeypatch.setattr("builtins.input", lambda prompt="": "n")
    assert shell.run_line_magic("oomfix", "-o") is None
    out = capsys.readouterr().out
    assert "repeats" not in out or "happens again" in out
    assert "happens again" in out and "Nothing rerun" in out
    assert cell.calls == [6000]
    monkeypatch.setattr("builtins.input", lambda prompt="": "y")
    assert shell.run_line_magic("oomfix", "-o").fitted


def test_dry_run_diagnoses_and_runs_nothing(env, capsys):
    shell, machine, cell, _ = env
    run(shell, "held = FakeTensor(1 * GiB, machine=machine)\n")
    run(shell, FAILING_CELL)
    outcome = shell.run_line_magic("oomfix", "--dry-run --verbose -o")
    assert outcome.dry_run and outcome.tries == () and outcome.diagnosis is not None
    assert "batch_size = 6000 (line 1)" in outcome.batch_summary
    assert cell.calls == [6000]
    assert "held" in shell.user_ns and machine.gpus[0].allocated == 128 * MiB + 1 * GiB
    assert "diagnosis only" in capsys.readouterr().out


def test_del_deletes_only_what_is_named(env):
    shell, machine, _, _ = env
    run(shell, "held = FakeTensor(1 * GiB, machine=machine)\nother = FakeTensor(256 * MiB, machine=machine)\n")
    run(shell, FAILING_CELL)
    assert "--del nope: no such variable" in usage_error(shell, "%oomfix --yes --del nope")
    assert "held" in shell.user_ns
    outcome = shell.run_line_magic("oomfix", "--yes --del held -o")
    assert "held" not in shell.user_ns and "other" in shell.user_ns
    assert outcome.freed_bytes == 1 * GiB


def test_cell_magic_runs_a_fitting_cell_once_and_fixes_a_failing_one(env, capsys):
    shell, _, cell, _ = env
    shell.run_cell_magic("oomfix", "--yes", "batch_size = 100\ntrain_step(batch_size)\nran = batch_size\n")
    assert cell.calls == [100] and shell.user_ns["ran"] == 100
    assert capsys.readouterr().out == ""
    outcome = shell.run_cell_magic("oomfix", "--yes -o", FAILING_CELL)
    assert outcome.fitted and shell.user_ns["finished_with"] == outcome.batch_after
    assert "ran out of GPU memory" in capsys.readouterr().out


def test_cell_magic_leaves_other_errors_to_ipython(env):
    shell, _, cell, _ = env
    result = run(shell, "%%oomfix --yes\nraise KeyError('not memory')\n")
    assert isinstance(result.error_in_exec, KeyError)  # the cell fails as a plain cell does
    assert cell.calls == []


def test_options_and_config(env):
    shell, _, cell, magic = env
    run(shell, FAILING_CELL)
    assert "unknown strategy 'halve'" in usage_error(shell, "%oomfix --yes --strategy halve")
    assert "nothing" in usage_error(shell, "%oomfix --yes --strategy autocast --no-autocast")
    shell.run_line_magic("config", "OomFix.max_tries = 1")
    assert magic.max_tries == 1
    outcome = shell.run_line_magic("oomfix", "--yes -o")
    assert outcome.reruns == 1
    assert len(cell.calls) == 2


def test_help_documents_the_options(env):
    shell, _, _, magic = env
    doc = magic.oomfix.__doc__
    for option in ("--dry-run", "--max-tries", "--del", "--apply", "--yes", "--no-autocast", "--strategy"):
        assert option in doc


def test_no_gpu_is_one_line():
    shell = InteractiveShell.instance()
    machine = capped_machine(6 * GiB)
    hardware = Hardware(allocator=FakeAllocator(machine, status="PyTorch sees no CUDA device"),
                        nvml=FakeNvml(machine, failure="NVML: driver not loaded"), pid=machine.pid,
                        pid_exists=lambda p: True)
    magics.load(shell, hardware)
    try:
        message = usage_error(shell, "%oomfix")
        assert message == "%oomfix needs a CUDA device: PyTorch sees no CUDA device"
    finally:
        magics.unload(shell)


def test_unload_detaches_the_failure_recorder():
    shell = InteractiveShell.instance()
    machine = capped_machine(6 * GiB)
    magics.load(shell, fake_hardware(machine))
    recorder = recorder_for(shell)
    assert recorder is not None and recorder.post_run_cell in shell.events.callbacks["post_run_cell"]
    magics.unload(shell)
    assert recorder_for(shell) is None
    assert recorder.post_run_cell not in shell.events.callbacks["post_run_cell"]
    assert "oomfix" not in shell.magics_manager.magics["line"]


def test_each_oom_is_parsed_once_from_the_failed_cell_through_every_rerun(env, monkeypatch):
    # Parsing an OOM ends in oom._from_text, whoever asks (is_cuda_oom, parse_oom, the recorder, the
    # hook that hides a rerun's traceback, the driver): once for the failed cell, once per failed rerun.
    from jupyter_cudamem import oom as parse

    shell, machine, cell, magic = env
    cell.hidden_limit_bytes = 5 * GiB  # fragmentation: the first prediction fails, so reruns run out of memory
    calls = []
    real = parse._from_text
    monkeypatch.setattr(parse, "_from_text", lambda *args: calls.append(args[1]) or real(*args))
    run(shell, FAILING_CELL)
    assert len(calls) == 1
    outcome = shell.run_line_magic("oomfix", "--yes -o --max-tries 3")
    failed = [t for t in outcome.tries if t.out_of_memory]
    assert failed, "the search should have had a try that ran out of memory"
    assert len(calls) == 1 + len(failed)


def test_one_oomfix_of_three_batch_tries_parses_the_failed_cell_once_and_no_try(env, monkeypatch):
    # The failed cell is read once (``oomfix.fix`` reads it into a ``cell.read.ReadCell``, which the restorer,
    # the driver, the set-aside and the tries share; the batch finder shares its tree through
    # ``parse_cell``'s memo, emptied here so that nothing parsed before counts): ``ast.parse`` runs once on
    # it, whatever runs the magic, and the tries' sources, three other texts, are run, never parsed.
    import ast
    from collections import Counter
    from functools import lru_cache

    from jupyter_cudamem.cell import source as cell_source

    shell, _, cell, _ = env
    cell.hidden_limit_bytes = 5 * GiB  # fragmentation: the first prediction fails, so the search takes 3 tries
    run(shell, FAILING_CELL)
    memo = cell_source._parse
    monkeypatch.setattr(cell_source, "_parse", lru_cache(maxsize=memo.cache_info().maxsize)(memo.__wrapped__))
    parsed: Counter[str] = Counter()
    real = ast.parse
    monkeypatch.setattr(ast, "parse", lambda text, *args, **kwargs: parsed.update([text]) or real(text, *args, **kwargs))
    outcome = shell.run_line_magic("oomfix", "--yes -o --strategy batch --max-tries 3")
    assert outcome.strategy == "batch" and outcome.reruns == 3
    assert len({t.source for t in outcome.tries} - {FAILING_CELL}) == 3
    assert parsed == {shell.transform_cell(FAILING_CELL): 1}


# -- reruns leave no trace in what the cell trains (reruns/model_state.py) ----------------------------
TRAINING_CELL = """batch_size = 6000
train_step(batch_size)
x = torch.linspace(-1, 1, batch_size * 4).view(batch_size, 4)
for _ in range(3):
    optimizer.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
"""


@pytest.fixture
def trained(env):
    """A real CPU model and Adam optimizer the training cell steps; the OOM comes from the simulated
    ``train_step`` before any step, so the failed cell leaves them as it found them."""
    import copy

    torch = pytest.importorskip("torch")
    shell = env[0]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    shell.user_ns.update(torch=torch, model=model, optimizer=optimizer)
    reference = copy.deepcopy((model, optimizer))  # the state one plain run of the fitted cell starts from
    return torch, model, optimizer, reference


def _plain_run(torch, reference, source):
    """One plain run of ``source`` on the reference copies (the simulated memory step does nothing)."""
    model, optimizer = reference
    exec(source, {"torch": torch, "model": model, "optimizer": optimizer, "train_step": lambda n: None})
    return model, optimizer


def _same_state(torch, model, optimizer, other_model, other_optimizer) -> bool:
    weights = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other_model.state_dict().values()))
    grads = all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), other_model.parameters()))
    state, other = optimizer.state_dict()["state"], other_optimizer.state_dict()["state"]
    moments = all(torch.equal(state[k][n], other[k][n]) for k in state for n in ("step", "exp_avg", "exp_avg_sq"))
    return weights and grads and moments and state.keys() == other.keys()


@pytest.mark.parametrize("tries", [3, 8])  # 8: the search ends on its own, after a try that fitted
def test_after_oomfix_the_model_and_optimizer_are_as_one_run_of_the_fitted_cell(env, trained, capsys, tries):
    shell, _, cell, _ = env
    torch, model, optimizer, reference = trained
    assert run(shell, TRAINING_CELL).error_in_exec is not None
    outcome = shell.run_line_magic("oomfix", f"--yes --max-tries {tries} -o")
    assert len(outcome.tries) < tries or tries == 3
    assert outcome.fitted and outcome.strategy == "batch" and outcome.reruns >= 2  # reruns that stepped
    assert len([c for c in cell.calls if c <= outcome.batch_after]) >= 2
    plain_model, plain_optimizer = _plain_run(torch, reference, outcome.fixed_source)
    assert _same_state(torch, model, optimizer, plain_model, plain_optimizer)
    assert next(iter(optimizer.state_dict()["state"].values()))["step"].item() == 3.0  # one run: 3 steps
    assert "optimizer, model put back before each rerun: as one run of the cell that fitted leaves them" \
        in outcome.notes


LOGGING_CELL = """batch_size = 6000
train_step(batch_size)
losses.append(batch_size)
history["runs"] = history.get("runs", 0) + 1
step += 1
"""


@pytest.mark.parametrize("no_restore", [False, True])
def test_the_lists_and_counters_a_cell_changes_are_as_one_run_of_the_fitted_cell(env, capsys, no_restore):
    shell, _, _, _ = env
    run(shell, "losses = []\nhistory = {}\nstep = 0\n")
    losses = shell.user_ns["losses"]
    assert run(shell, LOGGING_CELL).error_in_exec is not None  # failed before it appended
    outcome = shell.run_line_magic("oomfix", f"--yes --max-tries 3 -o{' --no-restore' if no_restore else ''}")
    fitted = [t.batch for t in outcome.tries if t.fitted]
    assert outcome.fitted and len(fitted) >= 2 and outcome.tries[-1].fitted
    if no_restore:  # every rerun's appends stay, as --no-restore says
        assert losses == fitted and shell.user_ns["step"] == len(fitted)
        assert not any("losses" in note for note in outcome.notes)
    else:
        assert shell.user_ns["losses"] is losses and losses == [outcome.batch_after]
        assert shell.user_ns["history"] == {"runs": 1} and shell.user_ns["step"] == 1
        assert "losses, history, step put back before each rerun: as one run of the cell that fitted leaves them" \
            in outcome.notes


def test_a_knob_in_a_dict_holds_the_best_batch_when_the_last_rerun_failed(env):
    """The values put back after a failed last rerun are the notebook's, not the batch the fix set."""
    shell, _, cell, _ = env
    calls: list[int] = []

    def step(batch):
        calls.append(batch)
        cell.train_step(batch if len(calls) < 4 else 10**7)  # the third rerun fails, whatever its batch

    shell.user_ns["step"] = step
    run(shell, "config = {'batch_size': 6000}\nlosses = []\n")
    assert run(shell, "step(config['batch_size'])\nlosses.append(config['batch_size'])\n").error_in_exec is not None
    outcome = shell.run_line_magic("oomfix", "--yes --max-tries 3 -o")
    assert [t.fitted for t in outcome.tries] == [True, True, False]
    assert outcome.fitted and outcome.batch_after == outcome.tries[1].batch
    assert shell.user_ns["config"] == {"batch_size": outcome.batch_after}  # where the fix set it
    assert shell.user_ns["losses"] == []  # as before the reruns, like the model; the cell is to be run again
    failed = next(note for note in outcome.notes if note.startswith("the last rerun (#3) failed after #2 fitted"))
    assert "what the cell trains and changes is as before the reruns" in failed, failed
    assert "run the fixed cell again" in failed and "config, losses put back as they were before the reruns" in outcome.notes


def test_no_restore_leaves_every_reruns_steps(env, trained, capsys):
    shell, _, _, _ = env
    torch, model, optimizer, reference = trained
    run(shell, TRAINING_CELL)
    outcome = shell.run_line_magic("oomfix", "--yes --no-restore --max-tries 3 -o")
    fitted_runs = sum(1 for t in outcome.tries if t.fitted)
    assert outcome.fitted and fitted_runs >= 2
    plain_model, plain_optimizer = _plain_run(torch, reference, outcome.fixed_source)
    assert not _same_state(torch, model, optimizer, plain_model, plain_optimizer)
    assert next(iter(optimizer.state_dict()["state"].values()))["step"].item() == 3.0 * fitted_runs
    assert "the reruns' training steps stayed in optimizer, model: their state was not put back" in outcome.notes


def test_when_every_rerun_fails_the_state_is_as_before_the_reruns(env, trained):
    shell, machine, _, _ = env
    torch, model, optimizer, reference = trained
    # Steps first, then memory that never fits (no allocation past 1 MiB succeeds, whatever the batch):
    # each failed rerun has stepped before it failed.
    shell.user_ns["never_fits"] = SimulatedCell(machine, CNN, hidden_limit_bytes=MiB).train_step
    cell = "for _ in range(2):\n    optimizer.zero_grad()\n    model(torch.ones(4, 4)).sum().backward()\n" \
           "    optimizer.step()\nnever_fits(6000)\n"
    reference_model, reference_optimizer = reference
    run(shell, cell)  # the failed cell's own two steps stay: the copy is taken after it
    _plain_run(torch, reference, cell.replace("never_fits(6000)\n", ""))
    outcome = shell.run_line_magic("oomfix", "--yes --strategy batch --max-tries 2 -o")
    assert not outcome.fitted and len(outcome.tries) == 2
    assert "optimizer, model put back as they were before the reruns" in outcome.notes
    assert _same_state(torch, model, optimizer, reference_model, reference_optimizer)


def test_a_copy_too_large_for_the_host_is_said_before_rerunning(env, trained, monkeypatch, capsys):
    shell, _, cell, _ = env
    run(shell, TRAINING_CELL)
    # Linear(4, 8), BatchNorm1d(8), Linear(8, 1): 40 + 16 + 9 = 65 float32 parameters, 260 bytes, no
    # .grad yet; BatchNorm's buffers 8 + 8 floats and an int64 counter, 72 bytes; Adam has no state yet.
    monkeypatch.setattr("jupyter_cudamem.sources.host.available_bytes", lambda: 400)  # 0.8 x 400 = 320 < 332
    message = usage_error(shell, "%oomfix --yes")
    assert message == (
        "the model and optimizer state the cell trains (optimizer, model) takes 332 B, more than the host can "
        "copy (400 B available), so it cannot be put back before each rerun: every rerun's training steps "
        "would stay; add --no-restore to rerun anyway"
    )
    assert cell.calls == [6000]  # nothing rerun
    monkeypatch.setattr("builtins.input", lambda prompt="": "y")
    outcome = shell.run_line_magic("oomfix", "--max-tries 3 -o")  # asked: the question says it, the user chooses
    assert "Note: the model and optimizer state the cell trains" in capsys.readouterr().out
    assert outcome.fitted


def test_oomfix_after_a_cudamem_limit_cell_plans_under_its_cap(env, capsys):
    """The failed cell ran under ``%%cudamem --limit 3GiB`` on a process capped at 6 GiB: its reruns run
    under 3 GiB again, so the plan's room is the cell's cap, and no try's traceback is printed."""
    shell, machine, cell, magic = env
    source = "%%cudamem --limit 3GiB\nbatch_size = 6000\ntrain_step(batch_size)\nfinished_with = batch_size\n"
    failed = run(shell, source)
    assert type(failed.error_in_exec).__name__ == "OutOfMemoryError"
    capsys.readouterr()
    process_fraction = machine.gpus[0].fraction
    outcome = shell.run_line_magic("oomfix", "--yes --max-tries 3 -o")
    # 3 GiB less the 128 MiB held: 2.875 GiB of room; at 7.05 MiB a sample and 30 MiB fixed, 413 samples fit.
    assert outcome.budget_bytes <= 3 * GiB - 128 * MiB
    assert outcome.fitted and outcome.batch_after <= 413 and shell.user_ns["finished_with"] == outcome.batch_after
    assert "planned under the cell's --limit 3.00 GiB: its reruns run under it too" in outcome.notes
    assert machine.gpus[0].fraction == process_fraction  # the process's own cap is back
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
