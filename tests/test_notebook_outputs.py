"""The committed tutorial notebooks keep the promises their outputs make (CPU; reads outputs, runs nothing).

- a cell that fails on purpose carries the tag ``raises-exception``, and no other cell shows an error;
- no output shows a path of the machine that ran it;
- gradient-accumulation arithmetic is exact: "N steps of M" beside "effective batch of E" needs N*M == E;
  "N x M = T" and "N micro batches of M = T" need N*M == T (and T == E where E was named);
- no cell's output prints the same diagnosis (or any block of lines) twice, and no two cells of one notebook
  print the same out-of-memory diagnosis;
- no progress bar is saved at 0% (a static viewer would show the work as never started);
- each notebook stays within a budget of cells, output lines and bytes (``BUDGET``);
- the words say what the outputs show (``claim_problems``; ``tests/notebook_claims.py`` says what is read as a
  claim): a figure a markdown cell quotes (``found batch 236``, ``peak 2.05 GiB``, ``largest batch 2,962``, ``215 ms``) is
  among the outputs of the code cells beside it (after it up to the next markdown cell, before it back to the
  previous one; the header's, anywhere in the notebook), to the precision written and in any binary unit; a
  verdict it gives ("fits", "does not fit", "ran out of memory", "runs unchanged") is one the ``%oomfix`` or
  ``%%cudamem`` output beside it gives; a count of reruns or tries is the one ``%oomfix`` reports. Numbers
  that are not claims about an output are not read: bare numbers (``notebook 4``, a year), code spans, links,
  decimal ``GB`` (a card's marketed size) and numbers the code beside it wrote (its inputs). A deliberate
  exception is marked in the markdown with ``<!-- claim: not-output -->`` (the whole cell) or
  ``<!-- claim: not-output 90%, 4 GiB -->`` (those figures).

Cells whose outputs were cleared count as having none. The checks themselves are tested on small synthetic
notebooks holding each defect the tutorials once had.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import notebook_claims as claims

nbformat = pytest.importorskip("nbformat")

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
EXPECTED_ERROR_TAG = "raises-exception"

# The budget keeps each tutorial readable in one sitting: notebook 3 of the first release had 60 cells and about
# 350 lines of output and taught five things at once. A notebook past it should be split (docs/tutorials.md).
BUDGET = {"cells": 50, "output_lines": 400, "bytes": 1_000_000}

MACHINE_PATH = re.compile(r"/home/|/tmp/|/root/|/work/|/Users/|/var/folders/|site-packages|dist-packages|\b[A-Za-z]:\\")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
NUMBER = r"(\d[\d,]*)"
EFFECTIVE = re.compile(rf"effective batch (?:of|size of|size) {NUMBER}", re.IGNORECASE)
STEPS_OF = re.compile(rf"\b{NUMBER} (?:accumulation |micro[- ]?batch )?steps of {NUMBER}", re.IGNORECASE)
TIMES_EQUALS = re.compile(rf"\b{NUMBER}\s*[x×*]\s*{NUMBER}\s*=\s*{NUMBER}")
MICRO_EQUALS = re.compile(rf"\b{NUMBER} micro[- ]?batch(?:es)? of {NUMBER}\s*=\s*{NUMBER}", re.IGNORECASE)
DIAGNOSIS_HEAD = re.compile(r"^[ \t]*CUDA out of memory on ", re.MULTILINE)
# A progress bar (tqdm's, ipyparallel's) as the saved notebook keeps it: at the start, though the work finished.
STUCK_PROGRESS = re.compile(r"(?<![\d.])0%\|")
# A line that says plainly that the effective batch changes ("5 steps of 205: the effective batch becomes 1025")
# is the honest answer when no micro-batch divides it; it is not checked against the batch it no longer keeps.
SAYS_IT_CHANGES = re.compile(r"\b(?:becomes|changes?|changed|instead of|not exactly)\b", re.IGNORECASE)
REPEATED_BLOCK = 3  # lines: a block this long printed twice in one output is a repetition, not a coincidence
MIN_BLOCK_CHARS = 60  # ...unless it is short (three blank-ish table rules, say)


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def _tags(cell) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def output_texts(cell, tracebacks: bool = True) -> list[str]:
    """The text of each output of a code cell: streams, text/plain and text/html, error lines and tracebacks."""
    texts = []
    for output in cell.get("outputs", []):
        kind = output.get("output_type")
        if kind == "stream":
            texts.append(output.get("text", ""))
        elif kind in ("execute_result", "display_data"):
            data = output.get("data", {})
            texts.extend(str(data[mime]) for mime in ("text/plain", "text/html", "text/markdown") if mime in data)
        elif kind == "error":
            texts.append(f"{output.get('ename')}: {output.get('evalue')}")
            if tracebacks:
                texts.append(ANSI.sub("", "\n".join(output.get("traceback", []))))
    return texts


def _plain(cell) -> str:
    """What a reader reads as text (no HTML twin of the same report, no traceback frames)."""
    parts = []
    for output in cell.get("outputs", []):
        kind = output.get("output_type")
        if kind == "stream":
            parts.append(output.get("text", ""))
        elif kind in ("execute_result", "display_data") and "text/plain" in output.get("data", {}):
            parts.append(str(output["data"]["text/plain"]))
        elif kind == "error":
            parts.append(f"{output.get('ename')}: {output.get('evalue')}")
    return "\n".join(parts)


def _code_cells(notebook) -> list:
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def _where(index: int, cell) -> str:
    first = cell.source.splitlines()[0] if cell.source else ""
    return f"cell {index} ({first[:50]!r})"


# -- the checks ------------------------------------------------------------------------------------------------
def error_problems(notebook) -> list[str]:
    problems = []
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code" or not cell.get("outputs"):
            continue
        failed = any(output.get("output_type") == "error" for output in cell.outputs)
        tagged = EXPECTED_ERROR_TAG in _tags(cell)
        if failed and not tagged:
            problems.append(f"{_where(index, cell)} shows an error but is not tagged {EXPECTED_ERROR_TAG}")
        if tagged and not failed:
            problems.append(f"{_where(index, cell)} is tagged {EXPECTED_ERROR_TAG} but did not fail")
    return problems


def path_problems(notebook) -> list[str]:
    problems = []
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        for text in output_texts(cell):
            match = MACHINE_PATH.search(text)
            if match:
                line = next(line for line in text.splitlines() if match.group(0) in line)
                problems.append(f"{_where(index, cell)} shows a machine path: {line.strip()[:120]!r}")
                break
    return problems


def accumulation_problems_in(text: str) -> list[str]:
    """Accumulation arithmetic in one output, paragraph by paragraph (an effective batch named in a paragraph
    holds for the steps and sums in it)."""
    problems = []
    for paragraph in re.split(r"\n\s*\n", text):
        effective = None
        events = sorted(
            [(m.start(), "effective", m) for m in EFFECTIVE.finditer(paragraph)]
            + [(m.start(), "steps", m) for m in STEPS_OF.finditer(paragraph)]
            + [(m.start(), "sum", m) for m in TIMES_EQUALS.finditer(paragraph)]
            + [(m.start(), "sum", m) for m in MICRO_EQUALS.finditer(paragraph)],
            key=lambda event: event[0],
        )
        for position, kind, match in events:
            line_start = paragraph.rfind("\n", 0, position) + 1
            line_end = paragraph.find("\n", position)
            line = paragraph[line_start : None if line_end < 0 else line_end]
            if kind == "effective":
                effective = _int(match.group(1))
            elif kind == "steps":
                steps, micro = _int(match.group(1)), _int(match.group(2))
                if effective is not None and steps * micro != effective and not SAYS_IT_CHANGES.search(line):
                    problems.append(f"{match.group(0)!r} is {steps * micro} samples, not the effective batch of {effective}")
            else:
                steps, micro, total = (_int(group) for group in match.groups())
                if steps * micro != total:
                    problems.append(f"{match.group(0)!r}: {steps} x {micro} is {steps * micro}")
                elif effective is not None and total != effective and not SAYS_IT_CHANGES.search(line):
                    problems.append(f"{match.group(0)!r}: {total} samples, not the effective batch of {effective}")
    return problems


def accumulation_problems(notebook) -> list[str]:
    problems = [
        f"{_where(index, cell)}: {problem}"
        for index, cell in enumerate(notebook.cells)
        if cell.cell_type == "code"
        for text in output_texts(cell, tracebacks=False)
        for problem in accumulation_problems_in(text)
    ]
    return list(dict.fromkeys(problems))  # a report's text and HTML forms say the same


def repeated_block(text: str) -> str | None:
    """A block of ``REPEATED_BLOCK`` consecutive non-blank lines that the text prints twice, if any."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    seen: dict[tuple[str, ...], int] = {}
    for start in range(len(lines) - REPEATED_BLOCK + 1):
        block = tuple(lines[start : start + REPEATED_BLOCK])
        if sum(len(line) for line in block) < MIN_BLOCK_CHARS:
            continue
        if block in seen and start >= seen[block] + REPEATED_BLOCK:
            return "\n".join(block)
        seen.setdefault(block, start)
    return None


