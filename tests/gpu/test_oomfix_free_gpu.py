"""On the GPU, in a real kernel through nbclient: after a cell OOMs inside ``f()``, the 4 GiB ``f``
allocated stays allocated (as measured on the GPU machine), and a tensor a cell returned stays in ``Out``; the oomfix
cleanup (library API) brings allocated memory back to the baseline within 1 MiB.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.notebook,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
    ),
]

ROOT = Path(__file__).resolve().parents[2]
GiB, MiB = 1024**3, 1024**2

SETUP = """
import json, torch
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(min(1.0, 6 * 2**30 / total), 0)  # a 6 GiB card
_warm = torch.empty(1, device="cuda"); del _warm
baseline = torch.cuda.memory_allocated()

def f(gib):
    big = torch.empty(gib * 2**30, dtype=torch.uint8, device="cuda")
    more = torch.empty(8 * 2**30, dtype=torch.uint8, device="cuda")  # over the cap: OOM
    return big, more
"""

RETURNED = "torch.ones(256 * 2**20, dtype=torch.uint8, device='cuda')"

HELD = "print(json.dumps({'held': torch.cuda.memory_allocated() - baseline}))"

CLEANUP = """
from jupyter_cudamem.hardware import default_hardware
from jupyter_cudamem.oomfix.cleanup import cleanup
from jupyter_cudamem.oomfix.diagnosis import diagnose
from jupyter_cudamem.attribution.holders import find_holders
from jupyter_cudamem.ipython_state import ipython_references, last_failure, user_variables

ip = get_ipython()
hardware = default_hardware()
failure = last_failure(ip)
oom = failure.oom()
holders = find_holders(user_variables(ip), ipython_references(ip))
diagnosis = diagnose(oom, holders, {0: hardware.allocator.read(0)})
report = {
    "cell": failure.raw_cell,
    "kind": oom.kind,
    "requested": oom.requested_bytes,
    "allowed": oom.allowed_bytes,
    "holders": [[h.label, h.kind, h.cuda_bytes] for h in holders],
    "verdict": diagnosis.verdict,
    "explanation": diagnosis.explanation,
    "html_ok": "<table>" in diagnosis._repr_html_(),
    "before": torch.cuda.memory_allocated() - baseline,
}
del failure
result = cleanup(ip, hardware)
report.update(
    freed=result.freed_bytes,
    freed_reserved=result.freed_reserved_bytes,
    cleared=list(result.cleared),
    after=torch.cuda.memory_allocated() - baseline,
    reserved_after=torch.cuda.memory_reserved(),
    cuda_in_out=[k for k, v in Out.items() if isinstance(v, torch.Tensor) and v.is_cuda],
)
print(json.dumps(report))
"""


def _json_from(cell) -> dict:
    errors = [o for o in cell.outputs if o.output_type == "error"]
    assert not errors, "\n".join(errors[0].traceback)
    text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")
    return json.loads(text.strip().splitlines()[-1])


def test_cleanup_frees_what_the_failed_cell_and_the_output_cache_hold() -> None:
    sources = [SETUP, "f(4)", RETURNED, HELD, CLEANUP, HELD]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=180, allow_errors=True, resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()

    failed = [o for o in nb.cells[1].outputs if o.output_type == "error"]
    assert failed and failed[0].ename.endswith("OutOfMemoryError"), nb.cells[1].outputs
    held = _json_from(nb.cells[3])["held"]
    # As measured on the GPU machine: the failed f() keeps its 4 GiB; the returned tensor adds 256 MiB in Out.
    assert abs(held - (4 * GiB + 256 * MiB)) <= MiB, held

    report = _json_from(nb.cells[4])
    print(json.dumps(report, indent=1))
    assert report["cell"] == "f(4)"
    assert report["kind"] == "allocator"
    assert report["requested"] == 8 * GiB and report["allowed"] is not None
    names = [name for name, _, _ in report["holders"]]
    assert "frame of f() (from the failed cell's traceback)" in names
    assert any(name.startswith("Out[") for name in names)
    assert report["verdict"] == "too big for the card"  # 8 GiB asked of a 6 GiB cap
    assert "traceback still holds 4.00 GiB" in report["explanation"]
    assert report["html_ok"]
    assert abs(report["freed"] - (4 * GiB + 256 * MiB)) <= MiB
    assert report["freed_reserved"] >= 4 * GiB
    assert abs(report["after"]) <= MiB, report["after"]
    assert report["cuda_in_out"] == []
    assert abs(_json_from(nb.cells[5])["held"]) <= MiB
