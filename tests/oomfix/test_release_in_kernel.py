"""In a real ipykernel (through nbclient), with fake tensors on a fake machine: the memory a failed
cell's frames and the output cache keep alive is freed by ``cleanup``, and nothing else is touched.

The same flow as tests/gpu/test_oomfix_free_gpu.py, without a GPU, so ipykernel's own shell (its
displayhook, ``_last_traceback``, the ``post_run_cell`` it triggers itself) is covered in CI.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[2]

CELLS = [
    """
import json, weakref
from tests.fakes import FakeAllocator, FakeMachine, FakeNvml, FakeTensor, GiB, MiB, fake_probe
from jupyter_cudamem.hardware import Hardware
from jupyter_cudamem.attribution.holders import find_holders, reaches_cuda
from jupyter_cudamem.ipython_state import FailureRecorder, ipython_references, last_failure, user_variables
from jupyter_cudamem.oomfix.cleanup import cleanup
from jupyter_cudamem.oomfix.diagnosis import diagnose
machine = FakeMachine()
hardware = Hardware(allocator=FakeAllocator(machine), nvml=FakeNvml(machine), pid=machine.pid,
                    pid_exists=lambda p: True)
recorder = FailureRecorder()
recorder.attach(get_ipython())
model = FakeTensor(256 * MiB, machine=machine)
baseline = machine.gpus[0].allocated
alive = {}
def f():
    big = FakeTensor(4 * GiB, machine=machine)
    alive['big'] = weakref.ref(big)
    raise RuntimeError("CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 79.18 GiB "
                       "of which 70.00 GiB is free. 8.00 GiB allowed; Of the allocated memory 7.25 GiB is allocated "
                       "by PyTorch, and 0 bytes is reserved by PyTorch but unallocated.")
""",
    "f()",
    "t = FakeTensor(3 * GiB, machine=machine); alive['out'] = weakref.ref(t); t",
    "del t",
    """
ip = get_ipython()
failure = last_failure(ip)
probe = fake_probe()
holders = find_holders(user_variables(ip), ipython_references(ip), probe=probe)
diagnosis = diagnose(failure.oom(), holders, {0: hardware.allocator.read(0)})
before = machine.gpus[0].allocated
report = {
    "cell": failure.raw_cell,
    "held_after_oom": before - baseline,
    "holders": [[h.label, h.cuda_bytes, h.user_variable] for h in holders],
    "verdict": diagnosis.verdict,
}
del failure
result = cleanup(ip, hardware, holds_cuda=lambda obj: reaches_cuda(obj, probe))
report.update(
    freed=result.freed_bytes,
    after=machine.gpus[0].allocated - baseline,
    cleared=list(result.cleared),
    big_alive=alive['big']() is not None,
    out_alive=alive['out']() is not None,
    model_kept="model" in ip.user_ns,
    out_entries=[k for k, v in Out.items() if reaches_cuda(v, probe)],
)
print(json.dumps(report))
""",
]


@pytest.mark.notebook
def test_cleanup_frees_frames_and_output_cache_in_a_real_kernel() -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in CELLS])
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=120, allow_errors=True, resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()
    errors = [o for c in nb.cells[:1] + nb.cells[2:] for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    assert nb.cells[1].outputs[-1].ename == "RuntimeError"
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
    report = json.loads(text.strip().splitlines()[-1])
    GiB = 1024**3
    assert report["cell"] == "f()"
    assert report["held_after_oom"] == 7 * GiB  # 4 GiB in f's frame, 3 GiB in Out
    names = {name for name, _, _ in report["holders"]}
    assert "frame of f() (from the failed cell's traceback)" in names
    assert any(name.startswith("Out[") for name in names)
    assert report["verdict"] == "held by IPython after the error"
    assert report["freed"] == 7 * GiB
    assert report["after"] == 0
    assert not report["big_alive"] and not report["out_alive"]
    assert report["model_kept"]
    assert report["out_entries"] == []