def diagnoses(text: str) -> list[str]:
    """Each out-of-memory diagnosis in the text: its headline, explanation and figures (the lines up to the holders,
    the advice or a blank line), which are the same whenever the same failure is diagnosed again."""
    found = []
    for match in DIAGNOSIS_HEAD.finditer(text):
        lines = []
        for line in text[match.start() :].strip().splitlines():
            if not line.strip() or line.strip().startswith(("largest holders", "try:")):
                break
            lines.append(line.strip())
        found.append("\n".join(lines))
    return found


def duplication_problems(notebook) -> list[str]:
    problems = []
    first_seen: dict[str, int] = {}
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        text = _plain(cell)
        block = repeated_block(text)
        if block is not None:
            problems.append(f"{_where(index, cell)} prints the same lines twice:\n{block}")
        found = diagnoses(text)
        if len(found) != len(set(found)):
            problems.append(f"{_where(index, cell)} prints the same diagnosis twice")
        for diagnosis in set(found):
            if diagnosis in first_seen:
                problems.append(f"{_where(index, cell)} repeats the diagnosis of cell {first_seen[diagnosis]}")
            first_seen.setdefault(diagnosis, index)
    return problems


def claim_problems(notebook) -> list[str]:
    """Where a markdown cell's words and its neighbours' outputs part ways (``tests/notebook_claims.py`` says
    what is read as a claim)."""
    problems = []
    header = next((i for i, cell in enumerate(notebook.cells) if cell.cell_type == "markdown"), None)
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "markdown":
            continue
        whole, marked = claims.exemptions(cell.source)
        if whole:
            continue
        words = claims.readable(cell.source)
        shown = claims.beside(notebook.cells, index, _plain)
        where = f"markdown cell {index}"
        for figure in claims.figures_in(words):
            if claims.is_marked(figure, marked) or claims.is_input(figure, shown.literals):
                continue
            if not claims.shown(figure, shown.with_unit, shown.numbers):
                problems.append(f"{where} quotes {figure.text!r}, which no output beside it shows")
        if shown.verdicts and index != header:  # the header speaks in general ("until a later cell runs out of memory")
            for verdict, phrase in claims.claimed_verdicts(words).items():
                if verdict not in shown.verdicts:
                    problems.append(f"{where} says {phrase!r}, but the outputs beside it say {', '.join(sorted(shown.verdicts))}")
        for count, phrase in claims.claimed_reruns(words):
            if count not in shown.reruns:
                said = ", ".join(str(n) for n in sorted(shown.reruns)) or "no count"
                problems.append(f"{where} says {phrase!r}, but the %oomfix output beside it reports {said}")
    return list(dict.fromkeys(problems))


