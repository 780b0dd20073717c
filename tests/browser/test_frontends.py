"""The extension in a real JupyterLab and a real Notebook 7, seen through headless Chromium.

Each test runs once per frontend (JupyterLab, and Notebook 7 for users of the classic interface), each
served on loopback; it writes a notebook whose first cell injects the fake GPU of
``tests/fakes.py`` (test only: the package never sees it) and loads the extension over it, runs every
cell as the Run menu does, and checks what the page shows: the ``%%cudamem`` report table and the
history table with the fake machine's numbers, and the ``%cudamem_monitor`` widget whose numbers
follow a fake training loop and freeze when its Stop button is clicked. Screenshots go to
``tests/browser/screenshots/`` (Notebook 7's named ``notebook7-*``); ``make docs-images`` also copies
JupyterLab's into ``docs/images/``.

Needs Chromium, JupyterLab, Notebook 7, Playwright and ipywidgets (``make test-browser`` installs the
Python ones); without them the tests are skipped, or fail where ``CUDAMEM_REQUIRE_BROWSER=1`` (CI).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.browser import lab as jl
from tests.fakes import FakeGpu, GiB
from jupyter_cudamem.history import source_head
from jupyter_cudamem.units import format_bytes, parse_size

pytestmark = pytest.mark.browser

REQUIRED = os.environ.get("CUDAMEM_REQUIRE_BROWSER", "") not in ("", "0")
TIMEOUT_MS = 60_000


def _monitor_registered() -> bool:
    from jupyter_cudamem.magics import _magic_classes

    return any("cudamem_monitor" in kind.magics.get("line", {}) for kind in _magic_classes())


# -- the notebooks -------------------------------------------------------------------------------
# Test only: the fake machine from tests/fakes.py stands in for PyTorch's allocator and NVML, and the
# extension is loaded over it with magics.load() instead of %load_ext.
SETUP = """\
# Test only: a fake GPU from the repository's tests/ instead of PyTorch and NVML.
import os, sys
sys.path[:0] = [{repo!r}]
from tests.fakes import FakeAllocator, FakeMachine, FakeNvml, GiB
import jupyter_cudamem, jupyter_cudamem.magics
from jupyter_cudamem.hardware import Hardware
machine = FakeMachine()
hardware = Hardware(allocator=FakeAllocator(machine), nvml=FakeNvml(machine), pid=machine.pid,
                    pid_exists=lambda pid: True)
jupyter_cudamem.magics.load(get_ipython(), hardware)
print("KERNEL_PID", os.getpid())
print("PACKAGE", jupyter_cudamem.__file__)"""

# Sizes in GiB of the report cells below; the expected figures are worked out from them.
WEIGHTS_GIB, ACTIVATIONS_GIB = 6, 2

MEASURED_CELL = f"""\
%%cudamem
machine.allocate(0, {WEIGHTS_GIB} * GiB)      # plays: model = Net().cuda()
machine.allocate(0, {ACTIVATIONS_GIB} * GiB)      # plays: the forward pass's activations
machine.free(0, {ACTIVATIONS_GIB} * GiB)          # ... freed by backward()"""

RELEASE_CELL = f"""\
%%cudamem
machine.free(0, {WEIGHTS_GIB} * GiB)          # plays: del model
machine.empty_cache()               # plays: torch.cuda.empty_cache()"""

# A fake training loop: what it holds steps through these sizes every few hundred ms for a bounded
# time, freeing its cache on the way down, so the card's "used" moves both ways. Another process holds
# OTHER_GIB of the card all along, so the panel shows this kernel's share apart from the rest.
CHURN_GIB = (8, 20, 32, 44, 32, 20)
CHURN_STEP_S = 0.3
OTHER_GIB = 12
CHURN = f"""\
import threading, time
machine.gpus[0].other_process_bytes = {OTHER_GIB} * GiB  # plays: another job on the same card
stop_training = threading.Event()
first_step = threading.Event()

def fake_training(sizes_gib={CHURN_GIB!r}, step_s={CHURN_STEP_S}, seconds=90.0):
    held, step, deadline = 0, 0, time.monotonic() + seconds
    while not stop_training.is_set() and time.monotonic() < deadline:
        target = sizes_gib[step % len(sizes_gib)] * GiB
        if target > held:
            machine.allocate(0, target - held)
        else:
            machine.free(0, held - target)
            machine.empty_cache()
        held = target
        machine.gpus[0].utilization = 40 + (step * 17) % 60
        step += 1
        first_step.set()
        stop_training.wait(step_s)

threading.Thread(target=fake_training, name="fake-training", daemon=True).start()
assert first_step.wait(10), 'the fake training loop did not start'"""

