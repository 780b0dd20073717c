"""``%oomfix`` on a real GPU, in a real kernel driven by nbclient.

PyTorch is capped with ``set_per_process_memory_fraction`` so a small model runs out of memory at a
batch written too big, cheaply, on any card. Each notebook: set up, run a cell that fails with a
CUDA OOM, ``%oomfix --yes``, then a cell that checks what the fixed rerun left in the namespace.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.notebook_runner import gpu_notebook_module

torch, pytestmark = gpu_notebook_module()
nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = Path(__file__).resolve().parents[2]

SETUP = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
import json
import torch
from torch import nn
%load_ext jupyter_cudamem
"""


def cap(gib: float) -> str:
    return (
        f"torch.cuda.set_per_process_memory_fraction({gib} * 2**30 / torch.cuda.get_device_properties(0).total_memory)\n"
    )


def execute(cells: list[str], timeout: int = 120) -> list[dict]:
    """Run the cells in a fresh kernel, errors allowed; return each cell's outputs."""
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    client = nbclient.NotebookClient(
        notebook, kernel_name="python3", timeout=timeout, allow_errors=True,
        resources={"metadata": {"path": str(REPO)}},
    )
    client.execute()
    return [cell.outputs for cell in notebook.cells]


def text_of(outputs: list[dict]) -> str:
    parts = []
    for output in outputs:
        if output.get("output_type") == "stream":
            parts.append(output.get("text", ""))
        elif output.get("output_type") in ("execute_result", "display_data"):
            parts.append(output.get("data", {}).get("text/plain", ""))
        elif output.get("output_type") == "error":
            parts.append(f"{output.get('ename')}: {output.get('evalue')}")
    return "".join(parts)


def errors_of(outputs: list[dict]) -> list[str]:
    return [output["ename"] for output in outputs if output.get("output_type") == "error"]


def last_json(outputs: list[dict]) -> dict:
    lines = [line for line in text_of(outputs).splitlines() if line.startswith("{")]
    assert lines, text_of(outputs)
    return json.loads(lines[-1])


STEADY_RUNS = 3
"""How many times in a row a cell runs for its batch to count as one that keeps fitting."""

FIX_CHECK = """import json
print(json.dumps({"batch": batch_size, "tries": [[t.batch, t.fitted, t.steady] for t in _fix.tries],
                  "strategy": _fix.strategy}))
"""


def runs_again(setup: list[str], step: str, batch: int) -> bool:
    """Whether ``step`` at ``batch`` runs ``STEADY_RUNS`` times in a row after ``setup`` in a fresh kernel."""
    cells = setup + [f"batch_size = {batch}\n"] + [step] * STEADY_RUNS
    return not any(errors_of(outputs) for outputs in execute(cells, timeout=300)[len(setup) + 1:])