def progress_problems(notebook) -> list[str]:
    """A progress bar saved at 0%: a static viewer shows the work as never started (its widget cannot update)."""
    return [
        f"{_where(index, cell)} shows a progress bar saved at 0%"
        for index, cell in enumerate(notebook.cells)
        if cell.cell_type == "code" and any(STUCK_PROGRESS.search(text) for text in output_texts(cell, tracebacks=False))
    ]


def budget_problems(notebook, size_bytes: int) -> list[str]:
    lines = sum(len(_plain(cell).splitlines()) for cell in _code_cells(notebook))
    measured = {"cells": len(notebook.cells), "output_lines": lines, "bytes": size_bytes}
    return [f"{name} {measured[name]:,} over the budget of {limit:,}" for name, limit in BUDGET.items() if measured[name] > limit]


def all_problems(notebook, size_bytes: int = 0) -> list[str]:
    return (
        error_problems(notebook)
        + path_problems(notebook)
        + accumulation_problems(notebook)
        + duplication_problems(notebook)
        + claim_problems(notebook)
        + progress_problems(notebook)
        + budget_problems(notebook, size_bytes)
    )


# -- the committed notebooks -----------------------------------------------------------------------------------
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_committed_notebook_keeps_its_promises(path):
    notebook = nbformat.read(path, as_version=4)
    assert all_problems(notebook, path.stat().st_size) == []


