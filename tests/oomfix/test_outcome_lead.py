"""The three lines ``%oomfix`` shows first, for the common outcomes, and what ``--verbose`` adds
(jupyter_cudamem/oomfix/outcome.py)."""

from __future__ import annotations

from dataclasses import replace

from jupyter_cudamem.advice import Suggestion
from jupyter_cudamem.oom import parse_oom
from jupyter_cudamem.oomfix.diagnosis import diagnose
from jupyter_cudamem.oomfix.outcome import Outcome, TryResult
from jupyter_cudamem.oomfix.strategies import Strategy
from tests.fakes import GiB, MiB
from tests.oomfix.simulated import torch_oom_message

SOURCE = "batch_size = 1024\nx = torch.randn(batch_size, 4096, device='cuda')\nloss = model(x).sum()\nloss.backward()"
# Asked 512 MiB under a 4 GiB cap with 3.75 GiB allocated: the cell needs more than the cap allows.
DIAGNOSIS = diagnose(parse_oom(torch_oom_message(512 * MiB, 80 * GiB, 70 * GiB, 4 * GiB + 700 * MiB, 4 * GiB,
                                                 int(3.75 * GiB), 0)), [], None)
FIRST = "In[7] ran out of GPU memory: it needs more than the 4.00 GiB per-process cap allows"


def _try(number, strategy, source, fitted, peak, batch=None, reason="") -> TryResult:
    return TryResult(number, strategy, source, fitted, not fitted, peak, 0.1, reason, batch=batch)


def _outcome(**fields) -> Outcome:
    return Outcome(original_source=SOURCE, diagnosis=DIAGNOSIS, cell_name="In[7]", budget_bytes=4 * GiB,
                   kept=True, **fields)


def test_a_batch_fix_leads_with_the_cause_the_fitted_batch_and_its_one_line_edit():
    fixed = SOURCE.replace("1024", "480")
    outcome = _outcome(fixed_source=fixed, strategy=Strategy.BATCH, batch_before=1024, batch_after=480, tries=(
        _try(1, Strategy.BATCH, SOURCE.replace("1024", "16"), True, 200 * MiB, 16),
        _try(2, Strategy.BATCH, fixed, True, int(3.5 * GiB), 480)))
    assert outcome.text().splitlines()[:3] == [
        FIRST,
        "Fixed with batch 480 (was 1024): the rerun at batch 480 fitted, peak 3.50 GiB of the 4.00 GiB free",
        "Change In[7]: batch_size = 1024  ->  batch_size = 480 (--apply puts it in the next input; "
        "the kernel already holds what it made)",
    ]
    assert " #  strategy" not in outcome.text() and "figures:" not in outcome.text()
    applied = replace(outcome, applied=True, kept=False).text().splitlines()[2]
    assert applied.endswith("(it is in the next input; run it to get its results)")
    # A try after one that fitted ran holding what a run leaves: the proof line says so.
    steady = replace(outcome, tries=(outcome.tries[0], replace(outcome.tries[1], steady=True)))
    assert steady.text().splitlines()[1] == (
        "Fixed with batch 480 (was 1024): the rerun at batch 480 fitted, peak 3.50 GiB of the 4.00 GiB free, "
        "holding what a run leaves, as your next runs will")


def test_an_autocast_fix_names_autocast_and_asks_to_paste_the_cell_where_lines_change():
    fixed = "with torch.autocast('cuda', dtype=torch.bfloat16):\n" + "".join(
        "    " + line + "\n" for line in SOURCE.splitlines())
    outcome = _outcome(fixed_source=fixed, strategy=Strategy.AUTOCAST, tries=(
        _try(1, Strategy.AUTOCAST, fixed, True, int(2.5 * GiB), reason="torch.autocast('cuda', dtype=torch.bfloat16)"),))
    lines = outcome.text().splitlines()
    assert lines[1] == ("Fixed under torch.autocast('cuda', dtype=torch.bfloat16): the rerun fitted, "
                        "peak 2.50 GiB of the 4.00 GiB free")
    assert lines[2] == ("Paste the cell below (--apply puts it in the next input; the kernel already holds what it "
                        "made)")
    assert lines[3] == "" and "\n".join(lines[4:4 + len(fixed.splitlines())]) == fixed.rstrip("\n")


def test_a_cleanup_fix_says_nothing_is_to_change():
    outcome = _outcome(fixed_source=SOURCE, strategy=Strategy.CLEANUP, freed_bytes=GiB,
                       tries=(_try(1, Strategy.CLEANUP, SOURCE, True, 3 * GiB),))
    assert outcome.text().splitlines()[1:3] == [
        "Fixed by the cleanup (it freed 1.00 GiB): the cell as written fitted, peak 3.00 GiB of the 4.00 GiB free",
        "Nothing to change: the kernel holds what the rerun made",
    ]


def test_a_cleanup_that_freed_what_del_named_is_not_explained_again_without_the_name():
    # Tutorial 5's ``--del old_embeddings``: the fix found nothing to explain (an empty note), and the
    # details said "1.50 GiB more than the holders listed", asked again without the deleted name.
    outcome = _outcome(fixed_source=SOURCE, strategy=Strategy.CLEANUP, freed_bytes=int(1.5 * GiB), cleanup_note="",
                       tries=(_try(1, Strategy.CLEANUP, SOURCE, True, 3 * GiB),), verbose=True)
    assert "cleanup freed 1.50 GiB;" in outcome.text() and "more than the holders listed" not in outcome.text()
    assert "more than the holders listed" in replace(outcome, cleanup_note=None).text()


def test_nothing_fitted_says_so_and_gives_the_first_advice():
    outcome = _outcome(fixed_source=None, strategy=None, tries=(
        _try(1, Strategy.BATCH, SOURCE.replace("1024", "16"), False, 4 * GiB, 16),),
        suggestions=(Suggestion("activation checkpointing", "recomputes activations"),))
    lines = outcome.text().splitlines()
    assert lines[0] == FIRST and lines[1] == "Not fixed: none of 1 rerun fitted"
    assert lines[2] == f"Try: {DIAGNOSIS.suggestions[0]}"


def test_verbose_shows_the_rest_in_text_and_html_opens_its_details():
    fixed = SOURCE.replace("1024", "480")
    outcome = _outcome(fixed_source=fixed, strategy=Strategy.BATCH, batch_before=1024, batch_after=480,
                       notes=("model put back before each rerun",),
                       suggestions=(Suggestion("gradient accumulation", "keeps the effective batch", "steps = 4"),),
                       tries=(_try(1, Strategy.BATCH, fixed, True, int(3.5 * GiB), 480, "bisection"),))
    short, full = outcome.text(), replace(outcome, verbose=True).text()
    assert full.splitlines()[:3] == short.splitlines()[:3]
    for detail in ("figures:", "asked for", " #  strategy", "-batch_size = 1024", "+batch_size = 480",
                   "note: model put back before each rerun", "- gradient accumulation: keeps the effective batch"):
        assert detail in full and detail not in short
    page = outcome._repr_html_()
    assert page.index("Fixed with batch 480") < page.index("<details><summary>") < page.index("asked for")
    assert "<details open>" in replace(outcome, verbose=True)._repr_html_()
