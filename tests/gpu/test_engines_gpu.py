"""Two ipyparallel engines on the real GPU, each measuring its own cell; the client's table against numbers
worked out by hand and against NVML's own list of processes on the card."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ipp = pytest.importorskip("ipyparallel", reason="needs the parallel extra: pip install '.[parallel]'")

MiB = 1024**2
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster():
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.testing.globalipapp import start_ipython

    if not InteractiveShell.initialized():
        start_ipython()
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), saved]))
    cluster = ipp.Cluster(n=2, log_level=40)
    try:
        client = cluster.start_and_connect_sync()
        client.wait_for_engines(2, timeout=120)
        yield client
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


def test_each_engines_peak_and_process_on_the_shared_card(cluster, ip):
    from jupyter_cudamem import magics
    from jupyter_cudamem.sources.nvml import shared_session

    client = cluster
    magics.unload(ip)
    ip.run_line_magic("load_ext", "jupyter_cudamem")
    try:
        client[:].scatter("k", client.ids, flatten=True, block=True)
        for cell in (
            "%px %load_ext jupyter_cudamem",
            "%px import torch; torch.empty(1, device='cuda')",  # each engine's CUDA context, before the measured cell
            # Engine k holds (k + 1) x 256 MiB and passes through 512 MiB more: whole 2 MiB blocks, so the
            # allocator's figures are exactly these sizes.
            "%%px\n%%cudamem -q\nkept = torch.empty((k + 1) * 256 * 2**20, dtype=torch.uint8, device='cuda')\n"
            "passing = torch.empty(512 * 2**20, dtype=torch.uint8, device='cuda'); del passing",
        ):
            assert ip.run_cell(cell).success, cell
        report = ip.run_line_magic("cudamem_engines", "-o")
        rows = {row["engine"]: row for row in report.rows()}
        for k in (0, 1):
            assert rows[k]["peak_above_start_bytes"] == (k + 1) * 256 * MiB + 512 * MiB
            assert rows[k]["allocated_delta_bytes"] == (k + 1) * 256 * MiB
        assert rows[0]["device_uuid"] == rows[1]["device_uuid"] and rows[0]["pid"] != rows[1]["pid"]
        # NVML's list of processes on the card, read here: each engine's figure is its own process's.
        nvml = shared_session()
        index = next(d.nvml_index for d in nvml.devices() if d.uuid.lower().endswith(rows[0]["device_uuid"].lower()[-36:]))
        listed = {p.pid: p.used_bytes for p in nvml.processes(index) or []}
        assert [listed.get(rows[k]["pid"]) for k in (0, 1)] == [rows[0]["process_bytes"], rows[1]["process_bytes"]]
        assert report.spread.straggler_engine == 1 and report.spread.spread_bytes == 256 * MiB
    finally:
        ip.run_line_magic("unload_ext", "jupyter_cudamem")