def test_there_are_notebooks_to_check():
    assert len(NOTEBOOKS) >= 5


# -- the checks catch the defects they are for ------------------------------------------------------------------
def _notebook(*cells):
    notebook = nbformat.v4.new_notebook()
    notebook.cells = list(cells)
    return notebook


def _cell(source="x", outputs=(), tags=()):
    cell = nbformat.v4.new_code_cell(source)
    cell.outputs = list(outputs)
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def _stream(text, name="stdout"):
    return nbformat.v4.new_output("stream", name=name, text=text)


def _plain_output(text, html=None):
    data = {"text/plain": text}
    if html is not None:
        data["text/html"] = html
    return nbformat.v4.new_output("display_data", data=data)


def _error(ename="OutOfMemoryError", evalue="CUDA out of memory. Tried to allocate 4.00 GiB.", traceback=()):
    return nbformat.v4.new_output("error", ename=ename, evalue=evalue, traceback=list(traceback))


def test_a_clean_notebook_passes():
    notebook = _notebook(
        nbformat.v4.new_markdown_cell("# A tutorial"),
        _cell("batch_size = 1024", [_error(traceback=["OutOfMemoryError: CUDA out of memory."])], tags=["gpu", "raises-exception"]),
        _cell("%oomfix --yes", [_plain_output(
            "- gradient accumulation: keeps the effective batch of 1024: 4 steps of 256 per optimizer step\n"
            "    accumulation_steps = 4  # 4 x 256 = 1024 samples per optimizer step"
        )]),
        _cell("print(...)", [_stream("we train with 4 micro batches of 256 = 1024 samples per optimizer step\n")]),
        _cell("cleared", [], tags=["raises-exception"]),  # outputs cleared: nothing to check
    )
    assert all_problems(notebook) == []


def test_an_error_in_an_untagged_cell_is_caught():
    notebook = _notebook(_cell("1 / 0", [_error("ZeroDivisionError", "division by zero")]))
    assert "not tagged raises-exception" in " ".join(error_problems(notebook))


def test_a_tagged_cell_that_did_not_fail_is_caught():
    notebook = _notebook(_cell("x = 1", [_stream("fine\n")], tags=["raises-exception"]))
    assert "did not fail" in " ".join(error_problems(notebook))


@pytest.mark.parametrize(
    "output",
    [
        _stream("Writing /tmp/tmpxeezuvf3/fragmentation_demo.py\n"),
        _plain_output("report", html="<pre>/home/someone/project/cell.py</pre>"),
        _stream("/usr/lib/python3/site-packages/torch/nn/modules/module.py:1: FutureWarning: x\n", name="stderr"),
        _error(traceback=["\x1b[0;32mFile /root/.venv/lib/python3.12/torch/nn/functional.py:10\x1b[0m"]),
        _plain_output("snapshot saved to C:\\Users\\someone\\trace.pickle"),
        _stream("/work/main/jupyter_cudamem/__init__.py\n"),
    ],
    ids=["tmp", "home-in-html", "site-packages", "traceback-root", "windows", "work"],
)
def test_machine_paths_are_caught(output):
    assert path_problems(_notebook(_cell(outputs=[output])))


def test_relative_paths_pass():
    output = _stream("snapshot: cudamem_traces/cell14-20261123.pickle (open it at https://pytorch.org/memory_viz)\n")
    assert path_problems(_notebook(_cell(outputs=[output]))) == []


@pytest.mark.parametrize(
    "text",
    [
        # The tutorials' first release, word for word: advice that did not keep the effective batch.
        "- gradient accumulation: keeps the effective batch of 1024: 5 steps of 205 per optimizer step (1025 samples, the nearest even split)",
        "- gradient accumulation: keeps the effective batch of 1024: 3 steps of 342 per optimizer step (1026 samples, the nearest even split)",
        "keeps the effective batch of 1024\n    accumulation_steps = 3  # 3 x 342 = 1026 samples per optimizer step",
        "accumulation_steps = 3  # 3 x 342 = 1024 samples per optimizer step",
        "we train with 4 micro batches of 250 = 1024 samples per optimizer step",
        "effective batch of 1,024: 8 accumulation steps of 127",
    ],
)
def test_inexact_accumulation_is_caught(text):
    assert accumulation_problems(_notebook(_cell(outputs=[_plain_output(text)])))