MONITOR_INTERVAL_S = 0.25
MONITOR = f"%cudamem_monitor --interval {MONITOR_INTERVAL_S}"


def write_notebook(path: Path, cells: list[str]) -> None:
    import nbformat

    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    # Run All leaves the last cell selected; a closing markdown cell keeps the selection bar off the
    # code cells in the screenshots.
    notebook.cells.append(nbformat.v4.new_markdown_cell("End of the browser test's notebook."))
    nbformat.write(notebook, path)


def setup_cell_source() -> str:
    return SETUP.format(repo=str(jl.REPO))


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=list(jl.Frontend), ids=lambda frontend: frontend.name.lower())
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[jl.JupyterServer]:
    """Each frontend's server in turn: pytest runs every test on one before starting the other."""
    frontend: jl.Frontend = request.param
    missing = jl.missing_tools(frontend)
    if missing:
        (pytest.fail if REQUIRED else pytest.skip)(missing)
    with jl.JupyterServer(tmp_path_factory.mktemp(frontend.module), frontend) as running:
        yield running
    # The server stops its kernels on shutdown; make sure none outlived it.
    leftovers = [pid for pid in running.kernel_pids if jl.end_process(pid)]
    assert not leftovers, f"kernel processes {leftovers} outlived the {frontend.module} server and were killed"


@pytest.fixture(scope="module")
def browser(server: jl.JupyterServer) -> Iterator[Any]:
    with jl.chromium_browser() as chromium:
        yield chromium


@pytest.fixture
def page(browser: Any, server: jl.JupyterServer, request: pytest.FixtureRequest) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 1000}, device_scale_factor=2)
    context.set_default_timeout(TIMEOUT_MS)
    tab = context.new_page()
    (jl.SCREENSHOTS / f"{request.node.name}-failure.png").unlink(missing_ok=True)
    failed_before = request.session.testsfailed
    console_errors: list[str] = []
    tab.on("console", lambda message: console_errors.append(message.text) if message.type == "error" else None)
    tab.on("pageerror", lambda error: console_errors.append(str(error)))
    try:
        yield tab
    finally:
        # What a failure needs to be understood: the page as it was, the browser's errors, the server log.
        if request.session.testsfailed > failed_before:
            with contextlib.suppress(Exception):
                jl.screenshot(tab, f"{request.node.name}-failure")
            print("browser console errors:\n" + "\n".join(console_errors[-30:]))
            print(f"{server.frontend.module} server log:\n" + server.log_tail())
        context.close()
        server.stop_kernels()


# -- helpers -------------------------------------------------------------------------------------
def open_and_run(page: Any, server: jl.JupyterServer, name: str, cells: list[str]) -> None:
    write_notebook(server.root / name, cells)
    jl.open_notebook(page, server, name)
    jl.run_all_cells(page, name)
    setup_text = jl.code_cell(page, 0).locator(".jp-OutputArea-output").first.inner_text()
    kernel_pid = re.search(r"KERNEL_PID (\d+)", setup_text)
    assert kernel_pid, f"setup cell did not run: {setup_text!r}"
    server.kernel_pids.append(int(kernel_pid.group(1)))
    package = re.search(r"PACKAGE (\S+)", setup_text)
    assert package and Path(package.group(1)).resolve().is_relative_to(jl.REPO), (
        f"the kernel imported jupyter_cudamem from {package and package.group(1)}, not from this checkout"
    )


def assert_no_errors(page: Any) -> None:
    errors = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    texts = errors.all_inner_texts()
    assert not texts, f"a cell showed an error: {texts}"


