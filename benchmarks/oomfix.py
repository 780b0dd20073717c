"""Benchmark: how close to the largest fitting batch, in how many reruns, %oomfix's search vs its peers.

The workloads and budget of the linearity measurement (jupyter_cudamem/oomfix/search.py): a small CNN on 64x64 images and a 4-layer transformer
encoder (d=256, seq 128), one full Adam step each, PyTorch capped at 6 GiB with
``set_per_process_memory_fraction``, starting at 8x the largest batch that fits. The largest fitting
batch is found first by exponential then binary search with real steps. Then, side by side in this
one process:

- ours: ``jupyter_cudamem.oomfix.driver.Driver`` on the cell ``batch_size = N; step(batch_size)``
  after it failed at N (exactly what ``%oomfix`` runs, with real measurement through ``Meter``);
- accelerate's ``find_executable_batch_size`` (multiplies by 0.9 after each OOM);
- Lightning's ``Tuner.scale_batch_size(mode="binsearch")`` from the same start.

"reruns" counts tries after the first failure at the start (ours never reruns the start; the peers'
first try is that failure). Writes benchmarks/results/oomfix.json. Run on the GPU machine:
``python benchmarks/oomfix.py``.
"""

from __future__ import annotations

import datetime
import inspect
import gc
import json
import platform
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402

CAP_BYTES = 6 * 2**30
START_MULTIPLE = 8
RESULTS = REPO / "benchmarks" / "results" / "oomfix.json"


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# -- workloads ----------------------------------------------------------------------------------
def make_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(128 * 16 * 16, 10),
    )


def make_transformer() -> nn.Module:
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=8, dim_feedforward=1024, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)


def cnn_loss(model: nn.Module, batch: int) -> torch.Tensor:
    x = torch.randn(batch, 3, 64, 64, device="cuda")
    y = torch.randint(0, 10, (batch,), device="cuda")
    return nn.functional.cross_entropy(model(x), y)


def transformer_loss(model: nn.Module, batch: int) -> torch.Tensor:
    x = torch.randn(batch, 128, 256, device="cuda")
    return model(x).pow(2).mean()


WORKLOADS = {
    "cnn": (make_cnn, cnn_loss),
    "transformer": (make_transformer, transformer_loss),
}


class Step:
    """One full Adam step at a given batch, on a model and optimizer that persist (as in a notebook)."""

    def __init__(self, name: str):
        make, self.loss_fn = WORKLOADS[name]
        self.model = make().cuda()
        self.optimizer = torch.optim.Adam(self.model.parameters())
        self.calls: list[tuple[int, bool]] = []

    def __call__(self, batch: int) -> None:
        fitted = False
        try:
            loss = self.loss_fn(self.model, batch)
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            fitted = True
        finally:
            self.calls.append((batch, fitted))
            self.optimizer.zero_grad(set_to_none=True)

    def fits(self, batch: int) -> bool:
        try:
            self(batch)
            return True
        except RuntimeError as error:
            if not is_oom(error):
                raise
            return False
        finally:
            release()


