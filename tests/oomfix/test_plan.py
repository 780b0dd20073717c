"""The plan ``%oomfix --dry-run`` shows: the knob, where it lives, the first try (jupyter_cudamem/oomfix/plan.py)."""

from __future__ import annotations

from dataclasses import replace

from jupyter_cudamem.batch import find_batch
from jupyter_cudamem.oom import parse_oom
from jupyter_cudamem.oomfix.outcome import Outcome
from jupyter_cudamem.oomfix.plan import budget_from_message, plan_batch
from tests.fakes import GiB, MiB
from tests.oomfix.simulated import torch_oom_message

HISTORY = ["", "config = {'lr': 1e-3,\n          'batch_size': 256}\n"]
SOURCE = "x = torch.randn(config['batch_size'], 10)\nmodel(x)\n"
NAMESPACE = {"config": {"lr": 1e-3, "batch_size": 256}, "model": None}
STRATEGIES = ("cleanup", "batch", "autocast")


def test_the_message_gives_a_floor_of_the_room():
    free = parse_oom(torch_oom_message(2 * GiB, 80 * GiB, 1 * GiB, 79 * GiB, None, 70 * GiB, 100 * MiB))
    assert budget_from_message(free) == 1 * GiB + 100 * MiB
    capped = parse_oom(torch_oom_message(2 * GiB, 80 * GiB, 70 * GiB, 5 * GiB, 6 * GiB, 4 * GiB, 0))
    # The cap, not the card, bounds it: 6 GiB less the 4 GiB PyTorch reserved (the 5 GiB NVML counts for
    # the process includes the CUDA context, which the cap does not count).
    assert budget_from_message(capped) == 2 * GiB
    assert budget_from_message(None) is None


def test_the_plan_names_the_knob_its_home_and_the_search_first_try_with_its_diff():
    finding = find_batch(SOURCE, NAMESPACE, history=HISTORY, cell_number=2)
    plan = plan_batch(finding, NAMESPACE, HISTORY, 4 * GiB, STRATEGIES)
    # The search's first try is its probe, the failed batch over 64: 256 / 64 = 4 (no need is known, so the
    # budget does not scale it).
    first = 4
    assert plan.first_batch == first and plan.knob.label == 'config["batch_size"]'
    text = "\n".join(plan.lines())
    assert "plan: cleanup alone, smaller batch, autocast, in that order" in text
    assert 'smaller batch: config["batch_size"] = 256 (a config field, In[1] line 2)' in text
    assert "-          'batch_size': 256}" in text and f"+          'batch_size': {first}}}" in text
    assert NAMESPACE["config"]["batch_size"] == 256  # nothing was changed
    assert "<code>config[&quot;batch_size&quot;] = 256</code>" in plan.html()
    outcome = Outcome(SOURCE, None, None, (), batch_summary=finding.summary(), dry_run=True, plan=plan)
    assert outcome.dry_run and outcome.tries == () and "Plan" in outcome._repr_html_()
    assert "first try" in replace(outcome, verbose=True).text()


def test_without_a_budget_or_a_knob_the_plan_says_so():
    finding = find_batch(SOURCE, NAMESPACE, history=HISTORY, cell_number=2)
    assert "cannot be read here" in "\n".join(plan_batch(finding, NAMESPACE, HISTORY, None, STRATEGIES).lines())
    nothing = find_batch("outs = [a @ a for _ in range(4)]\n", {"a": None})
    lines = plan_batch(nothing, {}, [], 4 * GiB, STRATEGIES).lines()
    assert lines[1].startswith("  smaller batch: nothing to shrink (no batch size in the cell")
    assert plan_batch(finding, NAMESPACE, HISTORY, 4 * GiB, ("autocast",)).lines() == ["plan: autocast, in that order"]