def screenshot(server: jl.JupyterServer, target: Any, name: str) -> Path:
    """JupyterLab's screenshots keep the names docs/images uses; Notebook 7's are ``notebook7-NAME``."""
    return jl.screenshot(target, name if server.frontend is jl.Frontend.LAB else f"notebook7-{name}")


def publish(server: jl.JupyterServer, shots: list[Path]) -> None:
    """The README shows JupyterLab: only its screenshots go to docs/images."""
    if server.frontend is jl.Frontend.LAB:
        jl.publish(shots)


def shown_as_html(text: str) -> str:
    """``text`` as a browser shows it in a table cell: runs of spaces collapse to one."""
    return " ".join(text.split())


def table_rows(table: Any) -> list[list[str]]:
    return table.evaluate("t => Array.from(t.rows).map(r => Array.from(r.cells).map(c => c.innerText.trim()))")


# -- tests ---------------------------------------------------------------------------------------
def test_cudamem_report_and_history_render(page: Any, server: jl.JupyterServer) -> None:
    open_and_run(page, server, "cudamem.ipynb", [setup_cell_source(), MEASURED_CELL, RELEASE_CELL, "%cudamem_history"])
    assert_no_errors(page)

    gpu = FakeGpu()
    peak = (WEIGHTS_GIB + ACTIVATIONS_GIB) * GiB
    used_after = gpu.context_bytes + peak  # the first allocation made the CUDA context; reserved = peak

    report = jl.code_cell(page, 1).locator(".cudamem-report")
    report.locator("summary").wait_for()
    assert report.locator("b").first.inner_text().startswith("cudamem [2]")
    assert not report.locator("table").is_visible()  # the figures per device sit behind the three lines
    report.locator("summary").click()
    report.locator("table").wait_for()
    header, *rows = table_rows(report.locator("table"))
    assert header[1] == f"cuda:0 {gpu.name}"
    figures = {row[0]: row[1] for row in rows}
    assert list(figures) == ["peak allocated", "Δ allocated", "Δ reserved", "Δ NVML used", "free at end"]
    assert figures["peak allocated"].startswith(f"{format_bytes(peak)} +{format_bytes(peak)} above start")
    assert figures["Δ allocated"].startswith(format_bytes(WEIGHTS_GIB * GiB, signed=True))
    assert figures["Δ reserved"].startswith(format_bytes(peak, signed=True))
    assert figures["Δ NVML used"] == (
        f"{format_bytes(used_after, signed=True)} outside PyTorch {format_bytes(gpu.context_bytes, signed=True)}"
    )
    assert figures["free at end"] == f"{format_bytes(gpu.total_bytes - used_after)} of {format_bytes(gpu.total_bytes)}"
    # Rendered as a table, not as the plain-text fallback.
    assert report.locator("table").is_visible()
    assert jl.code_cell(page, 1).locator(".jp-OutputArea-output pre").count() == 0

    history = jl.code_cell(page, 3).locator("table.cudamem-history")
    history.wait_for()
    header, *rows = table_rows(history)
    assert header == ["cell", "source", "device", "peak", "Δ allocated", "Δ reserved", "Δ NVML", "time", "growing"]
    assert [row[8] for row in rows] == ["", ""]  # neither cell was run again, so neither grows
    assert [row[:3] for row in rows] == [
        ["[2]", shown_as_html(source_head(MEASURED_CELL)), "cuda:0"],
        ["[3]", shown_as_html(source_head(RELEASE_CELL)), "cuda:0"],
    ]
    assert rows[0][3:7] == [
        format_bytes(peak),
        format_bytes(WEIGHTS_GIB * GiB, signed=True),
        format_bytes(peak, signed=True),
        format_bytes(used_after, signed=True),
    ]
    assert rows[1][3:7] == [
        format_bytes(WEIGHTS_GIB * GiB),  # the peak of a cell that only frees is what it started with
        format_bytes(-WEIGHTS_GIB * GiB, signed=True),
        format_bytes(-peak, signed=True),
        format_bytes(-peak, signed=True),
    ]

    shots = [
        screenshot(server, jl.code_cell(page, 1), "cudamem-report"),
        screenshot(server, jl.code_cell(page, 3), "cudamem-history"),
    ]
    screenshot(server, page, "cudamem-notebook")
    publish(server, shots)