def test_saying_plainly_that_the_effective_batch_changes_passes():
    text = "keeps the effective batch of 1024 where a divisor fits; here none does: 5 steps of 205, so the effective batch becomes 1025"
    assert accumulation_problems_in(text) == []
    assert accumulation_problems_in("effective batch of 1024: 5 x 205 = 1024 (the effective batch becomes 1025)")  # wrong sum


def test_accumulation_checks_each_paragraph_on_its_own():
    text = "keeps the effective batch of 1024: 4 steps of 256\n\na different plan: 3 steps of 100 per optimizer step"
    assert accumulation_problems_in(text) == []


def test_a_diagnosis_printed_twice_in_one_output_is_caught():
    diagnosis = (
        "CUDA out of memory on GPU 0 (PyTorch's allocator): too big for the card\n"
        "  figures:\n    asked for                         4.00 GiB\n    per-process cap                   4.00 GiB\n"
    )
    notebook = _notebook(_cell("%oomfix", [_plain_output(diagnosis), _plain_output(diagnosis + "\n%oomfix: fits")]))
    problems = duplication_problems(notebook)
    assert any("same diagnosis twice" in problem for problem in problems)
    assert any("same lines twice" in problem for problem in problems)


def test_the_same_diagnosis_in_two_cells_is_caught():
    diagnosis = (
        "CUDA out of memory on GPU 0 (PyTorch's allocator): held by IPython after the error\n"
        "  figures:\n    asked for                         990.00 MiB\n"
    )
    notebook = _notebook(
        _cell("%oomfix --dry-run", [_plain_output("%oomfix --dry-run: diagnosis only, nothing was rerun\n\n" + diagnosis)]),
        _cell("%oomfix --yes", [_plain_output(diagnosis)]),
    )
    assert any("repeats the diagnosis of cell 0" in problem for problem in duplication_problems(notebook))


def test_a_report_beside_its_html_twin_is_not_a_repetition():
    report = "cudamem [2] · 232 ms\n  cuda:0 NVIDIA H100 80GB HBM3\n    peak allocated   224.00 MiB   +224.00 MiB above start\n"
    notebook = _notebook(_cell("%%cudamem", [_plain_output(report, html=f"<pre>{report}</pre>")]))
    assert duplication_problems(notebook) == []


def test_a_progress_bar_saved_at_zero_is_caught():
    widget = {"application/vnd.jupyter.widget-view+json": {"model_id": "x", "version_major": 2, "version_minor": 0}}
    stuck = nbformat.v4.new_output("display_data", data={"text/plain": "%px:   0%|          | 0/3 [00:00<?, ?tasks/s]", **widget})
    assert progress_problems(_notebook(_cell("%%px", [stuck])))
    assert progress_problems(_notebook(_cell("train()", [_stream("  0%|          | 0/50 [00:00<?, ?it/s]\n", name="stderr")])))
    done = _stream("100%|##########| 50/50 [00:01<00:00, 40.0it/s]\n", name="stderr")
    assert progress_problems(_notebook(_cell("train()", [done]), _cell("x", [_stream("util 0% · peak 3.25 MiB\n")]))) == []


def test_the_budget_is_enforced():
    many = _notebook(*[nbformat.v4.new_markdown_cell("text") for _ in range(BUDGET["cells"] + 1)])
    assert budget_problems(many, 0)
    talkative = _notebook(_cell(outputs=[_stream("line\n" * (BUDGET["output_lines"] + 1))]))
    assert budget_problems(talkative, 0)
    assert budget_problems(_notebook(), BUDGET["bytes"] + 1)
    assert budget_problems(_notebook(_cell(outputs=[_stream("line\n")])), 100) == []


