"""Benchmark: does the capacity plan (``%%cudamem_plan``) predict the largest batch a card fits?

Four workloads of different kinds, each a model and optimizer that persist as in a notebook, and a
cell ``step(batch)``:

- ``convnet``: a convolutional network (BatchNorm, pooling) training on 128x128 images, SGD with momentum;
- ``transformer``: a GPT-2 built from its config (``transformers.GPT2Config``, random weights, no
  download) training on random tokens with AdamW; where transformers is not installed, the same
  shape built from PyTorch's ``nn.TransformerEncoderLayer`` from a config dict (the JSON says which);
- ``inference``: a wider convnet on 224x224 images under ``torch.inference_mode`` (no optimizer);
- ``rnn``: a two-layer LSTM language model (cuDNN's LSTM) training with Adam.

For each workload the plan is made exactly as the magic makes it: ``capacity.runs`` runs the cell
at its batch, at half of it and at its batch again through the project's ``Meter`` (PyTorch's peak,
NVML for what the process holds outside PyTorch), recording the allocator's history of each run, and
probes whether the cell does without its workspaces; ``judge`` fits the line, ``build_plan`` predicts
each card by the allocator's replay of the two recorded runs. Cards of 16, 24 and 40 GiB are then played on this GPU the way a real card limits a
process: PyTorch is capped (``set_per_process_memory_fraction``) at the card's memory less what this
process holds outside PyTorch (the CUDA context, library workspaces, measured here), and the real
largest batch is found by real steps (from the prediction, up or down by 25% until the answer flips,
then bisection). The emulated card's total is its nominal GiB; a real card's driver keeps a little
more, which the plan's margin covers.

Beside it, the rule of thumb a careful user applies by hand: weights, gradients and optimizer state
from bytes per parameter (16 for Adam/AdamW, 12 for SGD with momentum, 4 for inference), the rest of
the peak measured at the batch as written taken as activations per sample, scaled to the card's
nominal memory (no context, no margin).

The same runs also make the plan ``--calibrate`` makes (its calibration runs find the largest batch that
fits on the smallest card, 16 GiB, played by the same cap, before the plan's last run), and each case
records that plan's batch beside the default one (``calibrated_batch``, ``calibrated_error``; the
workload's ``calibration``). At 16 GiB that is the search the benchmark itself makes, less the margin; at
24 and 40 GiB it is the test of the ratio carried to a larger card.

Goal: every prediction within 5% of the real largest batch and never above it by more than the
margin. Writes ``benchmarks/results/plan.json`` ({device, versions, date, cases: [{workload,
card_gib, predicted_batch, real_batch, rule_of_thumb_batch, ...}]}). Run on the GPU machine:

    python benchmarks/plan.py                        # all four workloads, about 3-5 minutes on an H100
    python benchmarks/plan.py --part convnet,rnn     # some of them; cases of the others are kept
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import platform
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks import bisect_batch  # noqa: E402
from jupyter_cudamem.capacity.cards import Card  # noqa: E402
from jupyter_cudamem.capacity.plan import (  # noqa: E402
    CALIBRATED_MARGIN,
    DEFAULT_MARGIN,
    build_plan,
    largest_batch,
    usable_bytes,
)
from jupyter_cudamem.capacity.runs import CalibrationScale, Runner, judge, measure_runs  # noqa: E402
from jupyter_cudamem.hardware import default_hardware  # noqa: E402
from jupyter_cudamem.measure import Meter  # noqa: E402
from jupyter_cudamem.reruns.recording import Recorder  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "plan.json"
CARDS_GIB = (16, 24, 40)
GiB = 2**30


def is_oom(error: BaseException) -> bool:
    """PyTorch's OOM, or a library's allocation failing under the cap (cuDNN's RNN, cuBLAS)."""
    text = str(error)
    return (isinstance(error, torch.OutOfMemoryError) or "out of memory" in text.lower()
            or "CUDNN_STATUS_ALLOC_FAILED" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text)


def release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# -- workloads ----------------------------------------------------------------------------------
class Workload:
    """A model (and optimizer) that persist, and ``step(batch)``: one training step or one forward."""

    name = ""
    batch = 0  # the batch as written in the cell
    bytes_per_parameter = 16  # the rule of thumb's weights + gradients + optimizer state
    notes = ""

    def __init__(self) -> None:
        self.model = self.build().cuda()
        self.optimizer = self.make_optimizer()

    def build(self) -> nn.Module:
        raise NotImplementedError

    def make_optimizer(self) -> torch.optim.Optimizer | None:
        return torch.optim.Adam(self.model.parameters())

    def loss(self, batch: int) -> torch.Tensor:
        raise NotImplementedError

    def step(self, batch: int) -> None:
        assert self.optimizer is not None
        try:
            self.loss(batch).backward()
            self.optimizer.step()
        finally:
            self.optimizer.zero_grad(set_to_none=True)

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def conv_block(cin: int, cout: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


class ConvNet(Workload):
    name = "convnet"
    batch = 128
    bytes_per_parameter = 12  # SGD with momentum: weights, gradients, momentum
    notes = "6 conv layers with BatchNorm on 3x128x128, SGD momentum 0.9"

    def build(self) -> nn.Module:
        return nn.Sequential(
            *conv_block(3, 64), *conv_block(64, 64), nn.MaxPool2d(2),
            *conv_block(64, 128), *conv_block(128, 128), nn.MaxPool2d(2),
            *conv_block(128, 256), *conv_block(256, 256), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 100),
        )

    def make_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

    def loss(self, batch: int) -> torch.Tensor:
        x = torch.randn(batch, 3, 128, 128, device="cuda")
        y = torch.randint(0, 100, (batch,), device="cuda")
        return nn.functional.cross_entropy(self.model(x), y)


class _EncoderLM(nn.Module):
    """A GPT-shaped language model from a config dict, for machines without transformers."""

    def __init__(self, config: dict[str, int]):
        super().__init__()
        d = config["n_embd"]
        self.tokens = nn.Embedding(config["vocab_size"], d)
        self.positions = nn.Embedding(config["n_positions"], d)
        layer = nn.TransformerEncoderLayer(d, config["n_head"], 4 * d, dropout=0.1, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, config["n_layer"], enable_nested_tensor=False)
        self.head = nn.Linear(d, config["vocab_size"], bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        seq = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=ids.device)
        h = self.tokens(ids) + self.positions(torch.arange(seq, device=ids.device))
        return self.head(self.blocks(h, mask=mask, is_causal=True))


class Transformer(Workload):
    name = "transformer"
    batch = 32
    bytes_per_parameter = 16  # AdamW: weights, gradients, two moments
    config = {"vocab_size": 8192, "n_positions": 256, "n_embd": 512, "n_layer": 6, "n_head": 8}
    seq = 256

    def build(self) -> nn.Module:
        try:
            from transformers import GPT2Config, GPT2LMHeadModel

            self.notes = f"transformers GPT2LMHeadModel from GPT2Config({self.config}), seq {self.seq}, AdamW"
            self.hf = True
            return GPT2LMHeadModel(GPT2Config(**self.config))
        except ImportError:
            self.notes = f"nn.TransformerEncoder LM from config {self.config} (no transformers here), seq {self.seq}, AdamW"
            self.hf = False
            return _EncoderLM(self.config)

    def make_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def loss(self, batch: int) -> torch.Tensor:
        ids = torch.randint(0, self.config["vocab_size"], (batch, self.seq), device="cuda")
        if self.hf:
            return self.model(input_ids=ids, labels=ids).loss
        logits = self.model(ids)
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


class Inference(Workload):
    name = "inference"
    batch = 128
    bytes_per_parameter = 4  # weights only
    notes = "8 conv layers with BatchNorm on 3x224x224 under torch.inference_mode, eval mode"

    def build(self) -> nn.Module:
        return nn.Sequential(
            *conv_block(3, 96), *conv_block(96, 96), nn.MaxPool2d(2),
            *conv_block(96, 192), *conv_block(192, 192), nn.MaxPool2d(2),
            *conv_block(192, 384), *conv_block(384, 384), nn.MaxPool2d(2),
            *conv_block(384, 768), *conv_block(768, 768), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(768, 1000),
        ).eval()

    def make_optimizer(self) -> None:
        return None

    def step(self, batch: int) -> None:
        with torch.inference_mode():
            x = torch.randn(batch, 3, 224, 224, device="cuda")
            self.model(x).argmax(dim=1)


class _LSTMLM(nn.Module):
    def __init__(self, vocab: int = 10000, embed: int = 512, hidden: int = 1024):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=2, batch_first=True, dropout=0.1)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(ids))
        return self.head(out)