def steady_largest(setup: list[str], step: str, start: int) -> int:
    """The largest batch that keeps fitting, by ``runs_again`` (doubling from ``start``, then bisection)."""
    low, high = 0, start
    while runs_again(setup, step, high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if runs_again(setup, step, middle) else (low, middle)
    return low


def fix_and_run_again(setup: list[str], step: str, failing_batch: int) -> tuple[dict, str, list[list[str]]]:
    """The cell fails at ``failing_batch``, ``%oomfix --yes`` fixes it, and the fixed cell runs
    ``STEADY_RUNS`` more times in the same kernel: the fix's record, its text, each later run's errors."""
    cells = setup + [f"batch_size = {failing_batch}\n" + step, "_fix = %oomfix --yes -o", FIX_CHECK]
    outputs = execute(cells + [step] * STEADY_RUNS, timeout=600)
    first = len(setup)
    assert "OutOfMemoryError" in errors_of(outputs[first]), text_of(outputs[first])
    return last_json(outputs[first + 2]), text_of(outputs[first + 1]), [errors_of(o) for o in outputs[first + 3:]]


def assert_holds(result: dict, text: str, next_runs: list[list[str]]) -> None:
    """The fix's batch fitted the later runs, and was proven inside the reruns as the next run holds."""
    assert next_runs == [[]] * STEADY_RUNS, (result, next_runs, text)
    best = [t for t in result["tries"] if t[1] and t[0] == result["batch"]]
    assert best and best[-1][2], (result, text)  # TryResult.steady: it ran holding what a run leaves
    assert "as your next runs will" in text, text  # and the lead's proof line says so


CNN_CELL = """batch_size = 4096  # far too big under a 3 GiB cap
model = nn.Sequential(
    nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
    nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
).cuda()
optimizer = torch.optim.Adam(model.parameters())
x = torch.randn(batch_size, 3, 64, 64, device="cuda")
y = torch.randint(0, 10, (batch_size,), device="cuda")
loss = nn.functional.cross_entropy(model(x), y)
loss.backward()
optimizer.step()
optimizer.zero_grad()
trained_batch = batch_size
"""

TRANSFORMER_CELL = """def train_step(batch_size=2048):
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=8, dim_feedforward=1024, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    tokens = torch.randn(batch_size, 128, 256, device="cuda")
    loss = model(tokens).pow(2).mean()
    loss.backward()
    optimizer.step()
    return batch_size

trained_batch = train_step()
"""

CHECK = (
    "print(json.dumps({'trained_batch': trained_batch, 'allocated': torch.cuda.memory_allocated(), "
    "'cap': torch.cuda.get_per_process_memory_fraction(0) * torch.cuda.get_device_properties(0).total_memory "
    "if hasattr(torch.cuda, 'get_per_process_memory_fraction') else None}))"
)


def _fixed_by_oomfix(training_cell: str, written_batch: int) -> None:
    outputs = execute([SETUP + cap(3), training_cell, "%oomfix", "%oomfix --yes", CHECK])
    setup, failed, unconfirmed, fixed, check = outputs
    assert errors_of(setup) == [], text_of(setup)
    assert errors_of(failed) == ["OutOfMemoryError"], text_of(failed)
    # Without --yes under nbclient (no stdin) it explains in one line and does nothing. ipykernel
    # prints a UsageError to stderr as one line rather than sending an error output.
    refusal = text_of(unconfirmed)
    assert "UsageError" in refusal and "add --yes" in refusal and "Traceback" not in refusal, refusal
    report = text_of(fixed)
    assert errors_of(fixed) == [], report
    assert "Fixed with batch" in report, report  # the lead's second line
    result = last_json(check)
    assert 0 < result["trained_batch"] < written_batch, report


def test_small_cnn_training_cell_is_fixed_and_rerun():
    _fixed_by_oomfix(CNN_CELL, 4096)


def test_small_transformer_training_cell_is_fixed_and_rerun():
    _fixed_by_oomfix(TRANSFORMER_CELL, 2048)


AUTOCAST_SETUP = """a = torch.randn(4096, 4096, device="cuda")  # 64 MiB, fixed size: nothing to shrink
with torch.autocast("cuda", dtype=torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16):
    (a[:64] @ a[:64].T).sum().item()  # cuBLAS workspaces for both dtypes exist before the cap
(a[:64] @ a[:64].T).sum().item()
torch.cuda.empty_cache()
# Room for 16 float32 products (1 GiB) is not there; 16 half-precision ones (512 MiB) fit.
torch.cuda.set_per_process_memory_fraction(
    (torch.cuda.memory_reserved() + 800 * 2**20) / torch.cuda.get_device_properties(0).total_memory)
"""

MATMUL_CELL = "outs = [a @ a for _ in range(16)]\n"


def test_autocast_fixes_a_cell_whose_batch_cannot_shrink():
    outputs = execute([SETUP, AUTOCAST_SETUP, MATMUL_CELL, "%oomfix --yes --apply --verbose",
                       "print(json.dumps({'dtype': str(outs[0].dtype), 'n': len(outs)}))"])
    setup, capped, failed, fixed, check = outputs
    assert errors_of(setup) == [] and errors_of(capped) == [], text_of(setup) + text_of(capped)
    assert errors_of(failed) == ["OutOfMemoryError"], text_of(failed)
    report = text_of(fixed)
    assert errors_of(fixed) == [], report
    assert "Fixed under torch.autocast" in report and "no batch size in the cell" in report, report
    result = last_json(check)
    assert result["n"] == 16 and result["dtype"] in ("torch.bfloat16", "torch.float16")
