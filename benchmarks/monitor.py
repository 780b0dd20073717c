"""What the live monitor costs a training loop, side by side with nvitop's API and gpustat.

A small model trains on the GPU while a monitor polls in a background thread of the same process
(the situation in a notebook: the monitor started in one cell, training in the next). Configs, run
interleaved in a shuffled order each round so drift (clocks, thermals) spreads over all of them:

- ``off`` twice (``off`` and ``off_again``): their difference is the noise floor of the run;
- ``cudamem@0.1`` and ``cudamem@1.0``: our ``Poller`` plus the widget view it would drive (no
  frontend: the messages the view would send are counted by patching ``ipywidgets.Widget._send``);
- ``nvitop@...``: a thread polling nvitop's ``Device`` API for the same figures (memory used and
  total, utilisation, processes);
- ``gpustat@...``: a thread calling ``gpustat.new_query()``, what ``gpustat -i`` does each refresh.

For each trial: steps per second, the polling thread's own CPU time (its thread CPU clock), and
messages sent per second. The summary gives the slowdown of each config against the two ``off``
trials of the same round (mean and standard error over rounds).

The loop is deliberately dispatch-bound (a small MLP, Adam): the GPU waits on Python, so any time
a polling thread takes the GIL shows. That is the worst case for a Python monitor.

Run on the GPU machine: ``python3 benchmarks/monitor.py`` (about 2.5 minutes) writes
``benchmarks/results/monitor.json``. ``--dry-run`` runs briefly on the CPU over fake hardware, to
check the script itself.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch

from jupyter_cudamem.monitor.poller import Poller

INTERVALS = (0.1, 1.0)
DEFAULT_INTERVAL = 1.0


# -- the workload ---------------------------------------------------------------------------------
class Training:
    """A 5-layer MLP (1024 wide) trained with Adam on a fixed random batch."""

    description = "MLP 1024x1024 x4 + head, batch 256, Adam, fp32"

    def __init__(self, device: str):
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(4):
            layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
        layers.append(torch.nn.Linear(1024, 10))
        self.device = device
        self.model = torch.nn.Sequential(*layers).to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.inputs = torch.randn(256, 1024, device=device)
        self.targets = torch.randint(0, 10, (256,), device=device)

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(self.model(self.inputs), self.targets)
        loss.backward()
        self.optimizer.step()

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def run_for(self, seconds: float) -> tuple[int, float]:
        """Steps done in about ``seconds``, and the exact time they took (queued work included)."""
        self.sync()
        start = time.perf_counter()
        end = start + seconds
        steps = 0
        while time.perf_counter() < end:
            self.step()
            steps += 1
        self.sync()
        return steps, time.perf_counter() - start


# -- monitors -------------------------------------------------------------------------------------
def thread_cpu_s(thread: threading.Thread | None) -> float | None:
    """CPU seconds a (live) thread has used, from its own CPU clock (Linux)."""
    if thread is None or thread.ident is None or not thread.is_alive():
        return None
    getter = getattr(time, "pthread_getcpuclockid", None)
    if getter is None:
        return None
    return time.clock_gettime(getter(thread.ident))


class Messages:
    """Counts the state messages ipywidgets would send to a frontend."""

    def __init__(self) -> None:
        self.count = 0
        try:
            import ipywidgets
        except ImportError:
            self.available = False
            return
        self.available = True
        counter = self

        def counting_send(widget: Any, msg: Any, buffers: Any = None) -> None:
            counter.count += 1

        ipywidgets.Widget._send = counting_send  # type: ignore[method-assign]


class CudamemMonitor:
    def __init__(self, hardware: Any, interval_s: float):
        self.hardware = hardware
        self.interval_s = interval_s
        self.poller: Poller | None = None
        self.view: Any = None

    def start(self) -> None:
        from jupyter_cudamem.monitor.widget import WidgetView

        self.poller = Poller(self.hardware, interval_s=self.interval_s)
        self.view = WidgetView(self.poller)
        if not self.poller.start():
            raise RuntimeError(self.poller.state().unavailable)

    @property
    def thread(self) -> threading.Thread | None:
        return None if self.poller is None else self.poller.thread

    def stop(self) -> dict[str, Any]:
        assert self.poller is not None
        self.poller.stop()
        self.view.detach()
        return {"notifications": self.poller.notifications, "view_updates": self.view.updates_sent}


class PeerMonitor:
    """A thread calling ``poll()`` every ``interval_s``, as our poller does."""

    def __init__(self, poll: Callable[[], None], interval_s: float):
        self.poll = poll
        self.interval_s = interval_s
        self.thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.polls = 0
        self.errors: list[str] = []

    def _run(self) -> None:
        while True:
            try:
                self.poll()
                self.polls += 1
            except Exception as error:  # noqa: BLE001 - record and keep going, like a monitor must
                self.errors.append(f"{type(error).__name__}: {error}")
            if self._stop.wait(self.interval_s):
                return

    def start(self) -> None:
        self._stop.clear()
        self.thread = threading.Thread(target=self._run, name="peer-monitor", daemon=True)
        self.thread.start()

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self.thread is not None:
            self.thread.join(5)
        return {"polls": self.polls, "errors": self.errors[:3]}


def nvitop_poller() -> tuple[str, Callable[[], None]]:
    import nvitop
    from nvitop import Device

    devices = Device.all()

    def poll() -> None:
        for device in devices:
            device.memory_used()
            device.memory_total()
            device.gpu_utilization()
            device.processes()

    return getattr(nvitop, "__version__", "unknown"), poll


def gpustat_poller() -> tuple[str, Callable[[], None]]:
    import gpustat

    def poll() -> None:
        gpustat.new_query()

    return getattr(gpustat, "__version__", "unknown"), poll


# -- the run --------------------------------------------------------------------------------------
def environment(device: str, hardware: Any) -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "platform": platform.platform(),
    }
    if device == "cuda":
        info["device"] = torch.cuda.get_device_name(0)
        try:
            import pynvml

            info["driver"] = pynvml.nvmlSystemGetDriverVersion()
            info["nvml"] = pynvml.nvmlSystemGetNVMLVersion()
            info["nvidia_ml_py"] = getattr(pynvml, "__version__", None)
        except Exception as error:  # noqa: BLE001 - the figures still stand without these
            info["driver"] = f"unknown ({error})"
    else:
        info["device"] = "cpu (dry run over fake hardware)"
    return info


def fake_hardware() -> Any:
    from jupyter_cudamem.hardware import Hardware
    from tests.fakes import FakeAllocator, FakeMachine, FakeNvml

    machine = FakeMachine()
    machine.allocate(0, 1024**3)
    return Hardware(
        allocator=FakeAllocator(machine), nvml=FakeNvml(machine), pid=machine.pid, pid_exists=lambda p: True
    )


def summarise(trials: list[dict[str, Any]], configs: list[str], rounds: int) -> dict[str, Any]:
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for trial in trials:
        by_round.setdefault(trial["round"], {})[trial["config"]] = trial
    summary: dict[str, Any] = {}
    for config in configs:
        rows = [t for t in trials if t["config"] == config]
        slowdowns = []
        for round_trials in by_round.values():
            if config not in round_trials:
                continue
            baseline = statistics.mean(round_trials[c]["steps_per_s"] for c in ("off", "off_again"))
            slowdowns.append((1 - round_trials[config]["steps_per_s"] / baseline) * 100)
        cpu = [t for t in rows if t.get("thread_cpu_s") is not None]
        seconds = sum(t["seconds"] for t in rows)
        summary[config] = {
            "trials": len(rows),
            "steps_per_s_median": statistics.median(t["steps_per_s"] for t in rows),
            "slowdown_pct_mean": statistics.mean(slowdowns),
            "slowdown_pct_stderr": statistics.stdev(slowdowns) / len(slowdowns) ** 0.5 if len(slowdowns) > 1 else None,
            "thread_cpu_pct_of_core": (
                100 * sum(t["thread_cpu_s"] for t in cpu) / sum(t["seconds"] for t in cpu) if cpu else None
            ),
            "messages_per_s": (sum(t["messages"] for t in rows) / seconds)
            if rows[0].get("messages") is not None
            else None,
        }
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--trial-s", type=float, default=2.0, help="seconds of training per trial")
    parser.add_argument("--settle-s", type=float, default=0.3, help="seconds a monitor runs before a trial")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "monitor.json")
    parser.add_argument("--dry-run", action="store_true", help="a short run on the CPU over fake hardware")
    args = parser.parse_args()

    if args.dry_run:
        device, hardware = "cpu", fake_hardware()
    else:
        if not torch.cuda.is_available():
            print("benchmarks/monitor.py needs a CUDA device (or --dry-run)", file=sys.stderr)
            return 2
        from jupyter_cudamem.hardware import default_hardware

        device, hardware = "cuda", None
    training = Training(device)
    for _ in range(50):  # warm-up: kernels, allocator pools, Adam state
        training.step()
    training.sync()
    if hardware is None:
        hardware = default_hardware()

    messages = Messages()
    factories: dict[str, Callable[[], Any]] = {}
    peers: dict[str, str] = {}
    for interval in INTERVALS:
        factories[f"cudamem@{interval}"] = lambda interval=interval: CudamemMonitor(hardware, interval)
    for name, make_poll in (("nvitop", nvitop_poller), ("gpustat", gpustat_poller)):
        if args.dry_run:
            peers[name] = "not run (dry run)"
            continue
        try:
            version, poll = make_poll()
            poll()  # one call up front: a peer that cannot poll here is reported, not timed
        except ImportError:
            peers[name] = "not installed"
            continue
        except Exception as error:  # noqa: BLE001 - a peer that fails here is reported, not timed
            peers[name] = f"failed: {type(error).__name__}: {error}"
            continue
        peers[name] = version
        for interval in INTERVALS:
            factories[f"{name}@{interval}"] = lambda poll=poll, interval=interval: PeerMonitor(poll, interval)

    configs = ["off", "off_again", *factories]
    order_rng = random.Random(1234)
    trials: list[dict[str, Any]] = []
    started = time.perf_counter()
    for round_index in range(args.rounds):
        order = list(configs)
        order_rng.shuffle(order)
        for config in order:
            monitor = factories[config]() if config in factories else None
            if monitor is not None:
                monitor.start()
                time.sleep(args.settle_s)
            messages.count = 0
            cpu_before = thread_cpu_s(monitor.thread) if monitor is not None else None
            steps, seconds = training.run_for(args.trial_s)
            cpu_after = thread_cpu_s(monitor.thread) if monitor is not None else None
            sent = messages.count
            extra = monitor.stop() if monitor is not None else {}
            trial = {
                "round": round_index,
                "config": config,
                "steps": steps,
                "seconds": seconds,
                "steps_per_s": steps / seconds,
                "thread_cpu_s": None if cpu_before is None or cpu_after is None else cpu_after - cpu_before,
                "messages": sent if config.startswith("cudamem") and messages.available else None,
                **extra,
            }
            trials.append(trial)
        print(f"round {round_index + 1}/{args.rounds} done ({time.perf_counter() - started:.0f} s)", flush=True)

    summary = summarise(trials, configs, args.rounds)
    default = summary.get(f"cudamem@{DEFAULT_INTERVAL}", {})
    noise = summary["off_again"]
    result = {
        "benchmark": "monitor",
        **environment(device, hardware),
        "settings": {
            "rounds": args.rounds,
            "trial_s": args.trial_s,
            "settle_s": args.settle_s,
            "intervals_s": list(INTERVALS),
            "workload": Training.description,
            "dry_run": args.dry_run,
        },
        "peers": peers,
        "summary": summary,
        "goals": {
            "noise_floor_pct": {
                "off_again_vs_off_mean": noise["slowdown_pct_mean"],
                "stderr": noise["slowdown_pct_stderr"],
            },
            "cudamem_slowdown_under_1pct": {
                c: summary[c]["slowdown_pct_mean"] < 1.0 for c in summary if c.startswith("cudamem")
            },
            "cudamem_cpu_under_0.5pct_at_default_interval": (
                None if default.get("thread_cpu_pct_of_core") is None else default["thread_cpu_pct_of_core"] < 0.5
            ),
        },
        "trials": trials,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"\n{'config':<14}{'steps/s':>10}{'slowdown %':>12}{'± stderr':>10}{'thread CPU %':>14}{'msgs/s':>8}")
    for config, row in summary.items():
        stderr = row["slowdown_pct_stderr"]
        cpu = row["thread_cpu_pct_of_core"]
        msgs = row["messages_per_s"]
        print(
            f"{config:<14}{row['steps_per_s_median']:>10.1f}{row['slowdown_pct_mean']:>12.2f}"
            f"{'' if stderr is None else f'{stderr:.2f}':>10}{'' if cpu is None else f'{cpu:.3f}':>14}"
            f"{'' if msgs is None else f'{msgs:.2f}':>8}"
        )
    print(f"peers: {peers}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
