"""The batch finder's corpus: notebooks in ``tests/oomfix/cells/``, run in a real shell, then the finder.

Each ``*.ipy`` file is one notebook in IPython's percent format. A header of ``# key: value`` lines
says what is expected, then ``# %%`` starts each cell; the last cell is the one that runs out of
memory::

    # style: PyTorch tutorials (quickstart)
    # expect: train_dataloader.batch_size = 64     (or: none)
    # edit: In[2] line 1                           (the cell(s) and line(s) a fix rewrites; "none" for none)
    # %%
    batch_size = 64
    ...

``In[k]`` is the file's k-th cell; the runner maps it to the execution count the shell gave it.
``run_case`` executes the earlier cells in an ``InteractiveShell`` (with the stand-ins of
``standins.py`` importable as the real libraries), runs the failing cell until its first module
call raises a CUDA OOM (so its partial effects are in the namespace, as in a real kernel), and asks
the finder, as ``%oomfix`` does, with the shell's namespace and input history. ``run_case(case,
real=True)`` does the same on the real transformers, accelerate and Lightning where they are installed;
``rerun_changed`` then changes the chosen knob where it lives and runs the failed cell as rewritten.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from IPython.core.interactiveshell import InteractiveShell

from jupyter_cudamem.batch import BatchChange, BatchFinding, find_batch
from jupyter_cudamem.batch.change import live_batch
from jupyter_cudamem.batch.knobs import Loader
from jupyter_cudamem.batch.libraries import resolve
from tests.oomfix.shells import shell_without_failures
from tests.oomfix.standins import installed, out_of_memory_at_first_forward

CELLS = Path(__file__).parent / "cells"


@dataclass(frozen=True)
class Case:
    name: str
    style: str
    expect: str  # "label = value", or "none"
    edits: tuple[str, ...]  # "In[2] line 1" or "line 3" (the failed cell), file-relative
    cells: tuple[str, ...]
    batch: str  # "first" (written before the finder) or "adversarial" (written after it worked)

    @property
    def failing(self) -> str:
        return self.cells[-1]


def load_case(path: Path) -> Case:
    text = path.read_text()
    header, _, body = text.partition("# %%\n")
    fields = dict(re.findall(r"^# (\w+): (.*)$", header, flags=re.MULTILINE))
    cells = tuple(cell.rstrip("\n") + "\n" for cell in body.split("\n# %%\n"))
    edits = tuple(e.strip() for e in fields.get("edit", "none").split(",") if e.strip() and e.strip() != "none")
    return Case(
        path.stem, fields.get("style", ""), fields["expect"].strip(), edits, cells, fields.get("batch", "first").strip()
    )


def load_cases() -> list[Case]:
    return [load_case(path) for path in sorted(CELLS.glob("*.ipy"))]


@dataclass(frozen=True)
class Result:
    case: Case
    finding: BatchFinding
    found: str  # "label = value" of the chosen knob, or "none"
    edits: tuple[str, ...]  # file-relative, as in the case
    errors: tuple[str, ...]  # earlier cells that failed (a broken case, not a finder result)
    change_problems: tuple[str, ...] = ()  # what changing the chosen knob where it lives got wrong
    failure: str = ""  # the error the failing cell stopped with (OutOfMemoryError when it reached a module)

    @property
    def verdict(self) -> str:
        """right, wrong (another knob), missed (none found where one was expected), or broken."""
        if self.errors:
            return "broken"
        if self.found == self.case.expect and (self.case.expect == "none" or set(self.edits) == set(self.case.edits)):
            return "right"
        if self.found == "none":
            return "missed"
        return "wrong"


def run_case(case: Case, real: bool = False) -> Result:
    """Run one case as described in the module docstring; with ``real``, on the real transformers,
    accelerate and Lightning where they are installed (``standins.installed``)."""
    shell: InteractiveShell = shell_without_failures()
    shell.history_manager.reset(new_session=True)  # In[1] is the case's first cell
    shell.execution_count = 1
    mode = shell.InteractiveTB.mode
    shell.InteractiveTB.set_mode("Minimal")  # the failures are expected: do not spend time formatting them
    errors = []
    numbers: list[int] = []
    with installed(real):
        for index, cell in enumerate(case.cells[:-1], start=1):
            numbers.append(shell.execution_count)
            result = shell.run_cell(cell, store_history=True, silent=False)
            if not result.success:
                errors.append(f"In[{index}]: {result.error_in_exec or result.error_before_exec!r}")
        failing_number = shell.execution_count
        with out_of_memory_at_first_forward():
            failed = shell.run_cell(case.failing, store_history=True)
        history = list(shell.history_manager.input_hist_raw)
        finding = find_batch(
            case.failing, shell.user_ns, shell.transform_cell, history=history, cell_number=failing_number
        )
    to_file = {number: index for index, number in enumerate(numbers, start=1)}
    chosen = finding.chosen
    found = "none" if chosen is None else f"{chosen.label} = {chosen.value}"
    edits: list[str] = []
    if chosen is not None:
        for written in chosen.written:
            if written.cell is None:
                edits.append(f"line {written.span.line}")
            else:
                edits.append(f"In[{to_file.get(written.cell, '?')}] line {written.span.line}")
    change_problems = check_change(finding, shell.user_ns, history) if chosen is not None else ()
    shell.InteractiveTB.set_mode(mode)
    failure = type(failed.error_in_exec).__name__ if failed.error_in_exec is not None else ""
    return Result(case, finding, found, tuple(dict.fromkeys(edits)), tuple(errors), change_problems, failure)


def check_change(finding: BatchFinding, namespace: dict, history: list[str]) -> tuple[str, ...]:
    """Change the chosen knob to half its batch where it lives, check every place and every diff, put it back.

    Returns what went wrong (nothing, when the change room did its job on this notebook's objects).
    """
    knob = finding.chosen
    assert knob is not None
    problems: list[str] = []
    half = max(knob.value // 2, 1)
    before = {target: resolve(namespace, target.path) for target in knob.live}
    numbers_before = {target: live_batch(namespace, target) for target in knob.live}
    change = BatchChange(finding, knob, namespace, history)
    try:
        source = change.apply(half)
    except Exception as error:  # noqa: BLE001  (reported as the case's problem)
        return (f"apply({half}) raised {type(error).__name__}: {error}",)
    for target in knob.live:
        now = live_batch(namespace, target)
        if now != half:
            problems.append(f"{type(target).__name__} {target.path.text} holds {now} after apply({half})")
    in_cell = [w for w in knob.written if w.cell is None]
    if bool(in_cell) != (source != finding.source):
        problems.append("the source to run changed where no number is written in it, or the reverse")
    for diff in change.diffs(half):
        changed = [(a, b) for a, b in zip(diff.before.splitlines(), diff.after.splitlines()) if a != b]
        written = {w.span.line for w in knob.written if w.cell == diff.cell_number}
        lines = {i + 1 for i, (a, b) in enumerate(zip(diff.before.splitlines(), diff.after.splitlines())) if a != b}
        if lines != written or not all(
            w.text_for(half) in b for w in knob.written if w.cell == diff.cell_number for _, b in changed[:1]
        ):
            problems.append(f"the diff of {diff.label} changes lines {sorted(lines)}, expected {sorted(written)}")
    change.restore()
    for target in knob.live:
        if (
            resolve(namespace, target.path) is not before[target]
            and live_batch(namespace, target) != numbers_before[target]
        ):
            problems.append(f"{target.path.text} was not put back")
        if isinstance(target, Loader) and resolve(namespace, target.path) is not before[target]:
            problems.append(f"{target.path.text}: restore() did not put the very same loader back")
    return tuple(problems)


def rerun_changed(case: Case, batch: int, real: bool = False) -> tuple[Result, str, Any]:
    """Run the case, change its chosen knob to ``batch`` where it lives, and run the failed cell as the
    change rewrote it (no OOM this time): (the finder's result, the source run, IPython's result)."""
    result = run_case(case, real)
    shell = InteractiveShell.instance()
    history = list(shell.history_manager.input_hist_raw)
    change = BatchChange(result.finding, namespace=shell.user_ns, history=history)
    source = change.apply(batch)
    mode = shell.InteractiveTB.mode
    shell.InteractiveTB.set_mode("Minimal")
    try:
        with installed(real):
            outcome = shell.run_cell(source, store_history=False)
    finally:
        shell.InteractiveTB.set_mode(mode)
        change.restore()
    return result, source, outcome
