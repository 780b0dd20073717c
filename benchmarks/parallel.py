"""GPU memory across ipyparallel engines: what each engine measured, what the client's table shows, and
what gathering costs a cell.

A local cluster of ``--engines`` engines shares the machine's one GPU; each engine runs a different
workload (an MLP, a small CNN, a transformer encoder: ``k % 3`` picks it for engine ``k``) under
``%%px`` + ``%%cudamem``. For each engine the result lists the peak the engine measured itself (read from
its own history) beside the peak the client's ``%cudamem_engines`` table shows, with host, pid and the
card's UUID. Then the time the gathering adds per cell: the same ``%%px``/``%%cudamem`` cell run with
``%cudamem_engines on`` and off, interleaved (``--repeats`` of each), and ``%cudamem_engines -o`` alone.
Last, the engines monitor at 0.5 s while every engine trains for a few seconds: the updates it showed and
each engine's own process on the shared card as NVML reported it.

Run on the GPU machine: ``python3 benchmarks/parallel.py`` writes ``benchmarks/results/parallel.json``.
``--dry-run`` runs on the CPU over the fake card of ``tests/engine_fakes.py`` (to check the script itself).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

WORKLOADS = '''\
%%px
import torch

def make_step(k):
    """Engine k's workload: one Adam step of an MLP, a small CNN or a transformer encoder."""
    torch.manual_seed(k)
    kind = ("mlp", "cnn", "transformer")[k % 3]
    if kind == "mlp":
        model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(4096, 4096), torch.nn.ReLU())])
        x = torch.randn(2048, 4096)
    elif kind == "cnn":
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(64, 128, 3, padding=1),
            torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(128, 10))
        x = torch.randn(256, 3, 64, 64)
    else:
        layer = torch.nn.TransformerEncoderLayer(d_model=512, nhead=8, batch_first=True)
        model = torch.nn.TransformerEncoder(layer, num_layers=2)
        x = torch.randn(64, 256, 512)
    model, x = model.cuda(), x.cuda()
    optimizer = torch.optim.Adam(model.parameters())

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(x).float().pow(2).mean().backward()
        optimizer.step()

    return kind, step

kind, step = make_step(k)
'''

FAKE_WORKLOADS = '''\
%%px
from tests import engine_fakes
machine = engine_fakes.install(get_ipython())
kind = ("fake-small", "fake-large")[k % 2]

def step():
    machine.allocate(0, (k + 1) * 2**30)
    machine.allocate(0, 2**30)
    machine.free(0, 2**30)
    machine.free(0, (k + 1) * 2**30)
