"""``%%cudamem --breakdown`` and ``--nvtx`` in a real shell over fake hardware; the tracker counts real CPU
tensors (``PeakTracker(ns, "cpu")``) while the fake allocator plays the GPU's measured peak."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from jupyter_cudamem import magics
from jupyter_cudamem.breakdown import Category, Phase

torch = pytest.importorskip("torch")

MiB = 1024**2
# nn.Linear(64, 128): a 128 x 64 weight and 128 biases, float32.
LINEAR_BYTES = (128 * 64 + 128) * 4


def cudamem(shell):
    return magics.loaded(shell).magics[0]


@pytest.fixture
def cpu_tracked(shell):
    from jupyter_cudamem.sources.torch_breakdown import PeakTracker

    cudamem(shell).breakdown_tracker = lambda namespace: PeakTracker(namespace, "cpu")
    # Models an earlier test left in the shared shell would be counted too: set aside while this one runs.
    earlier = {name: value for name, value in shell.user_ns.items() if isinstance(value, torch.nn.Module)}
    for name in earlier:
        del shell.user_ns[name]
    shell.user_ns["torch"] = torch
    yield shell
    for name in ("torch", "model", "x", "y", "r"):
        shell.user_ns.pop(name, None)
    shell.user_ns.update(earlier)


CELL = (
    "model = torch.nn.Linear(64, 128)\n"
    "with torch.no_grad():\n"
    "    y = model(torch.randn(32, 64))\n"
    "m.allocate(0, 64 * MiB); m.free(0, 64 * MiB)\n"
)


def test_breakdown_sums_to_the_measured_peak_and_names_the_model(cpu_tracked, capsys):
    cpu_tracked.user_ns["MiB"] = MiB
    result = cpu_tracked.run_cell("%%cudamem -o --breakdown\n" + CELL)
    assert result.success
    report = result.result
    breakdown = report.breakdown
    assert breakdown is not None and breakdown.peak_bytes == 64 * MiB
    assert sum(breakdown.categories.values()) == 64 * MiB
    assert sum(breakdown.modules.values()) == 64 * MiB
    assert breakdown.categories[Category.PARAMETERS] == LINEAR_BYTES
    # under no_grad the forward pass keeps nothing for backward: its output (32 x 128 floats) is a temporary
    assert breakdown.categories[Category.ACTIVATIONS] == 0
    assert breakdown.categories[Category.TEMPORARIES] == 32 * 128 * 4
    assert breakdown.modules["model"] == LINEAR_BYTES + 32 * 128 * 4
    assert breakdown.phase in (Phase.FORWARD, Phase.OUTSIDE)
    # other: the 32 x 64 input made outside the model; nothing was allocated before the cell
    parts = breakdown.other_parts
    assert parts.outside_models == 32 * 64 * 4 and parts.before_cell == 0
    assert parts.unseen == 64 * MiB - LINEAR_BYTES - 32 * 128 * 4 - 32 * 64 * 4
    text = report.details_text()  # behind the three lines, which name it
    assert "where the peak went" in report.text().splitlines()[3]
    assert "where the peak went: 64.00 MiB" in text and "by module:" in text and "model" in text
    assert "data:image/png;base64," in report._repr_html_()


def test_breakdown_off_never_builds_a_tracker(cpu_tracked):
    def refuse(namespace):
        raise AssertionError("a tracker was built with --breakdown off")

    cudamem(cpu_tracked).breakdown_tracker = refuse
    result = cpu_tracked.run_cell("%%cudamem -o\nm.allocate(0, MiB); m.free(0, MiB)")
    assert result.success and result.result.breakdown is None


def test_the_traitlet_makes_breakdown_the_default(cpu_tracked):
    cpu_tracked.run_line_magic("config", "CudaMem.breakdown = True")
    result = cpu_tracked.run_cell("%%cudamem -o\n" + CELL)
    assert result.success and result.result.breakdown is not None
    assert result.result.breakdown.categories[Category.PARAMETERS] == LINEAR_BYTES


class RecordingNvtx:
    def __init__(self):
        self.events = []

    @contextmanager
    def range(self, name):
        self.events.append(("push", name))
        try:
            yield
        finally:
            self.events.append(("pop", name))


def test_nvtx_wraps_the_cell_in_a_range_named_after_it(shell):
    ranges = RecordingNvtx()
    cudamem(shell).nvtx_ranges = ranges
    result = shell.run_cell("%%cudamem --nvtx\n\nm.allocate(0, 1024)  # first line\nm.free(0, 1024)", store_history=True)
    assert result.success
    count = result.execution_count
    name = f"In[{count}]: m.allocate(0, 1024)  # first line"
    assert ranges.events == [("push", name), ("pop", name)]


def test_nvtx_off_pushes_nothing_and_the_traitlet_turns_it_on(shell):
    ranges = RecordingNvtx()
    cudamem(shell).nvtx_ranges = ranges
    shell.run_cell("%%cudamem\nx = 1")
    assert ranges.events == []
    shell.run_line_magic("config", "CudaMem.nvtx = True")
    shell.run_cell("%%cudamem\nx = 2")
    assert [kind for kind, _ in ranges.events] == ["push", "pop"]


def test_nvtx_range_closes_when_the_cell_fails(shell):
    ranges = RecordingNvtx()
    cudamem(shell).nvtx_ranges = ranges
    result = shell.run_cell("%%cudamem --nvtx\nraise ValueError('boom')")
    assert isinstance(result.error_in_exec, ValueError)
    assert [kind for kind, _ in ranges.events] == ["push", "pop"]


def test_breakdown_without_a_gpu_is_one_line_and_the_cell_runs(ip, capsys):
    """As every magic of ours without a GPU: the body runs, one line says what it runs without, named as the
    user asked for it (the flag typed, else the setting; never a flag the user did not type)."""
    from tests.fakes import FakeAllocator, FakeMachine, FakeNvml

    from jupyter_cudamem.hardware import Hardware

    machine = FakeMachine()
    hardware = Hardware(
        FakeAllocator(machine, status="PyTorch 2.13.0+cpu (a CPU-only build) sees no CUDA device"),
        FakeNvml(machine, failure="NVML library (libnvidia-ml.so) not found: no NVIDIA driver on this machine"),
    )
    magics.unload(ip)
    magics.load(ip, hardware)
    reason = "(PyTorch 2.13.0+cpu (a CPU-only build) sees no CUDA device)"
    try:
        for header, expected in (
            ("%%cudamem --breakdown", f"cudamem: --breakdown needs PyTorch with a CUDA device {reason}; the cell runs without it"),
            ("%%cudamem --breakdown --trace -l 1GiB", f"cudamem: --limit and --trace and --breakdown need PyTorch with a CUDA "
                                                       f"device {reason}; the cell runs without them"),
        ):
            ip.user_ns.pop("broken_down", None)
            result = ip.run_cell(f"{header}\nbroken_down = 1")
            assert result.success and ip.user_ns["broken_down"] == 1
            assert capsys.readouterr().err.splitlines() == [expected]
        for setting in ("breakdown", "nvtx"):
            ip.run_cell(f"%config CudaMem.{setting} = True")
            try:
                for _ in range(2):  # every cell runs, not only the first
                    ip.user_ns.pop("broken_down", None)
                    result = ip.run_cell("%%cudamem -q\nbroken_down = 1\nbroken_down")
                    assert result.success and ip.user_ns["broken_down"] == 1 and ip.user_ns["_"] == 1
                    [line] = capsys.readouterr().err.splitlines()
                    assert line.startswith(f"cudamem: CudaMem.{setting} needs PyTorch with a CUDA device (")
                    assert "--" not in line
            finally:
                ip.run_cell(f"%config CudaMem.{setting} = False")
    finally:
        magics.unload(ip)
        for name in [n for n in ip.config if n.startswith("CudaMem")]:
            del ip.config[name]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: its NVTX ranges work")
def test_nvtx_without_cuda_is_one_line_and_the_cell_runs(shell, capsys):
    result = shell.run_cell("%%cudamem --nvtx\nmarked = 1")
    assert result.success and shell.user_ns["marked"] == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("cudamem: --nvtx needs PyTorch with a CUDA device (") and line.endswith("the cell runs without it")


def test_help_documents_both_options(shell):
    doc = cudamem(shell).cudamem.__doc__
    assert "--breakdown" in doc and "--nvtx" in doc