def largest_fitting(step: Step) -> tuple[int, int]:
    """Exponential then binary search with real steps: (largest batch that fits, steps taken)."""
    low, high = 0, 1
    while step.fits(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        if step.fits(middle):
            low = middle
        else:
            high = middle
    return low, len(step.calls)


# -- finders ------------------------------------------------------------------------------------
def run_ours(name: str, start: int) -> dict:
    from jupyter_cudamem.hardware import default_hardware
    from jupyter_cudamem.oomfix.driver import Driver

    step = Step(name)
    namespace = {"step": step}

    def run_source(source: str) -> BaseException | None:
        try:
            exec(compile(source, "<cell>", "exec"), namespace)
        except Exception as error:  # the cell's failure is the try's result
            traceback.clear_frames(error.__traceback__)
            return error
        return None

    source = f"batch_size = {start}\nstep(batch_size)\n"
    release()
    allocated_before = torch.cuda.memory_allocated()
    error = run_source(source)
    assert error is not None and is_oom(error), f"the start batch {start} fitted: {error!r}"
    release()
    started = time.perf_counter()
    driver = Driver(run_source, default_hardware(), lambda failed: release(), max_tries=3)
    outcome = driver.fix(source, error, namespace, freed_bytes=0, allocated_before=allocated_before)
    wall_s = time.perf_counter() - started
    del error
    return {
        "tries": [[t.batch, t.fitted, t.peak_bytes, t.reason] for t in outcome.tries],
        "reruns": outcome.reruns,
        "found": outcome.batch_after,
        "wall_s": wall_s,
        "notes": list(outcome.notes),
    }


def run_accelerate(name: str, start: int) -> dict:
    try:
        import accelerate
        from accelerate.utils import find_executable_batch_size
    except ImportError:
        return {"status": "not installed"}
    step = Step(name)
    release()
    started = time.perf_counter()

    @find_executable_batch_size(starting_batch_size=start)
    def inner(batch_size: int) -> int:
        step(batch_size)
        return batch_size

    found = inner()
    wall_s = time.perf_counter() - started
    return {
        "version": accelerate.__version__,
        "tries": [list(call) for call in step.calls],
        "reruns": len(step.calls) - 1,
        "found": found,
        "wall_s": wall_s,
    }


def run_lightning(name: str, start: int) -> dict:
    try:
        import pytorch_lightning as pl
        from pytorch_lightning.tuner import Tuner
    except ImportError:
        try:
            import lightning.pytorch as pl
            from lightning.pytorch.tuner import Tuner
        except ImportError:
            return {"status": "not installed"}
    step_calls: list[tuple[int, None]] = []
    make, loss_fn = WORKLOADS[name]

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size = start
            self.net = make()

        def train_dataloader(self):  # noqa: ANN201
            # Indices only: each step makes its batch on the GPU, as the other finders' steps do.
            return torch.utils.data.DataLoader(range(64 * start), batch_size=self.batch_size)

        def training_step(self, indices, batch_index):  # noqa: ANN001, ANN201
            # Whether the step fitted is decided after this returns (backward, optimizer): not recorded.
            step_calls.append((len(indices), None))
            return loss_fn(self.net, len(indices))

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.Adam(self.parameters())

    release()
    started = time.perf_counter()
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    options = {"mode": "binsearch", "init_val": start, "steps_per_trial": 1, "max_trials": 40}
    if "max_val" in inspect.signature(Tuner.scale_batch_size).parameters:
        # Lightning stops at max_val (8192 by default) before any trial; our starts can exceed it.
        options["max_val"] = 2 * start
    found = Tuner(trainer).scale_batch_size(Module(), **options)
    wall_s = time.perf_counter() - started
    return {
        "version": pl.__version__,
        "tries": [list(call) for call in step_calls],
        "reruns": len(step_calls) - 1,
        "found": found,
        "wall_s": wall_s,
    }


def environment() -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cap_bytes": CAP_BYTES,
        "start_multiple": START_MULTIPLE,
    }
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        info["driver"] = driver.decode() if isinstance(driver, bytes) else driver
    except Exception as error:  # a benchmark still runs without NVML
        info["driver"] = f"unknown ({error})"
    return info


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/oomfix.py needs a CUDA device")
    torch.cuda.init()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(CAP_BYTES / total, 0)
    results = {"environment": environment(), "workloads": {}}
    for name in WORKLOADS:
        step = Step(name)
        true_max, probes = largest_fitting(step)
        del step
        release()
        start = START_MULTIPLE * true_max
        entry = {"largest_fitting_batch": true_max, "steps_to_find_it": probes, "start_batch": start, "finders": {}}
        for finder, run in (("oomfix", run_ours), ("accelerate", run_accelerate), ("lightning_binsearch", run_lightning)):
            try:
                outcome = run(name, start)
            except Exception as error:  # record a peer's failure; the others still run
                outcome = {"status": "error", "error": f"{type(error).__name__}: {error}"[:500]}
            release()
            if outcome.get("found"):
                outcome["found_fraction_of_max"] = round(outcome["found"] / true_max, 4)
            entry["finders"][finder] = outcome
            print(f"{name:12s} {finder:20s} reruns={outcome.get('reruns')} found={outcome.get('found')} "
                  f"of {true_max} ({outcome.get('found_fraction_of_max')}) {outcome.get('status', '')}", flush=True)
        ours = entry["finders"]["oomfix"]
        peers = [f for key, f in entry["finders"].items() if key != "oomfix" and "reruns" in f]
        entry["goal"] = {
            "at_least_90_percent": (ours.get("found_fraction_of_max") or 0) >= 0.9,
            "at_most_3_reruns": ours.get("reruns", 99) <= 3,
            "fewer_reruns_than_each_peer": all(ours.get("reruns", 99) < f["reruns"] for f in peers),
        }
        results["workloads"][name] = entry
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
