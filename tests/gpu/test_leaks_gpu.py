"""On the GPU, in a real kernel through nbclient: ``%%cudamem`` names what a cell left behind.

The cases are the leaks benchmark's (``benchmarks/leaks.py``): eight classic leaks (losses kept in a
list, a summed loss, a metric accumulated without ``.item()`` in a training loop, a forward hook
storing outputs in a list and in its closure, a dict cache of outputs, losses appended to a list
inside a dict made in an earlier cell, tensors kept by ``Out``) and
four results that are not leaks (a model built, a dataset moved to the GPU, Adam's first step,
predictions under ``no_grad``). Each must be named with its cause and advice, with at least 90% of
what a leak left attributed, and no result called a leak. Also: a cell run again that leaves memory
again is flagged as growing (report and ``%cudamem_history``), ``--trace`` finds the growth per
iteration at the line that keeps it, and ``%oomfix``'s diagnosis names a list of losses by its graphs.
"""

from __future__ import annotations

import json

import pytest
from tests.notebook_runner import html_of, json_line, run_cells, text_of

pytestmark = [pytest.mark.gpu, pytest.mark.notebook]

# The report is read from ``Out``, not from ``_``: IPython stops updating ``_`` (for every cell, not
# only ours) once the user's code binds ``_`` itself, as ``for _ in range(20)`` in the cases does.
# ``%%cudamem -o`` returns its report as the cell's result, so IPython caches it in ``Out`` like any
# cell's value; ``%reset -f`` cleared ``Out`` at the start of the case, so the report found is this
# case's, and exactly one must be there.
CHECK = """
import json
from benchmarks.leaks import CASES, _judge
from jupyter_cudamem.report import CellReport
_case = next(c for c in CASES if c.name == {name!r})
_reports = [value for value in Out.values() if isinstance(value, CellReport)]
assert len(_reports) == 1, f"%%cudamem -o left {{len(_reports)}} reports in Out: {{sorted(map(type, Out.values()), key=str)}}"
_record = _judge(_case, _reports[0])
del _reports
print("RESULT " + json.dumps(_record))
"""


def test_every_case_is_named_with_its_cause_and_advice(tmp_path):
    from benchmarks.leaks import CASES, PRELUDE

    prelude = PRELUDE.format(dev="cuda", batch=2048, width=1024)
    cells = ["%load_ext jupyter_cudamem\n%config CudaMem.verbose = True"]  # the holders' section
    checks: dict[str, int] = {}
    for case in CASES:
        cells += ["%reset -f", "import gc, torch; gc.collect(); torch.cuda.empty_cache()", prelude]
        if case.setup:
            cells.append(case.setup)
        cells.append("%%cudamem -o\n" + case.cell)
        checks[case.name] = len(cells)
        cells.append(CHECK.format(name=case.name))
    notebook = run_cells(cells, timeout=300, save_to=tmp_path / "leaks.ipynb")
    failures = []
    for case in CASES:
        record = json_line(notebook.cells[checks[case.name]])
        shown = text_of(notebook.cells[checks[case.name] - 1])
        print(case.name, json.dumps({k: record[k] for k in ("passed", "flagged_leak", "named_holders", "left_bytes",
                                                              "attributed_bytes", "attribution_ms")}))
        if not record["passed"]:
            failures.append(f"{case.name}: {json.dumps(record, indent=1)}\n{shown}")
            continue
        # What the user sees says it too: the holder, its verdict and the advice.
        assert "left behind:" in shown and case.advice in shown, shown
        assert ("leak " if case.leak else "result ") in shown, shown
        assert record["flagged_leak"] == case.leak
        if case.name == "dict_held_list":  # the dict is the same object: the list inside it is named by its path
            assert "history['losses']: list of 20 tensors holding their autograd graphs" in shown, shown
    assert not failures, "\n\n".join(failures)


def test_growth_across_runs_in_a_loop_and_in_the_oomfix_diagnosis(tmp_path):
    setup = (
        f"%load_ext jupyter_cudamem\n%config CudaMem.verbose = True\n%config CudaMem.trace_dir = {str(tmp_path)!r}\n"
        "import json, torch\nfrom torch import nn\n"
        "model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024)).cuda()\n"
        "x = torch.randn(2048, 1024, device='cuda')\nlosses = []\nmodel(x).sum().item()"
    )
    # a cap just above what is held, then an allocation that cannot fit; the diagnosis names the graphs
    oom = (
        "total = torch.cuda.get_device_properties(0).total_memory\n"
        "torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_allocated() + 2**30) / total))\n"
        "big = torch.empty(4 * 2**30, dtype=torch.uint8, device='cuda')"
    )
    cells = [
        setup,
        "%%cudamem\nfor _ in range(10):\n    losses.append(model(x).pow(2).mean())",  # 1
        "%%cudamem\nfor _ in range(10):\n    losses.append(model(x).pow(2).mean())",  # 2: the same cell again
        "%cudamem_history",  # 3
        "records = %cudamem_history -o\nprint('RESULT ' + json.dumps([r['growing_runs'] for r in records]))",  # 4
        "%%cudamem --trace\nfor _ in range(20):\n    losses.append(model(x).pow(2).mean())",  # 5
        oom,  # 6
        "%oomfix --dry-run",  # 7
        "torch.cuda.set_per_process_memory_fraction(1.0)",
    ]
    notebook = run_cells(cells, timeout=300, allow_errors_in={6}, save_to=tmp_path / "growth.ipynb")
    out = notebook.cells
    first, second = text_of(out[1]), text_of(out[2])
    assert "leak" in first and "losses: list of 10 tensors holding their autograd graphs" in first, first
    assert "growing" not in first
    assert "growing: each run of this cell leaves about +" in second and "(2 runs" in second, second
    assert "/run ×2" in text_of(out[3]) + html_of(out[3])
    assert json_line(out[4])[-2:] == [None, 2]
    traced = text_of(out[5])
    assert "grew in a loop: about +" in traced and "per iteration over 20 iterations" in traced, traced
    assert "losses.append(model(x).pow(2).mean())" in traced
    diagnosis = text_of(out[7]) + html_of(out[7])
    assert "losses" in diagnosis and "autograd graph" in diagnosis, diagnosis