class RNN(Workload):
    name = "rnn"
    batch = 64
    bytes_per_parameter = 16  # Adam
    notes = "2-layer LSTM LM (embed 512, hidden 1024, vocab 10000), seq 128, Adam"
    seq = 128

    def build(self) -> nn.Module:
        return _LSTMLM()

    def loss(self, batch: int) -> torch.Tensor:
        ids = torch.randint(0, 10000, (batch, self.seq + 1), device="cuda")
        logits = self.model(ids[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


WORKLOADS: dict[str, type[Workload]] = {w.name: w for w in (ConvNet, Transformer, Inference, RNN)}


# -- the plan, as the magic makes it -------------------------------------------------------------
class NamespaceBatch:
    """``capacity.runs.Change`` over a namespace: the cell ``step(batch)`` reads ``batch`` from it."""

    def __init__(self, namespace: dict[str, Any], batch: int):
        self.namespace, self.original = namespace, batch

    def apply(self, batch: int) -> str:
        self.namespace["batch"] = batch
        return "step(batch)"

    def restore(self) -> None:
        self.namespace["batch"] = self.original


def smallest_card(cards: list[Card], measured: Any) -> CalibrationScale | None:
    """Where the magic's --calibrate searches: the smallest card of the plan, played by capping PyTorch on
    this GPU at what that card leaves it (the cap put back after each run)."""
    total = measured.total_bytes
    if total is None or not cards:
        return None
    card = min(cards, key=lambda c: c.total_bytes)
    usable = usable_bytes(card.total_bytes, measured.non_pytorch_bytes)

    @contextlib.contextmanager
    def capped() -> Iterator[None]:
        torch.cuda.set_per_process_memory_fraction(usable / total, 0)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, 0)

    return CalibrationScale(usable, card.name, capped)


def make_plan(workload: Workload, cards: list[Card], margin: float, calibrate: bool = False) -> Any:
    """The plan as ``%%cudamem_plan`` makes it; with ``calibrate`` as ``--calibrate`` makes it too, from the
    same runs (the calibration's runs come before the last run, which the default plan reads)."""
    namespace: dict[str, Any] = {"step": workload.step, "batch": workload.batch}
    hardware = default_hardware()

    def run(source: str) -> None:
        exec(source, namespace)

    runner = Runner(Meter(hardware, reset_peak=True), run, is_oom, release=release, recorder=Recorder(hardware.allocator))

    measured = measure_runs(runner, "step(batch)", workload.batch, NamespaceBatch(namespace, workload.batch),
                            calibrate_at=(lambda: smallest_card(cards, runner.measured)) if calibrate else None,
                            cap_at=lambda usable: hardware.capped(usable, runner.measured.devices(), unread_fraction=None))
    judged = judge(measured, workload.batch)

    def plan_with(calibration: Any) -> Any:
        return build_plan(measured.runs, workload.batch, "batch", cards,
                          margin if calibration is None else CALIBRATED_MARGIN, measured.non_pytorch_bytes,
                          measured.non_pytorch_how or "not measured", line=judged.line, notes=judged.notes,
                          reserved_line=judged.reserved_line, calibration=calibration,
                          replay_runs=judged.replay_runs, workspaces_optional=judged.workspaces_optional)

    found = measured.calibration
    calibrated = None
    if found is not None and judged.line is not None:
        calibrated = plan_with(found)
    return plan_with(None), measured, calibrated


# -- the real largest batch under a cap ------------------------------------------------------------
def fits(workload: Workload, batch: int) -> bool:
    try:
        workload.step(batch)
        return True
    except RuntimeError as error:
        if not is_oom(error):
            raise
        return False
    finally:
        release()


def real_largest(workload: Workload, guess: int) -> tuple[int, int]:
    """The largest batch that fits under the current cap, and how many steps finding it took: from the
    prediction, up or down by 25% (at least one) until the answer flips, then bisection
    (``bisect_batch.largest_fitting``)."""
    found, runs = bisect_batch.largest_fitting(
        lambda batch: fits(workload, batch),
        max(guess, 1),
        up=lambda batch: max(int(batch * 1.25), batch + 1),
        down=lambda batch: max(int(batch / 1.25), 1) if batch > 1 else 0,
    )
    return found, len(runs)


def rule_of_thumb(workload: Workload, peak_bytes: int, card_bytes: int) -> int:
    static = workload.bytes_per_parameter * workload.parameters
    per_sample = (peak_bytes - static) / workload.batch
    if per_sample <= 0:
        return 0
    return max(int((card_bytes - static) // per_sample), 0)


def versions() -> dict[str, str]:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": str(torch.version.cuda),
            "cudnn": str(torch.backends.cudnn.version())}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = "not installed"
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        info["driver"] = driver.decode() if isinstance(driver, bytes) else driver
    except Exception as error:  # a benchmark still runs without NVML
        info["driver"] = f"unknown ({error})"
    return info


def run_workload(name: str, margin: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    release()
    workload = WORKLOADS[name]()
    started = time.perf_counter()
    cards = [Card(f"{gib} GiB", gib) for gib in CARDS_GIB]
    plan, measured, calibrated = make_plan(workload, cards, margin, calibrate=True)
    as_written = next(r for r in measured.runs if r.label == "as written, again")
    total = torch.cuda.get_device_properties(0).total_memory
    line = plan.line
    summary = {
        "workload": name,
        "description": workload.notes,
        "parameters": workload.parameters,
        "batch_as_written": workload.batch,
        "runs": [{"label": r.label, "batch": r.batch, "peak_bytes": r.peak_bytes, "start_bytes": r.start_bytes,
                  "peak_reserved_bytes": r.peak_reserved_bytes} for r in measured.runs],
        "per_sample_bytes": line.slope_bytes,
        "fixed_bytes": line.intercept_bytes,
        "reserved_per_sample_bytes": None if plan.reserved_line is None else plan.reserved_line.slope_bytes,
        "reserved_fixed_bytes": None if plan.reserved_line is None else plan.reserved_line.intercept_bytes,
        "decided_by": "the allocator's replay of the two runs" if plan.replayed else "the lines",
        "workspaces_optional": plan.workspaces_optional,
        "largest_by_allocated_line": {c.name: largest_batch(line, c.usable_bytes, margin) for c in plan.cards},
        "largest_by_reserved_line": None if plan.reserved_line is None else
        {c.name: largest_batch(plan.reserved_line, c.usable_bytes) for c in plan.cards},
        "non_pytorch_bytes": plan.non_pytorch_bytes,
        "non_pytorch_how": plan.non_pytorch_how,
        "agreements": [{"label": a.label, "relative": a.relative} for a in plan.agreements],
        "plan_s": round(time.perf_counter() - started, 2),  # the runs of the plan with --calibrate
        "calibration": None if measured.calibration is None else {
            "fitted_batch": measured.calibration.fitted,
            "failed_batch": measured.calibration.failed,
            "usable_bytes": measured.calibration.usable_bytes,
            "runs": measured.calibration.runs,
            "stopped": measured.calibration.stopped,
            "card": measured.calibration.card,
            "ratio": None if calibrated is None else calibrated.calibration_ratio,
        },
        "largest_calibrated": None if calibrated is None else {c.name: c.largest_batch for c in calibrated.cards},
    }
    cases = []
    for card in plan.cards:
        gib = int(card.name.split()[0])
        cap = (gib * GiB - plan.non_pytorch_bytes) / total
        torch.cuda.set_per_process_memory_fraction(cap, 0)
        release()
        t0 = time.perf_counter()
        real, tries = real_largest(workload, card.largest_batch or 1)
        predicted = card.largest_batch or 0
        with_calibration = None if calibrated is None else (calibrated.card(card.name).largest_batch or 0)
        rot = rule_of_thumb(workload, as_written.peak_bytes or 0, gib * GiB)
        case = {
            "workload": name,
            "card_gib": gib,
            "predicted_batch": predicted,
            "real_batch": real,
            "rule_of_thumb_batch": rot,
            "predicted_error": round(predicted / real - 1, 4) if real else None,
            "rule_of_thumb_error": round(rot / real - 1, 4) if real else None,
            "within_5_percent": bool(real) and abs(predicted / real - 1) <= 0.05,
            "above_by_more_than_margin": bool(real) and predicted > real * (1 + margin),
            "calibrated_batch": with_calibration,
            "calibrated_error": round(with_calibration / real - 1, 4) if real and with_calibration is not None else None,
            "calibrated_within_5_percent": bool(real) and with_calibration is not None
            and abs(with_calibration / real - 1) <= 0.05,
            "calibrated_above_by_more_than_margin": bool(real) and with_calibration is not None
            and with_calibration > real * (1 + CALIBRATED_MARGIN),
            "cap_bytes_for_pytorch": int(cap * total),
            "usable_bytes": card.usable_bytes,
            "real_peak_at_real_batch_bytes": None,
            "tries": tries,
            "search_s": round(time.perf_counter() - t0, 2),
        }
        if real:
            release()
            torch.cuda.reset_peak_memory_stats(0)
            if fits(workload, real):
                case["real_peak_at_real_batch_bytes"] = torch.cuda.max_memory_allocated(0)
                case["real_peak_reserved_at_real_batch_bytes"] = torch.cuda.max_memory_reserved(0)
        cases.append(case)
        errors = (f"{case['predicted_error']:+.1%} vs {case['rule_of_thumb_error']:+.1%}" if real
                  else "nothing fits under this cap")
        print(f"{name:12s} {gib:3d} GiB  predicted {predicted:6d}  calibrated {with_calibration}  real {real:6d}  "
              f"rule of thumb {rot:6d}  ({errors}, {tries} tries)", flush=True)
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    del workload
    release()
    return cases, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", default=",".join(WORKLOADS), help=f"workloads to run, of {', '.join(WORKLOADS)}")
    parser.add_argument("--margin", type=float, default=DEFAULT_MARGIN, help="the plan's margin")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/plan.py needs a CUDA device")
    chosen = [name.strip() for name in args.part.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workload {unknown[0]!r}; choose from {', '.join(WORKLOADS)}")
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the context first, as in a notebook that has used the GPU
    results: dict[str, Any] = {"cases": [], "workloads": []}
    if args.out.exists():  # keep what other parts measured
        previous = json.loads(args.out.read_text())
        results["cases"] = [c for c in previous.get("cases", []) if c["workload"] not in chosen]
        results["workloads"] = [w for w in previous.get("workloads", []) if w["workload"] not in chosen]
    results.update({
        "device": torch.cuda.get_device_name(0),
        "versions": versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "margin": args.margin,
        "calibrated_margin": CALIBRATED_MARGIN,
        "cards_gib": list(CARDS_GIB),
    })
    started = time.perf_counter()
    for name in chosen:
        try:
            cases, summary = run_workload(name, args.margin)
        except Exception as error:  # record it; the other workloads still run
            traceback.print_exc()
            cases, summary = [], {"workload": name, "error": f"{type(error).__name__}: {error}"[:500]}
        results["cases"] = [c for c in results["cases"] if c["workload"] != name] + cases
        results["workloads"] = [w for w in results["workloads"] if w["workload"] != name] + [summary]
    cases = results["cases"]
    results["goal"] = {
        "every_prediction_within_5_percent": bool(cases) and all(c["within_5_percent"] for c in cases),
        "never_above_by_more_than_margin": bool(cases) and not any(c["above_by_more_than_margin"] for c in cases),
        "calibrated_every_prediction_within_5_percent": bool(cases)
        and all(c.get("calibrated_within_5_percent") for c in cases),
        "calibrated_never_above_by_more_than_margin": bool(cases)
        and not any(c.get("calibrated_above_by_more_than_margin") for c in cases),
    }
    results["wall_s"] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"goal: {results['goal']}\nwrote {args.out} in {results['wall_s']} s")


if __name__ == "__main__":
    main()
