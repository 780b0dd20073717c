"""A real local ipyparallel cluster: two engines over the fake card of ``tests/fakes.py``.

The client is the test's IPython shell; the engines are processes of their own, each loading the
extension over a fake card that both share (one UUID, two process ids: ``tests/engine_fakes.py``). Engine
``k`` holds ``k + 1`` GiB after a cell whose temporary 1 GiB was freed, so the figures below are worked
out by hand: peak ``k + 2`` GiB, Δ allocated ``k + 1`` GiB, Δ reserved ``k + 2`` GiB (the fake allocator
keeps the freed block reserved), NVML's per-process figure 512 MiB of context plus what is reserved.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

ipp = pytest.importorskip("ipyparallel", reason="needs the parallel extra: pip install '.[parallel]'")

from jupyter_cudamem import magics  # noqa: E402
from jupyter_cudamem.engines.live import EngineLiveStatus  # noqa: E402
from jupyter_cudamem.engines.records import EngineStatus  # noqa: E402
from jupyter_cudamem.magics.engines import CudaMemEngines  # noqa: E402

from tests.engine_fakes import SHARED_UUID, feeds, own_last_cell  # noqa: E402

GiB, MiB = 1024**3, 1024**2
REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60

SETUP = "%px from tests import engine_fakes; machine = engine_fakes.install(get_ipython()); GiB = 1024**3; k = engine_fakes.engine_id(get_ipython())"
WORKLOAD = "%%px\n%%cudamem\nmachine.allocate(0, (k + 1) * GiB)\nmachine.allocate(0, GiB)\nmachine.free(0, GiB)"


@pytest.fixture(scope="module")
def cluster():
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.testing.globalipapp import start_ipython

    if not InteractiveShell.initialized():
        start_ipython()  # the client shell must exist before connecting: ipyparallel registers %px on it
    saved = os.environ.get("PYTHONPATH")
    # Engines are processes of their own: they find this checkout (and so tests.engine_fakes) on their path.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), saved]))
    cluster = ipp.Cluster(n=2, log_level=40)
    try:
        client = cluster.start_and_connect_sync()
        client.wait_for_engines(2, timeout=START_TIMEOUT_S)
        yield cluster, client
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
        try:
            client.close()
        except Exception:
            pass
        cluster.stop_cluster_sync()


@pytest.fixture
def client_shell(cluster, ip, hardware):
    magics.unload(ip)
    magics.load(ip, hardware)
    ip.run_line_magic("config", "CudaMemEngines.timeout_s = 20")
    yield ip, cluster[1]
    magics.unload(ip)


def wait_until_engines_take_cells(client) -> None:
    """After a failed cell, ipykernel aborts the execute requests that reach an engine at once (its
    ``stop_on_error``), and ipyparallel reports an aborted request as no output, not as an error: a test sending
    ``%px %oomfix`` right then would see nothing on that engine. Wait until an empty cell runs everywhere."""
    from ipyparallel.error import TaskAborted

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if not any(isinstance(r, TaskAborted) for r in client[:].execute("", block=False).get(timeout=20)):
            return
        time.sleep(0.05)
    raise AssertionError("the engines still abort cells 20 s after a failed one")


def engines_magics(ip) -> CudaMemEngines:
    found = magics.loaded(ip).get(CudaMemEngines)
    assert isinstance(found, CudaMemEngines)
    return found


def test_the_table_gathers_each_engines_own_report(client_shell):
    ip, client = client_shell
    before = ip.run_line_magic("cudamem_engines", "-o")
    assert [a.status for a in before.answers] == [EngineStatus.NOT_LOADED, EngineStatus.NOT_LOADED]
    assert "run %px %load_ext jupyter_cudamem" in before.text()

    assert ip.run_cell(SETUP).success
    assert ip.run_cell(WORKLOAD).success
    report = ip.run_line_magic("cudamem_engines", "-o")
    own = {engine: client[engine].apply_sync(own_last_cell) for engine in client.ids}

    assert [a.engine_id for a in report.answers] == [0, 1]
    for answer in report.answers:
        k = answer.engine_id
        cell = answer.latest
        device = cell.devices[0]
        # What the engine measured itself...
        assert answer.report.identity.pid == own[k]["pid"]
        assert cell.execution_count == own[k]["execution_count"]
        assert (device.peak_allocated_bytes, device.allocated_delta_bytes, device.reserved_delta_bytes, device.process_bytes) == (
            own[k]["peak"], own[k]["allocated_delta"], own[k]["reserved_delta"], own[k]["process"]
        )
        # ...is what was worked out by hand for engine k.
        assert device.peak_allocated_bytes == (k + 2) * GiB
        assert device.allocated_delta_bytes == (k + 1) * GiB
        assert device.reserved_delta_bytes == (k + 2) * GiB
        assert device.process_bytes == (k + 2) * GiB + 512 * MiB
        assert device.uuid == SHARED_UUID.removeprefix("GPU-")
    # Peaks 2 and 3 GiB of 80: the spread is 1 GiB and engine 1 stands closest to its limit.
    assert report.spread.spread_bytes == GiB
    assert report.spread.straggler_engine == 1
    text = report.text()
    assert "engines 0, 1 share Fake H100" in text
    assert f"engine 0 (pid {own[0]['pid']}) 2.50 GiB, engine 1 (pid {own[1]['pid']}) 3.50 GiB" in text
    rows = report.rows()
    assert [(r["engine"], r["peak_allocated_bytes"], r["pid"]) for r in rows] == [
        (0, 2 * GiB, own[0]["pid"]), (1, 3 * GiB, own[1]["pid"])
    ]
    assert "<table" in report._repr_html_()

    history = ip.run_line_magic("cudamem_engines", "--history -o")
    assert [len(a.report.cells) for a in history.answers] == [1, 1]


def test_after_every_px_cell_and_oomfix_on_the_engines(client_shell, capsys):
    ip, client = client_shell
    assert ip.run_cell(SETUP).success
    ip.run_line_magic("cudamem_engines", "on")
    capsys.readouterr()
    assert ip.run_cell(WORKLOAD).success
    shown = capsys.readouterr().out
    assert "cudamem engines: the latest measured cell of each engine" in shown
    assert "spread over 2 engines" in shown
    assert ip.run_cell("%px x = 1").success  # nothing newly measured: no second table
    assert "cudamem engines:" not in capsys.readouterr().out
    ip.run_line_magic("cudamem_engines", "off")

    # A fake out-of-memory error on each engine, then %oomfix there: the client says what each engine did.
    ip.run_cell("%%px\nmachine.gpus[0].fraction = 0.05\nmachine.allocate(0, (k + 10) * GiB)")
    wait_until_engines_take_cells(client)
    assert ip.run_cell("%px %oomfix --dry-run").success
    report = ip.run_line_magic("cudamem_engines", "-o")
    summaries = [a.report.oomfix for a in report.answers]
    assert all(s is not None and s.dry_run for s in summaries), summaries
    assert "%oomfix on the engines: engine 0: %oomfix --dry-run" in report.text()


def test_a_busy_engine_and_a_dead_one_stop_nothing(client_shell):
    ip, client = client_shell
    assert ip.run_cell(SETUP).success
    engines = engines_magics(ip)
    live = engines.start_monitor(client, [0, 1], 0.1)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(r.reading is None for r in live.state().engines):
            time.sleep(0.1)
        rows = live.state().engines
        assert [r.status for r in rows] == [EngineLiveStatus.LIVE, EngineLiveStatus.LIVE]
        # Each engine's own process on the shared card: 512 MiB of context, plus what the workload reserved.
        assert ip.run_cell(WORKLOAD).success
        deadline = time.monotonic() + 20
        expected = {0: 2 * GiB + 512 * MiB, 1: 3 * GiB + 512 * MiB}
        while time.monotonic() < deadline:
            seen = {r.engine_id: r.reading.devices[0].process_bytes for r in live.state().engines if r.reading}
            if seen == expected:
                break
            time.sleep(0.1)
        assert seen == expected

        # Engine 1 busy in a long cell: the table shows it as not answering and engine 0 as usual.
        busy = client[1].execute("import time; time.sleep(4)", block=False)
        report = ip.run_line_magic("cudamem_engines", "-o --timeout 1")
        assert [a.status for a in report.answers] == [EngineStatus.ANSWERED, EngineStatus.NO_ANSWER]
        busy.wait(10)

        # Engine 1 dies: the monitor shows it gone and keeps watching engine 0.
        client[1].apply_async(os._exit, 1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and 1 in client.ids:
            time.sleep(0.2)
        live.tick()
        rows = {r.engine_id: r.status for r in live.state().engines}
        assert rows == {0: EngineLiveStatus.LIVE, 1: EngineLiveStatus.GONE}
        assert live.running
        gone = ip.run_line_magic("cudamem_engines", "-o --targets 0,1")
        assert [a.status for a in gone.answers] == [EngineStatus.ANSWERED, EngineStatus.GONE]
        assert client[0].apply_sync(feeds) == ([engines._live_channel], True)
    finally:
        engines.stop_monitor(quiet=True)
    assert not live.running
    # The engine still alive stops sending, and stops the poller the feed started there.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and client[0].apply_sync(feeds) != ([], False):
        time.sleep(0.1)
    assert client[0].apply_sync(feeds) == ([], False)
