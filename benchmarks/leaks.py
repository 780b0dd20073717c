"""Benchmark: does ``%%cudamem`` name what a cell left behind, and at what cost?

Part ``cases``: classic leaks (losses kept in a list, a summed loss, a metric accumulated without
``.item()`` in a training loop, a forward hook storing outputs in a list and in its closure, a dict
cache of outputs, losses appended to a list inside a dict made in an earlier cell, tensors kept by
``Out``) and results that are not leaks (a model built, a dataset
moved to the GPU, Adam's first step, predictions made under ``no_grad``). Each case runs in one
IPython shell with the extension loaded: ``%reset -f``, the shared setup, the case's setup (not
measured), then the case's cell under ``%%cudamem -o``. A case passes when the report names the
expected holder with the expected cause and advice, attributes at least 90% of what the cell left
(leaks), and calls nothing a leak (results).

Part ``cost``: what attributing costs on a namespace of 10,000 objects: 10,000 names each holding a
tensor, a list, a dict or an object with a tensor, and 10 names holding 10,000 such objects between
them; the snapshot taken before every cell and the attribution after one, in two scenarios each: the
new name accounts for all the cell left (the attribution then walks only the unchanged modules), and
the cell also left 8 MiB no name holds (``*_full_walk``: every unchanged name is walked). On the GPU with
CUDA tensors and PyTorch's types; with ``--cpu-smoke`` with the tests' fake tensors. Goal: under 50 ms.

Run on the GPU machine: ``python benchmarks/leaks.py`` (about a minute; ``--part cases`` or
``--part cost``, ``--cases losses_list,out_cache`` for a subset). ``--cpu-smoke`` runs the same cases on
CPU tensors (an allocator that counts the CPU tensors Python and the autograd graphs reach stands in
for PyTorch's CUDA counters) and checks the plumbing, not the GPU figures. Results go to
``benchmarks/results/leaks.json`` (``leaks-cpu-smoke.json`` for the smoke run), written after every
case so a part that fails still leaves the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import io
import json
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

RESULTS = REPO / "benchmarks" / "results"
ATTRIBUTED_GOAL = 0.9
COST_GOAL_MS = 50.0


def say(message: str) -> None:
    print(message, flush=True)


# -- the cases ------------------------------------------------------------------------------------
# The shared setup: a 3-layer MLP (width D) on a batch of B rows; on the GPU one activation is
# B * D * 4 bytes = 8 MiB. A warm-up forward and backward stand for the notebook's earlier cells: cuBLAS
# makes a workspace per handle, through PyTorch's caching allocator, the first time a thread multiplies
# matrices, and backward runs on autograd's own thread with its own handle. So the process's first
# forward and its first backward each leave a workspace allocated for good (32 MiB each on an H100 with
# CUBLAS_WORKSPACE_CONFIG unset: the first GPU run of this benchmark saw the training-loop case leave
# 32 MiB "not reachable from any name"). That is PyTorch's cache, not the cell's leak, and a notebook
# that trains has paid it before the cell in question; the report shows it as the remainder if not.
PRELUDE = """
import gc, torch
from torch import nn
torch.manual_seed(0)
dev, B, D = {dev!r}, {batch}, {width}
model = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D)).to(dev)
x = torch.randn(B, D, device=dev)
y = torch.randn(B, D, device=dev)
model(x).pow(2).mean().backward()
model.zero_grad(set_to_none=True)
"""


@dataclass(frozen=True)
class Case:
    """A cell to measure, and what its report must say.

    ``expected_holder`` is the holder's name (``"Out["``: any output-cache entry); ``causes`` the
    causes accepted for it; ``advice`` a phrase its advice must contain.
    """

    name: str
    leak: bool
    expected_holder: str
    causes: tuple[str, ...]
    advice: str
    cell: str
    setup: str = ""

    def matches(self, holder_name: str) -> bool:
        if self.expected_holder.endswith("["):
            return any(part.startswith(self.expected_holder) for part in holder_name.split(" / "))
        return holder_name == self.expected_holder


CASES = (
    Case(
        "losses_list",
        True,
        "losses",
        ("autograd graph",),
        "loss.item()",
        "losses = []\nfor _ in range(20):\n    losses.append(model(x).pow(2).mean())",
    ),
    Case(
        "summed_loss",
        True,
        "total",
        ("autograd graph",),
        "total += value.item()",
        "total = 0\nfor _ in range(20):\n    total = total + model(x).pow(2).mean()",
    ),
    Case(
        "metric_in_training_loop",
        True,
        "running_mae",
        ("autograd graph",),
        ".item()",
        "running_mae = 0.0\nfor _ in range(20):\n    out = model(x)\n    loss = nn.functional.mse_loss(out, y)\n"
        "    opt.zero_grad()\n    loss.backward()\n    opt.step()\n"
        "    running_mae += nn.functional.l1_loss(out, y)",
        setup="opt = torch.optim.SGD(model.parameters(), lr=1e-4)",
    ),
    Case(
        "forward_hook_list",
        True,
        "acts",
        ("module hook",),
        "handle.remove()",
        "acts = []\nhandle = model[1].register_forward_hook(lambda module, inputs, output: acts.append(output))\n"
        "for _ in range(20):\n    model(x)",
    ),
    Case(
        "forward_hook_closure",
        True,
        "model",
        ("module hook",),
        "handle.remove()",
        "for _ in range(20):\n    model(x)",
        setup="def keep_outputs():\n    kept = []\n    def save(module, inputs, output):\n        kept.append(output)\n"
        "    return save\nhandle = model[3].register_forward_hook(keep_outputs())",
    ),
    Case(
        "dict_cache",
        True,
        "cache",
        ("autograd graph",),
        "torch.no_grad()",
        "cache = {}\nfor i in range(20):\n    cache[i] = model(x)",
    ),
    Case(
        "dict_held_list",
        True,
        "history['losses']",
        ("autograd graph",),
        "loss.item()",
        # the dict is the same object before and after: only the list inside it grew
        "for _ in range(20):\n    history['losses'].append(model(x).pow(2).mean())",
        setup="history = {'losses': [], 'epoch': 0}",
    ),
    Case(
        "out_cache",
        True,
        "Out[",
        ("output cache",),
        "%reset -f out",
        "torch.cat([model(x).detach() for _ in range(16)])",
    ),
    Case(
        "model_built",
        False,
        "big",
        ("model",),
        "expected",
        "big = nn.Sequential(*[nn.Linear(4 * D, 4 * D) for _ in range(4)]).to(dev)",
    ),
    Case(
        "dataset_to_gpu",
        False,
        "train_set",
        ("data",),
        "expected",
        # copy=True: on the GPU .to() copies anyway; the CPU smoke run needs a copy to have something new
        "train_set = torch.utils.data.TensorDataset(X_cpu.to(dev, copy=True), Y_cpu.to(dev, copy=True))",
        setup="X_cpu = torch.randn(32 * B, D)\nY_cpu = torch.randn(32 * B, D)",
    ),
    Case(
        "adam_first_step",
        False,
        "opt",
        ("optimizer state",),
        "first step",
        "loss = big(torch.randn(B, 4 * D, device=dev)).pow(2).mean()\nloss.backward()\nopt.step()",
        setup="big = nn.Sequential(*[nn.Linear(4 * D, 4 * D) for _ in range(4)]).to(dev)\n"
        "opt = torch.optim.Adam(big.parameters())",
    ),
    Case(
        "predictions_no_grad",
        False,
        "preds",
        ("data",),
        "expected",
        "with torch.no_grad():\n    preds = [model(x) for _ in range(20)]",
    ),
)


# -- CPU stand-ins for the smoke run --------------------------------------------------------------
def _cpu_hardware(shell: Any, probe: Any) -> Any:
    """Fake sources whose "allocated" counts the CPU tensors the process can see: every tensor the
    garbage collector tracks (a cell's value not yet in ``Out``) and what the namespace, IPython's
    references and their autograd graphs reach."""
    from tests.fakes import FakeAllocator, FakeMachine, FakeNvml

    from jupyter_cudamem.attribution.holders import walk_roots
    from jupyter_cudamem.hardware import Hardware
    from jupyter_cudamem.ipython_state import ipython_references
    from jupyter_cudamem.sources.base import AllocatorReading

    class CensusAllocator(FakeAllocator):
        def read(self, index: int) -> AllocatorReading:
            import torch

            storages: dict[Any, int] = {}
            with warnings.catch_warnings():  # isinstance over every object wakes torch's deprecation warnings
                warnings.simplefilter("ignore")
                for obj in gc.get_objects():
                    if isinstance(obj, torch.Tensor):
                        found = probe.device_storage(obj)
                        if found is not None:
                            storages[found[0]] = found[1]
            for root in walk_roots(shell.user_ns, ipython_references(shell), probe):
                for key, hit in root.reach.storages.items():
                    storages[key] = hit.nbytes
            total = sum(storages.values())
            return AllocatorReading(total, total, total, total)

    machine = FakeMachine()
    return Hardware(
        allocator=CensusAllocator(machine), nvml=FakeNvml(machine), pid=machine.pid, pid_exists=lambda pid: True
    )


# -- running a case -------------------------------------------------------------------------------
def _shell(cpu_smoke: bool) -> tuple[Any, Any]:
    from IPython.core.interactiveshell import InteractiveShell

    from jupyter_cudamem import magics

    shell = InteractiveShell.instance()
    probe = None
    hardware = None
    if cpu_smoke:
        from tests.fakes import torch_cpu_probe

        probe = torch_cpu_probe()
        hardware = _cpu_hardware(shell, probe)
    extension = magics.load(shell, hardware)
    cudamem = extension.magics[0]
    cudamem.probe = probe
    if cpu_smoke:  # CPU activations are a 64th of the GPU's (128 KiB): the threshold follows
        shell.run_line_magic("config", "CudaMem.attribute_threshold = '1MiB'")
    return shell, cudamem


def _run(shell: Any, source: str) -> tuple[Any, str]:
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
        result = shell.run_cell(source, store_history=True)
    error = result.error_before_exec or result.error_in_exec
    if error is not None:
        raise RuntimeError(f"{type(error).__name__}: {error}\n{captured.getvalue()[-2000:]}")
    return result.result, captured.getvalue()


def _judge(case: Case, report: Any) -> dict[str, Any]:
    left = report.left
    left_bytes = sum(max(d.allocated_delta_bytes or 0, 0) for d in report.measurement.devices)
    holders = list(left.holders) if left is not None else []
    expected = [h for h in holders if case.matches(h.name)]
    attributed = min(left.attributed_bytes, left.left_bytes) if left is not None else 0
    flagged = bool(left is not None and left.has_leak)
    named_right = bool(expected) and expected[0].cause in case.causes
    advice_right = bool(expected) and any(case.advice in line for line in expected[0].advice)
    if case.leak:
        passed = named_right and advice_right and left_bytes > 0 and attributed >= ATTRIBUTED_GOAL * left_bytes
    else:
        passed = named_right and advice_right and not flagged
    return {
        "case": case.name,
        "leak": case.leak,
        "flagged_leak": flagged,
        "expected_holder": case.expected_holder,
        "named_holders": [
            {"name": h.name, "cause": h.cause, "leak": h.leak, "bytes": h.nbytes, "likely": h.likely} for h in holders
        ],
        "left_bytes": left_bytes,
        "attributed_bytes": attributed,
        "attributed_fraction": round(attributed / left_bytes, 4) if left_bytes else None,
        "attribution_ms": round(left.elapsed_s * 1000, 2) if left is not None else None,
        "expected_cause": list(case.causes),
        "named_cause": expected[0].cause if expected else None,
        "advice": list(expected[0].advice) if expected else [],
        "passed": passed,
    }


def run_case(shell: Any, case: Case, prelude: str, cuda: bool) -> dict[str, Any]:
    _run(shell, "%reset -f")
    gc.collect()
    if cuda:
        import torch

        torch.cuda.empty_cache()
    else:
        # The census (``_cpu_hardware``) looks at every object the collector tracks: some 200,000 to
        # 300,000 of torch's and IPython's, 0.2 s a reading and several readings a cell. Frozen objects
        # are left out of ``gc.get_objects()``, and what survives ``%reset -f`` here is the same before
        # and after the case's cell, so freezing it changes no figure the case is judged on.
        gc.freeze()
    _run(shell, prelude)
    if case.setup:
        _run(shell, case.setup)
    report, text = _run(shell, "%%cudamem -o\n" + case.cell)
    record = _judge(case, report)
    record["report_text"] = report.text()
    return record


def run_cases(selected: list[Case], cpu_smoke: bool, results: dict[str, Any], write: Any) -> None:
    shell, _ = _shell(cpu_smoke)
    prelude = PRELUDE.format(
        dev="cpu" if cpu_smoke else "cuda", batch=128 if cpu_smoke else 2048, width=256 if cpu_smoke else 1024
    )
    for number, case in enumerate(selected, 1):
        started = time.perf_counter()
        try:
            record = run_case(shell, case, prelude, cuda=not cpu_smoke)
        except Exception as error:
            record = {
                "case": case.name,
                "leak": case.leak,
                "passed": False,
                "error": f"{type(error).__name__}: {error}",
                "traceback": traceback.format_exc()[-3000:],
            }
        record["wall_s"] = round(time.perf_counter() - started, 2)
        results["cases"].append(record)
        write()
        shown = ", ".join(
            f"{h['name']} {h['bytes'] / 2**20:.1f} MiB ({h['cause']})" for h in record.get("named_holders", [])[:3]
        )
        say(
            f"[{number}/{len(selected)}] {case.name}: {'PASS' if record['passed'] else 'FAIL'} "
            f"left {record.get('left_bytes', 0) / 2**20:.1f} MiB, attributed {record.get('attributed_fraction')}, "
            f"{record.get('attribution_ms')} ms; {shown or record.get('error', 'nothing named')}"
        )
    _run(shell, "%reset -f")


# -- the cost -------------------------------------------------------------------------------------
def _namespaces(make_tensor: Any) -> dict[str, dict[str, Any]]:
    """10,000 objects two ways: one per name, and ten names holding them all."""

    class Holder:
        def __init__(self, tensor: Any) -> None:
            self.tensor = tensor
            self.step = 0

    def item(index: int) -> Any:
        kind = index % 4
        if kind == 0:
            return make_tensor()
        if kind == 1:
            return [make_tensor(), index]
        if kind == 2:
            return {"value": make_tensor(), "index": index}
        return Holder(make_tensor())

    flat = {f"v{index}": item(index) for index in range(10_000)}
    nested = {f"group{group}": [item(group * 1000 + i) for i in range(1000)] for group in range(10)}
    return {"10000_names": flat, "10_names_holding_10000_objects": nested}


UNHELD_BYTES = 8 * 2**20
"""The cost part's second scenario: the cell also left 8 MiB that no name holds (cuBLAS's workspace, made
by a cell's first matmul, is of this size), so the attribution cannot stop once the new names account
for what was left and walks every unchanged name: the cost of the full walk."""


def run_cost(cpu_smoke: bool, results: dict[str, Any], write: Any) -> None:
    from jupyter_cudamem.attribution.left import left_behind
    from jupyter_cudamem.attribution.snapshot import NamespaceSnapshot

    if cpu_smoke:
        from tests.fakes import FakeTensor, fake_probe

        probe = fake_probe()

        def make_tensor(nbytes: int = 4096) -> Any:
            return FakeTensor(nbytes)
    else:
        import torch

        from jupyter_cudamem.attribution.probe import default_probe

        probe = default_probe()

        def make_tensor(nbytes: int = 4096) -> Any:
            return torch.empty(nbytes // 4, device="cuda")

    cost: dict[str, Any] = {}
    scenarios = [(label, namespace, extra) for label, namespace in _namespaces(make_tensor).items()
                 for extra in (0, UNHELD_BYTES)]
    for base, namespace, unheld in scenarios:
        label = base + ("_full_walk" if unheld else "")
        snapshots, attributions = [], []
        for _ in range(7):
            started = time.perf_counter()
            before = NamespaceSnapshot.take(namespace, (), probe)
            snapshots.append((time.perf_counter() - started) * 1000)
            namespace["leaked"] = [make_tensor(2**20) for _ in range(10)]  # what the "cell" left: 10 MiB
            left = left_behind(namespace, (), before, 10 * 2**20 + unheld, probe)
            attributions.append(left.elapsed_s * 1000)
            del namespace["leaked"]
        cost[label] = {
            "objects": 10_000,
            "snapshot_ms": {"min": round(min(snapshots), 2), "median": round(statistics.median(snapshots), 2)},
            "attribution_ms": {"min": round(min(attributions), 2), "median": round(statistics.median(attributions), 2)},
            "named": [h.name for h in left.holders],
            "attributed_bytes": left.attributed_bytes,
            "under_goal": statistics.median(attributions) < COST_GOAL_MS,
        }
        results["cost"] = cost
        write()
        say(
            f"cost {label}: snapshot median {cost[label]['snapshot_ms']['median']} ms, attribution median "
            f"{cost[label]['attribution_ms']['median']} ms (goal < {COST_GOAL_MS:.0f} ms), named {cost[label]['named']}"
        )


# -- main -----------------------------------------------------------------------------------------
def _environment(cpu_smoke: bool) -> dict[str, Any]:
    import IPython
    import torch

    device = "CPU (smoke run: no GPU figures)"
    if not cpu_smoke and torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    return {
        "device": device,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "ipython": IPython.__version__,
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("all", "cases", "cost"), default="all")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--cpu-smoke", action="store_true", help="run on CPU tensors to check the plumbing")
    parser.add_argument("--out", default=None, help="where to write the JSON (default: benchmarks/results/)")
    args = parser.parse_args(argv)

    if not args.cpu_smoke:
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA device: run on the GPU machine, or pass --cpu-smoke")
    names = [name for name in args.cases.split(",") if name]
    unknown = [name for name in names if name not in {case.name for case in CASES}]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {', '.join(case.name for case in CASES)}")
    selected = [case for case in CASES if not names or case.name in names]
    default = Path(tempfile.gettempdir()) / "leaks-cpu-smoke.json" if args.cpu_smoke else RESULTS / "leaks.json"
    out = Path(args.out) if args.out else default
    results: dict[str, Any] = {**_environment(args.cpu_smoke), "goals": {}, "cases": [], "cost": {}}

    def write() -> None:
        leaks = [c for c in results["cases"] if c.get("leak")]
        others = [c for c in results["cases"] if not c.get("leak")]
        results["goals"] = {
            "every_leak_named_with_90_percent_attributed": bool(leaks) and all(c.get("passed") for c in leaks),
            "no_result_called_a_leak": all(not c.get("flagged_leak", True) for c in others),
            "attribution_under_50_ms_on_10000_objects": bool(results["cost"])
            and all(c["under_goal"] for c in results["cost"].values()),
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))

    started = time.perf_counter()
    say(f"leaks benchmark on {results['device']}: part {args.part}, {len(selected)} case(s) -> {out}")
    if args.part in ("all", "cost"):
        try:
            run_cost(args.cpu_smoke, results, write)
        except Exception:
            results["cost_error"] = traceback.format_exc()[-3000:]
            write()
            say("cost part failed:\n" + results["cost_error"])
    if args.part in ("all", "cases"):
        run_cases(selected, args.cpu_smoke, results, write)
    write()
    say(f"done in {time.perf_counter() - started:.1f} s; goals: {json.dumps(results['goals'])}")
    return 0 if all(c.get("passed") for c in results["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