'''

MEASURED_CELL = "%%px\n%%cudamem\nstep()"


def own_last_cell():
    """Run on an engine (shipped by code): its last measured cell from its own history, not our records."""
    import os
    import socket

    from IPython import get_ipython

    from jupyter_cudamem.magics import loaded
    from jupyter_cudamem.magics.cudamem import CudaMem

    record = loaded(get_ipython()).get(CudaMem).history.records[-1]
    device = record.measurement.devices[0]
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device_uuid": device.device.uuid,
        "peak_bytes": device.peak_allocated_bytes,
        "allocated_delta_bytes": device.allocated_delta_bytes,
        "process_bytes": device.after.process_bytes,
    }


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in ("torch", "ipython", "ipykernel", "ipyparallel", "pyzmq", "nvidia-ml-py"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    # A copy of the working tree without its own .git (how it reaches the GPU machine) would otherwise report the
    # commit of whatever repository encloses it: CUDAMEM_COMMIT names the commit that was copied.
    found["jupyter_cudamem_commit"] = os.environ.get("CUDAMEM_COMMIT") or "unknown"
    if (REPO / ".git").exists():
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO, timeout=10)
            found["jupyter_cudamem_commit"] = commit.stdout.strip() or "unknown"
        except (OSError, subprocess.SubprocessError):
            pass
    return found


def device_name(dry_run: bool) -> str:
    if dry_run:
        return "fake card (tests/engine_fakes.py), CPU only"
    import torch

    return torch.cuda.get_device_name(0)


def run_quietly(ip, cell: str) -> float:
    """Run a cell with its output swallowed (every engine prints its report); its wall time in seconds."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        started = time.perf_counter()
        result = ip.run_cell(cell)
        seconds = time.perf_counter() - started
    if not result.success:
        raise SystemExit(f"cell failed: {cell!r}: {result.error_in_exec or result.error_before_exec}")
    return seconds


def summary(values: list[float]) -> dict[str, float]:
    return {"min_s": min(values), "median_s": statistics.median(values), "max_s": max(values), "n": len(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--monitor-s", type=float, default=4.0)
    parser.add_argument("--dry-run", action="store_true", help="CPU only, over the fake card of tests/engine_fakes.py")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "parallel.json")
    args = parser.parse_args(argv)

    import ipyparallel as ipp
    from IPython.testing.globalipapp import start_ipython

    from jupyter_cudamem import magics
    from jupyter_cudamem.engines.gather import ask_engines
    from jupyter_cudamem.magics.engines import CudaMemEngines, engine_report

    ip = start_ipython()
    # Engines are processes of their own: they find this checkout (and, for --dry-run, tests.engine_fakes) on their path.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    started = time.perf_counter()
    cluster = ipp.Cluster(n=args.engines, log_level=40)
    client = cluster.start_and_connect_sync()
    try:
        client.wait_for_engines(args.engines, timeout=180)
        start_s = time.perf_counter() - started
        ip.run_line_magic("load_ext", "jupyter_cudamem")
        client[:].scatter("k", client.ids, flatten=True, block=True)
        if args.dry_run:
            run_quietly(ip, FAKE_WORKLOADS)
        else:
            run_quietly(ip, "%px %load_ext jupyter_cudamem")
            run_quietly(ip, WORKLOADS)
        kinds = {engine: client[engine].pull("kind", block=True) for engine in client.ids}
        run_quietly(ip, MEASURED_CELL)  # warm-up: CUDA context, cuBLAS/cuDNN workspaces, Adam's state
        run_quietly(ip, MEASURED_CELL)
        extension = magics.loaded(ip)
        engines_magics = extension.get(CudaMemEngines)
        with contextlib.redirect_stdout(io.StringIO()) as shown:
            report = ip.run_line_magic("cudamem_engines", "-o")
        print(shown.getvalue())
        own = {engine: client[engine].apply_sync(own_last_cell) for engine in client.ids}
        engines = []
        for answer in report.answers:
            device = answer.latest.devices[0]
            mine = own[answer.engine_id]
            engines.append(
                {
                    "engine": answer.engine_id,
                    "workload": kinds[answer.engine_id],
                    "host": answer.report.identity.host,
                    "pid": answer.report.identity.pid,
                    "device_uuid": device.uuid,
                    "engine_peak_bytes": mine["peak_bytes"],
                    "client_peak_bytes": device.peak_allocated_bytes,
                    "engine_allocated_delta_bytes": mine["allocated_delta_bytes"],
                    "client_allocated_delta_bytes": device.allocated_delta_bytes,
                    "engine_process_bytes": mine["process_bytes"],
                    "client_process_bytes": device.process_bytes,
                    "engine_host": mine["host"],
                    "engine_pid": mine["pid"],
                    "engine_device_uuid": mine["device_uuid"],
                }
            )
        agree = all(
            e["engine_peak_bytes"] == e["client_peak_bytes"] and e["engine_pid"] == e["pid"] and e["engine_device_uuid"] == e["device_uuid"]
            for e in engines
        )

        # What gathering adds per cell: the measured cell with the after-every-%px-cell table on and off, interleaved.
        off, on, gather = [], [], []
        for _ in range(args.repeats):
            off.append(run_quietly(ip, MEASURED_CELL))
            with contextlib.redirect_stdout(io.StringIO()):
                ip.run_line_magic("cudamem_engines", "on")
            on.append(run_quietly(ip, MEASURED_CELL))
            with contextlib.redirect_stdout(io.StringIO()):
                ip.run_line_magic("cudamem_engines", "off")
            t0 = time.perf_counter()
            ask_engines(client, client.ids, engine_report, 1, timeout_s=30)
            gather.append(time.perf_counter() - t0)
        added = [b - a for a, b in zip(off, on)]

        # The live monitor while every engine trains.
        with contextlib.redirect_stdout(io.StringIO()):
            live = engines_magics.start_monitor(client, client.ids, 0.5)
        loop = f"%%px\nimport time\nend = time.time() + {args.monitor_s}\nwhile time.time() < end:\n    step()\n"
        before = live.notifications
        seconds = run_quietly(ip, loop)
        time.sleep(1.0)
        rows = live.state().engines
        notifications = live.notifications - before
        engines_magics.stop_monitor(quiet=True)
        monitor = {
            "interval_s": 0.5,
            "loop_s": seconds,
            "client_notifications": notifications,
            "client_notifications_per_s": notifications / seconds,
            "engines": [
                {
                    "engine": row.engine_id,
                    "status": row.status.value,
                    "pid": None if row.reading is None else row.reading.identity.pid,
                    "device_uuid": None if row.reading is None else row.reading.devices[0].uuid,
                    "process_bytes": None if row.reading is None else row.reading.devices[0].process_bytes,
                    "used_bytes": None if row.reading is None else row.reading.devices[0].used_bytes,
                    "peak_used_bytes": None if row.reading is None else row.reading.devices[0].peak_used_bytes,
                    "readings_sent": None if row.reading is None else row.reading.sequence,
                }
                for row in rows
            ],
        }
    finally:
        try:
            client.close()
        finally:
            cluster.stop_cluster_sync()

    results = {
        "benchmark": "parallel",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": device_name(args.dry_run),
        "versions": versions(),
        "platform": platform.platform(),
        "settings": {"engines": args.engines, "repeats": args.repeats, "dry_run": args.dry_run, "cluster_start_s": start_s},
        "engines": engines,
        "engine_and_client_agree": agree,
        "table_text": report.text(),
        "gathering": {
            "cell_without_s": summary(off),
            "cell_with_on_s": summary(on),
            "added_per_cell_s": {"median_s": statistics.median(added), "min_s": min(added), "max_s": max(added)},
            "gather_alone_s": summary(gather),
        },
        "monitor": monitor,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: results[k] for k in ("device", "engines", "engine_and_client_agree", "gathering")}, indent=2))
    print(f"wrote {args.out}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
