"""Where the peak goes, checked against numel x element size, and what ``--breakdown`` costs.

Runs on the GPU machine: ``python3 benchmarks/breakdown.py`` (about a minute on the H100 machine).
Each workload is a setup (not measured: the data and, except where the cell builds its models, the
model and optimizer) and a cell run through ``%%cudamem -o -q`` in an in-process InteractiveShell, once
without and once with ``--breakdown``, each after a fresh setup, in ``ROUNDS`` interleaved rounds after
one warm-up run. ``seconds_off``/``seconds_on`` are the medians of the cell's wall time; the categories
are those of the last run with ``--breakdown``.

``expected`` is computed here from the objects after the cell, independently of the tracker: numel x
element size of the parameters and buffers, of their ``.grad`` and of the optimizer's state tensors on
the GPU. The training cells call ``zero_grad(set_to_none=False)`` so that every gradient exists from the
first backward on: the gradients at the peak are then all of them, which the end state can check.

Beside ours, PyTorch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``) runs each cell as it is and
one iteration of it (``memtracker`` in each case), with ours on that same iteration: where it stops a
cell, the error; where it runs, its categories at its own peak.

Writes benchmarks/results/breakdown.json; ``--cpu-smoke`` runs the workloads small on the CPU (a tracker
of CPU tensors, no allocator peak: its peaks, "other" and timings are not figures for the README; its
categories, numel x element size and the MemTracker comparison are real). ``--cpu-smoke --out
benchmarks/results/breakdown_cpu.json`` is how the committed CPU file was made.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROUNDS = 3
CATEGORY_NAMES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "other")

TRANSFORMER = """
import torch
try:
    import transformers
    config = transformers.BertConfig(vocab_size=8000, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                                     intermediate_size=2048, max_position_embeddings=512, num_labels=4)
    model = transformers.BertForSequenceClassification(config).to(DEVICE)
    model_kind = "transformers BertForSequenceClassification from BertConfig(hidden 512, 6 layers, 8 heads)"
    def forward(tokens):
        return model(input_ids=tokens).logits
except ImportError:
    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(8000, 512)
            layer = torch.nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True)
            self.encoder = torch.nn.TransformerEncoder(layer, 6, enable_nested_tensor=False)
            self.head = torch.nn.Linear(512, 4)
        def forward(self, tokens):
            return self.head(self.encoder(self.embedding(tokens)).mean(dim=1))
    model = Classifier().to(DEVICE)
    model_kind = "torch.nn.TransformerEncoder (d_model 512, 6 layers, 8 heads)"
    forward = model
tokens = torch.randint(0, 8000, (BATCH, 256), device=DEVICE)
labels = torch.randint(0, 4, (BATCH,), device=DEVICE)
"""

CONVNET = """
import torch
def block(inputs, outputs):
    return torch.nn.Sequential(torch.nn.Conv2d(inputs, outputs, 3, padding=1, bias=False),
                               torch.nn.BatchNorm2d(outputs), torch.nn.ReLU(inplace=True))
model = torch.nn.Sequential(block(3, 64), block(64, 128), torch.nn.MaxPool2d(2), block(128, 256), block(256, 256),
                            torch.nn.MaxPool2d(2), block(256, 512), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                            torch.nn.Linear(512, 100)).to(DEVICE)