def test_the_runner_tidies_what_would_break_these_promises():
    from tests.notebook_runner import tidy_outputs

    frames = ["\x1b[0;31mOutOfMemoryError\x1b[0m Traceback", "File /root/.venv/lib/python3.12/site-packages/torch/nn/modules/module.py:1"]
    warning = "/root/.venv/lib/python3.12/site-packages/transformers/training_args.py:10: FutureWarning: old\n"
    notebook = _notebook(
        _cell("expected", [_error(traceback=frames)], tags=["raises-exception"]),
        _cell("warns", [_stream(warning, name="stderr")]),
        _cell("unexpected", [_error("ValueError", "bad", traceback=frames)]),
    )
    tidy_outputs(notebook)
    expected, warns, unexpected = notebook.cells
    assert expected.outputs[0].traceback == ["OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB."]
    assert warns.outputs[0].text == "transformers/training_args.py:10: FutureWarning: old\n"
    assert unexpected.outputs[0].traceback == frames  # someone has to debug it
    assert path_problems(_notebook(expected, warns)) == []


# -- the words agree with the outputs ---------------------------------------------------------------------------
def _md(text):
    return nbformat.v4.new_markdown_cell(text)


def _oomfix_output(batch=236, was=1024, reruns=3):
    return _plain_output(f"%oomfix: fits with batch {batch} (was {was}) after {reruns} reruns\n 1  smaller batch  15  fitted  290.93 MiB  1.07 s\n")


def _cudamem_output(peak="2.05 GiB", failed=False):
    title = "cudamem [3] · 8 ms" + (" · PyTorch capped at 2.00 GiB · failed with OutOfMemoryError" if failed else "")
    return _plain_output(f"{title}\n  cuda:0 NVIDIA H100 80GB HBM3\n    peak allocated     {peak}   +1.00 GiB above start\n")


def _with_header(*cells):
    """A notebook whose header claims nothing, so the cells under test are not its first markdown cell."""
    return _notebook(_md("# A tutorial"), *cells)


@pytest.mark.parametrize(
    ("words", "output"),
    [
        ("`%oomfix` found batch 230:", _oomfix_output(batch=236)),
        ("The step peaks at 2.05 GiB:", _cudamem_output(peak="2.08 GiB")),
        ("It peaks at 2,100 MiB:", _cudamem_output(peak="2.08 GiB")),  # 2.05 GiB in MiB
        ("The table gives this card a largest batch of 2,993:", _plain_output("this card  79.2 GiB  78.4 GiB  2,962\n")),
        ("It took 103 ms:", _plain_output("cudamem [23] · 215 ms\n")),
        ("The fitted step is 12% of the card:", _plain_output("peak allocated 1.11 GiB, 27.8% of the 4.00 GiB cap\n")),
        ("We train with 4 micro batches of 256:", _stream("we train with 8 micro batches of 128 = 1024 samples\n")),
    ],
    ids=["batch", "GiB", "MiB-for-GiB", "thousands", "ms", "percent", "micro-batches"],
)
def test_a_figure_the_outputs_do_not_show_is_caught(words, output):
    notebook = _with_header(_md(words), _cell("%oomfix --yes", [output]))
    assert any("which no output beside it shows" in problem for problem in claim_problems(notebook))


@pytest.mark.parametrize(
    ("words", "output"),
    [
        ("`%oomfix` found batch 236:", _oomfix_output(batch=236)),
        ("The step peaks at 2.05 GiB:", _cudamem_output(peak="2.05 GiB")),
        ("It peaks at about 2 GiB (2,099 MiB):", _cudamem_output(peak="2.05 GiB")),  # rounded, and in MiB
        ("It needs about 7 GiB:", _cudamem_output(peak="6.85 GiB")),
        ("The table gives this card a largest batch of 2,962:", _plain_output("this card  79.2 GiB  78.4 GiB  2,962\n")),
        ("The step took 215 ms, 0.2 s:", _plain_output("cudamem [23] · 215 ms\n")),
        ("The fitted step is 27.8% of the cap:", _plain_output("peak allocated 1.11 GiB, 27.8% of the 4.00 GiB cap\n")),
    ],
    ids=["batch", "GiB", "rounded-and-MiB", "rounded-up", "thousands", "ms-and-s", "percent"],
)
def test_a_figure_the_outputs_show_passes(words, output):
    assert claim_problems(_with_header(_md(words), _cell("%oomfix --yes", [output]))) == []