USED = re.compile(r"(\d+(?:\.\d+)? [KMGT]?i?B) / (\d+(?:\.\d+)? [KMGT]?i?B) \((\d+)%\)")


def used_reading(panel: Any) -> str:
    match = USED.search(panel.inner_text())
    assert match, f"no 'used / total (percent)' in the monitor panel: {panel.inner_text()!r}"
    return match.group(1)


@pytest.mark.skipif(
    not _monitor_registered(),
    reason="%cudamem_monitor is not registered in this tree yet (it comes with the monitor branch); "
    "this test runs as soon as it is",
)
def test_monitor_widget_renders_and_updates(page: Any, server: jl.JupyterServer) -> None:
    open_and_run(page, server, "monitor.ipynb", [setup_cell_source(), CHURN, MONITOR])
    assert_no_errors(page)

    gpu = FakeGpu()
    cell = jl.code_cell(page, 2)
    panel = cell.locator(".widget-html-content", has_text="GPU memory")
    panel.wait_for()
    # The live widget, not the text line a frontend without widgets shows.
    assert cell.locator(".jupyter-widgets .cudamem-bar").count() == 1
    assert "no panel here" not in cell.inner_text()
    assert f"every {int(MONITOR_INTERVAL_S * 1000)} ms" in panel.inner_text()
    assert f"cuda:0 {gpu.name}" in panel.inner_text()
    stop = cell.get_by_role("button", name="Stop")
    assert stop.is_enabled()

    # The numbers follow the fake training loop: every reading is one of the sizes it steps through
    # (plus the CUDA context), and within a few seconds they take most of them, going up and down.
    # Two of its cycles are watched, so the sparkline in the screenshot shows them too.
    possible = {format_bytes(gpu.context_bytes + (size + OTHER_GIB) * GiB) for size in CHURN_GIB}
    seen: list[str] = []
    started = time.monotonic()
    watch_s = 2 * len(CHURN_GIB) * CHURN_STEP_S
    while time.monotonic() - started < 15:
        seen.append(used_reading(panel))
        used = [parse_size(text) for text in seen]
        rose = any(b > a for a, b in zip(used, used[1:]))
        fell = any(b < a for a, b in zip(used, used[1:]))
        if len(set(seen)) >= 4 and rose and fell and time.monotonic() - started >= watch_s:
            break
        time.sleep(0.2)
    assert set(seen) <= possible, f"monitor showed {set(seen) - possible}, the fake card only ever used {possible}"
    assert len(set(seen)) >= 4 and rose and fell, f"the monitor's numbers did not follow the card for 15 s: {seen}"
    assert format_bytes(gpu.total_bytes) in panel.inner_text()
    shot = screenshot(server, cell, "monitor")

    # Stop from the browser: the click reaches the kernel, the thread stops, the numbers freeze
    # while the fake training loop keeps changing the card.
    stop.click()
    page.wait_for_function(
        "panel => panel.innerText.includes('stopped')", arg=panel.element_handle(), timeout=10_000, polling=100
    )
    cell.get_by_role("button", name="Stop").and_(cell.locator("button:disabled")).wait_for(timeout=10_000)
    frozen = [used_reading(panel)]
    for _ in range(6):
        time.sleep(CHURN_STEP_S)
        frozen.append(used_reading(panel))
    assert len(set(frozen)) == 1, f"the monitor kept updating after Stop: {frozen}"
    screenshot(server, cell, "monitor-stopped")

    # Snapshot plots the recorded history (matplotlib) into the panel.
    cell.get_by_role("button", name="Snapshot").click()
    plot = cell.locator(".jupyter-widgets img")
    plot.wait_for(timeout=20_000)
    page.wait_for_function("img => img.complete && img.naturalWidth > 100", arg=plot.element_handle(), timeout=20_000)
    snapshot_shot = screenshot(server, cell, "monitor-snapshot")
    screenshot(server, page, "monitor-notebook")
    publish(server, [shot, snapshot_shot])