model_kind = "a VGG-like convnet: 5 conv-BN-ReLU blocks (64 to 512 channels), 64x64 images"
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
images = torch.randn(BATCH, 3, 64, 64, device=DEVICE)
labels = torch.randint(0, 100, (BATCH,), device=DEVICE)
"""

WORKLOADS = {
    "transformer_finetune_adamw": {
        "setup": TRANSFORMER + "optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)\n",
        "batch": 32,
        "cell": (
            "for step in range(3):\n"
            "    optimizer.zero_grad(set_to_none=False)\n"
            "    loss = torch.nn.functional.cross_entropy(forward(tokens), labels)\n"
            "    loss.backward()\n"
            "    optimizer.step()\n"
        ),
    },
    "convnet_sgd_momentum": {
        "setup": CONVNET,
        "batch": 128,
        "cell": (
            "for step in range(3):\n"
            "    optimizer.zero_grad(set_to_none=False)\n"
            "    loss = torch.nn.functional.cross_entropy(model(images), labels)\n"
            "    loss.backward()\n"
            "    optimizer.step()\n"
        ),
    },
    "transformer_inference_no_grad": {
        "setup": TRANSFORMER + "model.eval()\n",
        "batch": 128,
        "cell": "with torch.no_grad():\n    predictions = forward(tokens).argmax(dim=-1)\n",
    },
    "two_models_built_in_cell": {
        "setup": "import torch\nfeatures = torch.randn(BATCH, 1024, device=DEVICE)\n",
        "batch": 256,
        "cell": (
            "model_kind = 'two MLPs built in the cell (1024-4096-4096-1024 and 1024-2048-10), Adam each'\n"
            "encoder = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 4096),\n"
            "                              torch.nn.GELU(), torch.nn.Linear(4096, 1024)).to(DEVICE)\n"
            "classifier = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(),\n"
            "                                 torch.nn.Linear(2048, 10)).to(DEVICE)\n"
            "optimizer = torch.optim.Adam(list(encoder.parameters()) + list(classifier.parameters()))\n"
            "for step in range(2):\n"
            "    optimizer.zero_grad(set_to_none=False)\n"
            "    classifier(encoder(features)).square().mean().backward()\n"
            "    optimizer.step()\n"
        ),
    },
}


def expected_bytes(namespace: dict, device_type: str) -> dict[str, int]:
    """numel x element size of the models' parameters and buffers, their gradients, the optimizers' state."""
    import torch

    def size(tensor) -> int:
        if isinstance(tensor, torch.Tensor) and tensor.device.type == device_type:
            return tensor.numel() * tensor.element_size()
        return 0

    models = [v for k, v in namespace.items() if isinstance(v, torch.nn.Module) and not k.startswith("_")]
    optimizers = [v for k, v in namespace.items() if isinstance(v, torch.optim.Optimizer) and not k.startswith("_")]
    parameters = {id(p): p for m in models for p in m.parameters()}
    buffers = {id(b): b for m in models for b in m.buffers()}
    return {
        "parameters": sum(size(p) for p in parameters.values()) + sum(size(b) for b in buffers.values()),
        "gradients": sum(size(p.grad) for p in parameters.values()),
        "optimizer_state": sum(
            size(value) for o in optimizers for state in o.state.values() for value in state.values()
        ),
    }


def clear(shell, names: list[str]) -> None:
    import gc

    import torch

    for name in names:
        shell.user_ns.pop(name, None)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_workload(shell, name: str, spec: dict, device: str, rounds: int, batch_scale: float, prefix: str = "") -> dict:
    batch = max(int(spec["batch"] * batch_scale), 2)
    setup = spec["setup"].replace("DEVICE", repr(device)).replace("BATCH", str(batch))
    cell = prefix + spec["cell"].replace("DEVICE", repr(device))
    before = set(shell.user_ns)

    def fresh() -> None:
        clear(shell, [k for k in shell.user_ns if k not in before])
        with contextlib.redirect_stdout(io.StringIO()):
            result = shell.run_cell(setup)
        if not result.success:
            raise RuntimeError(f"{name}: setup failed: {result.error_in_exec!r}")

    def timed(options: str):
        fresh()
        with contextlib.redirect_stdout(io.StringIO()):  # -o's value is displayed as the cell's Out
            started = time.perf_counter()
            result = shell.run_cell(f"%%cudamem -o -q {options}\n{cell}")
            seconds = time.perf_counter() - started
        if not result.success:
            raise RuntimeError(f"{name}: cell failed: {result.error_in_exec!r}")
        return seconds, result.result

    timed("")  # warm-up: kernels, cuBLAS's workspace
    off, on, report = [], [], None
    for _ in range(rounds):
        seconds, _report = timed("")
        off.append(seconds)
        seconds, report = timed("--breakdown")
        on.append(seconds)
    assert report is not None
    breakdown = report.breakdown
    expected = expected_bytes(shell.user_ns, device.split(":")[0])
    categories = {c.value: size for c, size in breakdown.categories.items()} if breakdown else {}
    record = {
        "workload": name,
        "model": shell.user_ns.get("model_kind"),
        "batch": batch,
        "peak_bytes": breakdown.peak_bytes if breakdown else None,
        "phase": breakdown.phase.value if breakdown else None,
        "categories": categories,
        "modules": breakdown.modules if breakdown else {},
        "tracked_bytes": breakdown.tracked_bytes if breakdown else None,
        "expected": expected,
        "relative_error": {
            key: (categories[key] - value) / value if value else (0.0 if categories.get(key) == 0 else None)
            for key, value in expected.items()
        } if breakdown else {},
        "seconds_off": statistics.median(off),
        "seconds_on": statistics.median(on),
        "seconds_off_runs": off,
        "seconds_on_runs": on,
    }
    record["memtracker"] = memtracker_runs(shell, cell, fresh, device.split(":")[0])
    clear(shell, [k for k in shell.user_ns if k not in before])
    return record


MEMTRACKER_NAMES = {"Parameter": "parameters", "Buffer": "parameters", "Gradient": "gradients",
                    "Optstate": "optimizer_state", "Activation": "activations", "Temp": "temporaries",
                    "Other": "other"}


def single_step(cell: str) -> str:
    """The cell with its loop cut to one iteration (``range(3)`` becomes ``range(1)``)."""
    import re

    return re.sub(r"range\(\d+\)", "range(1)", cell)


def under_memtracker(shell, cell: str, device_type: str) -> dict:
    """Run ``cell`` under PyTorch's MemTracker (the namespace's models and optimizers passed to
    ``track_external`` first, as its documentation asks); its categories at its peak on ``device_type``, or
    the error that stopped it."""
    import torch

    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except Exception as error:  # noqa: BLE001  not in this torch, or no torch.distributed
        return {"error": f"{type(error).__name__}: {error}"}
    on_gpu = device_type == "cuda"
    tracker = MemTracker()
    external = [v for k, v in shell.user_ns.items() if not k.startswith("_")
                and isinstance(v, (torch.nn.Module, torch.optim.Optimizer))]
    tracker.track_external(*external)
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    try:
        with tracker:
            exec(compile(cell, "<memtracker cell>", "exec"), shell.user_ns)
        if on_gpu:
            torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001  what stops it is the finding
        return {"error": f"{type(error).__name__}: {str(error)[:200]}"}
    seconds = time.perf_counter() - started
    snapshot = tracker.get_tracker_snapshot("peak")
    found = next((value for key, value in snapshot.items() if str(key).startswith(device_type)), {})
    categories = dict.fromkeys(CATEGORY_NAMES, 0)
    for kind, size in found.items():
        name = MEMTRACKER_NAMES.get(getattr(kind, "value", str(kind)))
        if name is not None:
            categories[name] += int(size)
    return {"categories_at_its_peak": categories, "tracked_total": int(found.get("Total", 0)),
            "allocator_peak_bytes": torch.cuda.max_memory_allocated() if on_gpu else None, "seconds": seconds}


def memtracker_runs(shell, cell: str, fresh, device_type: str) -> dict:
    """MemTracker on the cell as it is, and on one iteration of it beside ours on the same iteration."""
    fresh()
    as_is = under_memtracker(shell, cell, device_type)
    one = single_step(cell)
    fresh()
    theirs = under_memtracker(shell, one, device_type)
    fresh()
    with contextlib.redirect_stdout(io.StringIO()):
        result = shell.run_cell(f"%%cudamem -o -q --breakdown\n{one}")
    ours: dict = {}
    breakdown = result.result.breakdown if result.success and result.result is not None else None
    if breakdown is not None:
        ours = {"categories": {c.value: size for c, size in breakdown.categories.items()},
                "peak_bytes": breakdown.peak_bytes, "phase": breakdown.phase.value}
    return {"cell_as_is": as_is, "one_iteration": theirs, "ours_one_iteration": ours}


def versions() -> dict:
    import IPython
    import torch

    found = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
             "ipython": IPython.__version__}
    try:
        import transformers

        found["transformers"] = transformers.__version__
    except ImportError:
        found["transformers"] = None
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="where to write (default: benchmarks/results/breakdown.json)")
    parser.add_argument("--cpu-smoke", action="store_true", help="small workloads on the CPU: a smoke run")
    args = parser.parse_args(argv)
    import torch
    from IPython.testing.globalipapp import start_ipython

    if not torch.cuda.is_available() and not args.cpu_smoke:
        parser.error("no CUDA device: run on the GPU machine, or pass --cpu-smoke")
    default = Path(__file__).parent / "results" / "breakdown.json"
    if args.cpu_smoke:
        default = Path(tempfile.gettempdir()) / "breakdown-smoke.json"
    out = Path(args.out) if args.out else default
    shell = start_ipython()
    shell.run_line_magic("load_ext", "jupyter_cudamem")
    device = "cpu" if args.cpu_smoke else "cuda"
    if args.cpu_smoke:  # no allocator to measure: a tracker of CPU tensors over fake hardware
        sys.path.insert(0, str(Path(__file__).parents[1]))
        from tests.fakes import FakeAllocator, FakeMachine, FakeNvml

        from jupyter_cudamem import magics
        from jupyter_cudamem.hardware import Hardware
        from jupyter_cudamem.sources.torch_breakdown import PeakTracker

        machine = FakeMachine()
        magics.unload(shell)
        magics.load(shell, Hardware(allocator=FakeAllocator(machine), nvml=FakeNvml(machine), pid=machine.pid,
                                    pid_exists=lambda pid: True))
        magics.loaded(shell).magics[0].breakdown_tracker = lambda namespace: PeakTracker(namespace, "cpu")
        shell.user_ns["_machine"] = machine
    else:
        torch.empty(1, device="cuda")
    cases = []
    for name, spec in WORKLOADS.items():
        if args.cpu_smoke:  # a fake peak of 4 GiB for the breakdown to fill
            smoke = "_machine.allocate(0, 4 * 1024**3); _machine.free(0, 4 * 1024**3)\n"
            cases.append(run_workload(shell, name, spec, device, 1, 0.125, smoke))
        else:
            cases.append(run_workload(shell, name, spec, device, ROUNDS, 1.0))
        print(json.dumps({k: cases[-1][k] for k in ("workload", "peak_bytes", "phase", "categories", "expected",
                                                     "seconds_off", "seconds_on")}), flush=True)
    results = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (smoke)",
        "versions": versions(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "rounds": ROUNDS,
        "method": "our tracker (sources/torch_breakdown.py): a TorchDispatchMode over every operation, module "
                  "forward hooks, optimizer step hooks, post-accumulate-grad hooks; the allocator's peak from "
                  "%%cudamem",
        "memtracker": "torch.distributed._tools.mem_tracker.MemTracker on each cell as it is (models and optimizers "
                      "passed to track_external first), and on one iteration of it beside ours on that iteration; "
                      "its categories at its own peak, buffers counted as parameters",
        "cases": cases,
    }
    if args.cpu_smoke:
        results["note"] = ("CPU smoke run: no allocator to measure, so each cell's peak is a fake 4 GiB and 'other' "
                           "and the timings mean nothing; the tracker's other categories, numel x element size and "
                           "MemTracker beside ours are real (CPU tensors, batches an eighth of the GPU run's)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