def test_numbers_that_are_not_claims_about_the_outputs_pass():
    words = (
        "## 3. Section three\n\nNotebook 4 did this in 2024; see [notebook 5](05_x.ipynb#batch-999) and "
        "<https://example.com/77GiB>. `batch_size = 230` and `--limit 7GiB` are code, so is\n\n```python\nx = 5 GiB\n```\n"
        "A 24 GB card, a 16 GB T4. <!-- an aside: batch 12 -->"
    )
    assert claim_problems(_with_header(_md(words), _cell("%oomfix --yes", [_oomfix_output()]))) == []


def test_a_figure_the_code_beside_it_wrote_is_an_input():
    notebook = _with_header(
        _md("We cap PyTorch at 4 GiB, size the data to 30% of the free memory and train at batch 1024:"),
        _cell("PRETEND = 4 * 2**30\nplanned = 0.3 * free\nbatch_size = 1024", [_stream("ok\n")]),
    )
    assert claim_problems(notebook) == []


def test_a_marked_exception_passes():
    shown = _cell("%config CudaMemMonitor", [_stream("Current: 0.9\n")])
    whole = _with_header(_md("The default, 90% of the card, and 25% for chance. <!-- claim: not-output -->"), shown)
    assert claim_problems(whole) == []
    listed = _with_header(_md("The default, 90% of the card, and 25% for chance. <!-- claim: not-output 90% -->"), shown)
    assert [problem for problem in claim_problems(listed)] == ["markdown cell 1 quotes '25%', which no output beside it shows"]


def test_a_markdown_cell_speaks_about_its_neighbours_only():
    far = _with_header(_md("The fix found batch 236."), _cell("x = 1"), _md("Next:"), _cell("%oomfix --yes", [_oomfix_output(236)]))
    assert claim_problems(far)
    before = _with_header(_cell("%oomfix --yes", [_oomfix_output(236)]), _cell("y = 2"), _md("It found batch 236."))
    assert claim_problems(before) == []


def test_the_header_speaks_about_the_whole_notebook():
    notebook = _notebook(
        _md("# 1. Measuring\n\nNeeds about 7 GiB of GPU memory (its largest cell peaks there)."),
        _cell("import torch"),
        _md("## A cell"),
        _cell("%%cudamem", [_cudamem_output(peak="6.85 GiB")]),
    )
    assert claim_problems(notebook) == []
    notebook.cells[3].outputs = [_cudamem_output(peak="3.50 GiB")]
    assert claim_problems(notebook) == ["markdown cell 0 quotes '7 GiB', which no output beside it shows"]


@pytest.mark.parametrize(
    ("words", "outputs", "caught"),
    [
        ("At batch 64 it fits:", [_cudamem_output(failed=True)], True),
        ("At batch 64 it fits:", [_cudamem_output()], False),
        ("A step at batch 1024 does not fit:", [_cudamem_output()], True),
        ("A step at batch 1024 does not fit:", [_cudamem_output(failed=True), _error()], False),
        ("The cell ran out of memory; `%oomfix` fixed it:", [_oomfix_output()], True),
        ("`--del` frees the room; the cell then runs unchanged:", [_plain_output("%oomfix: fits under autocast after 1 rerun\n")], True),
        ("`%oomfix` reruns the cell unchanged once it fits:", [_plain_output("%oomfix: fits unchanged after cleanup (1 rerun)\n")], False),
        ("Nothing helps here: it fits under autocast.", [_plain_output("%oomfix: nothing fitted after 3 reruns\n")], True),
        ("`%%oomfix` fixes it if it runs out of GPU memory:", [_stream("%%oomfix: the cell ran out of GPU memory (OutOfMemoryError); fixing it\n"), _oomfix_output()], False),
    ],
    ids=["fits-but-failed", "fits", "no-fit-but-fitted", "no-fit", "oom-but-fitted", "unchanged-but-autocast", "unchanged", "autocast-but-nothing", "cell-form"],
)
def test_a_verdict_the_outputs_do_not_give_is_caught(words, outputs, caught):
    problems = [problem for problem in claim_problems(_with_header(_md(words), _cell("%%cudamem", outputs))) if " says " in problem]
    assert bool(problems) is caught, problems


# The three lines %oomfix leads with, as jupyter_cudamem/oomfix/outcome.py words them (its headline is behind --verbose).
LEAD_BATCH = "In[7] ran out of GPU memory: it needs more than the 4.00 GiB per-process cap allows\nFixed with batch 480 (was 1024): the rerun at batch 480 fitted, peak 3.50 GiB of the 4.00 GiB free\n"
LEAD_AUTOCAST = "In[7] ran out of GPU memory\nFixed under torch.autocast('cuda', dtype=torch.bfloat16): the rerun fitted, peak 2.50 GiB of the 4.00 GiB free\n"
LEAD_CLEANUP = "In[7] ran out of GPU memory\nFixed by the cleanup (it freed 1.00 GiB): the cell as written fitted, peak 3.00 GiB of the 4.00 GiB free\n"
LEAD_NOTHING = "In[7] ran out of GPU memory\nNot fixed: none of 3 reruns fitted\nTry: activation checkpointing\n"


@pytest.mark.parametrize(
    ("words", "lead", "caught"),
    [
        ("`%oomfix` found a batch that fits:", LEAD_BATCH, False),
        ("The cell ran out of memory; `%oomfix` fixed it:", LEAD_BATCH, True),
        ("`--del` frees the room; the cell then runs unchanged:", LEAD_AUTOCAST, True),
        ("It fits under autocast:", LEAD_AUTOCAST, False),
        ("`%oomfix` reruns the cell unchanged once it fits:", LEAD_CLEANUP, False),
        ("Nothing helps here: it fits under autocast.", LEAD_NOTHING, True),
    ],
    ids=["batch", "oom-but-fixed", "unchanged-but-autocast", "autocast", "cleanup", "autocast-but-nothing"],
)
def test_the_three_line_outcome_gives_its_verdict(words, lead, caught):
    problems = [p for p in claim_problems(_with_header(_md(words), _cell("%oomfix --yes", [_plain_output(lead)]))) if " says " in p]
    assert bool(problems) is caught, problems


def test_verdicts_are_read_only_beside_a_magic_report():
    # A section's introduction beside the failing cell, before %oomfix has said anything: no report to hold it to.
    notebook = _with_header(_md("`%oomfix` reruns the cell in a form that fits."), _cell("train()", [_error()], tags=["raises-exception"]))
    assert claim_problems(notebook) == []


@pytest.mark.parametrize(
    ("words", "reported", "caught"),
    [
        ("`%oomfix` fitted it after 2 reruns:", 3, True),
        ("`%oomfix` fitted it in three reruns:", 3, False),
        ("One try was enough:", 1, False),
        ("It took two more tries:", 3, True),
    ],
)
def test_a_rerun_count_the_output_does_not_report_is_caught(words, reported, caught):
    output = _plain_output(f"%oomfix: fits with batch 236 (was 1024) after {reported} rerun{'s' if reported != 1 else ''}\n")
    problems = claim_problems(_with_header(_md(words), _cell("%oomfix --yes", [output])))
    assert bool(problems) is caught, problems


def test_a_rerun_count_with_no_oomfix_beside_it_is_caught():
    assert claim_problems(_with_header(_md("It fitted after 3 reruns."), _cell("x = 1", [_stream("done\n")])))


def test_the_tutorials_page_states_the_budget():
    page = (REPO / "docs" / "tutorials.md").read_text()
    assert f"{BUDGET['cells']} cells, {BUDGET['output_lines']} lines of text output, {BUDGET['bytes'] / 1e6:g} MB on disk" in page


def test_the_readme_quotes_notebook_4_as_committed():
    """The README's text of the %oomfix example is notebook 4's output, line for line (``[...]`` leaves lines out,
    in order): executing the notebook again shows here where the README must follow."""
    readme = (REPO / "README.md").read_text()
    marker = "<!-- output of notebooks/04_fixing_out_of_memory.ipynb, cell 8"
    assert marker in readme
    block = readme.split(marker, 1)[1].split("```", 2)[1].strip("\n").splitlines()
    notebook = nbformat.read(REPO / "notebooks" / "04_fixing_out_of_memory.ipynb", as_version=4)
    output = _plain(notebook.cells[8]).splitlines()
    position, skipping = 0, True
    for line in block:
        if line == "[...]":
            skipping = True
            continue
        if skipping:
            assert line in output[position:], f"not in notebook 4's cell 8 output (in this order): {line!r}"
            position = output.index(line, position)
        else:
            assert output[position : position + 1] == [line], f"not the next line of notebook 4's cell 8 output: {line!r}"
        position, skipping = position + 1, False
