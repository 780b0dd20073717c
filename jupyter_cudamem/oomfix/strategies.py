"""The ways a cell that ran out of GPU memory can be made to fit, and the record of trying them.

Strategies, in the order the driver tries them:

- ``cleanup``: rerun the cell unchanged once what the failure left behind is freed. Tried only when
  cleanup freed enough to matter (at least the allocation that failed) or the failure looked like
  fragmentation; otherwise the rerun would fail the same way and is skipped, with the reason.
- ``batch``: find the batch size in the cell (``rewrite.find_batch``), and search for the largest
  that fits (``search.BatchSearch``), rewriting only that number.
- ``autocast``: run the cell under ``torch.autocast("cuda", dtype=...)``, bfloat16 where the card
  supports it, else float16 (then a GradScaler is needed to train).

Every try is measured; the ``Outcome`` holds them all, the cell that fitted (shown as a diff) and
advice that keeps the effective batch or saves memory another way.
"""

from __future__ import annotations

import ast
import html
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ..report.text import TextReport
from ..units import format_bytes, format_seconds
from .rewrite import _default_transform, unified_diff

STRATEGIES = ("cleanup", "batch", "autocast")
STRATEGY_TITLES = {"cleanup": "cleanup alone", "batch": "smaller batch", "autocast": "autocast"}


def parse_strategies(text: str | None) -> tuple[str, ...]:
    """``"batch,autocast"`` -> ``("batch", "autocast")`` in the given order; ``None``/``"all"`` -> all."""
    if text is None or text.strip() in ("", "all"):
        return STRATEGIES
    chosen = []
    for part in text.replace(" ", ",").split(","):
        name = part.strip().lower()
        if not name:
            continue
        if name not in STRATEGIES:
            raise ValueError(f"unknown strategy {part!r}; choose from {', '.join(STRATEGIES)} (comma-separated)")
        if name not in chosen:
            chosen.append(name)
    return tuple(chosen) or STRATEGIES


def default_autocast_dtype() -> str:
    """bfloat16 where the current card supports it (Ampere and later), else float16."""
    import torch

    try:
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    except Exception:  # no CUDA: the driver will not get to run anyway
        return "float16"


@dataclass(frozen=True)
class TryResult:
    """One rerun: what ran, whether it fitted, and what it measured."""

    number: int
    strategy: str
    source: str
    fitted: bool
    out_of_memory: bool
    peak_bytes: int | None  # peak allocated above what was allocated when the try started
    wall_s: float
    reason: str
    batch: int | None = None
    error: str | None = None  # one line for a failure that was not an OOM

    @property
    def verdict(self) -> str:
        if self.fitted:
            return "fitted"
        if self.out_of_memory:
            return "out of memory"
        return f"failed: {self.error}"


@dataclass(frozen=True)
class Suggestion:
    """Advice with code the user can paste."""

    title: str
    why: str
    code: str = ""


@dataclass(frozen=True, repr=False)
class Outcome(TextReport):
    """What ``%oomfix`` did: every try, what fitted, the cell that fits, and advice."""

    original_source: str
    fixed_source: str | None
    strategy: str | None
    tries: tuple[TryResult, ...]
    batch_before: int | None = None
    batch_after: int | None = None
    batch_summary: str = ""
    budget_bytes: int | None = None
    freed_bytes: int | None = None
    suggestions: tuple[Suggestion, ...] = ()
    notes: tuple[str, ...] = ()
    dry_run: bool = False
    diagnosis: object | None = field(default=None, compare=False)

    @property
    def fitted(self) -> bool:
        return self.fixed_source is not None

    @property
    def changed(self) -> bool:
        return self.fixed_source is not None and self.fixed_source != self.original_source

    @property
    def diff(self) -> str:
        if not self.changed:
            return ""
        return unified_diff(self.original_source, self.fixed_source or "")

    @property
    def reruns(self) -> int:
        return len(self.tries)

    def headline(self) -> str:
        if self.dry_run:
            return "%oomfix --dry-run: diagnosis only, nothing was rerun"
        count = f"{self.reruns} rerun{'s' if self.reruns != 1 else ''}"
        if not self.fitted:
            return f"%oomfix: nothing fitted after {count}"
        if self.strategy == "batch":
            return f"%oomfix: fits with batch {self.batch_after} (was {self.batch_before}) after {count}"
        if self.strategy == "autocast":
            return f"%oomfix: fits under autocast after {count}"
        return f"%oomfix: fits unchanged after cleanup ({count})"

    def _facts(self) -> list[str]:
        """What the cleanup freed, the room measured and where the batch was found, for both renderings."""
        facts = []
        if self.freed_bytes is not None:
            facts.append(f"cleanup freed {format_bytes(self.freed_bytes)}")
        if self.budget_bytes is not None:
            facts.append(f"room for the cell {format_bytes(self.budget_bytes)}")
        if self.batch_summary:
            facts.append(self.batch_summary)
        return facts

    # -- text -----------------------------------------------------------------------------------
    def text(self) -> str:
        parts = [self.headline()]
        if self.diagnosis is not None:
            parts += ["", str(self.diagnosis)]
        facts = self._facts()
        if facts:
            parts.append("; ".join(facts))
        if self.tries:
            parts.append("")
            parts.append(" #  strategy        batch   result          peak        time   why")
            for t in self.tries:
                batch = "" if t.batch is None else str(t.batch)
                parts.append(
                    f"{t.number:>2}  {STRATEGY_TITLES.get(t.strategy, t.strategy):<14} {batch:>6}   "
                    f"{t.verdict:<14} {format_bytes(t.peak_bytes):>11} {format_seconds(t.wall_s):>8}   {t.reason}"
                )
        if self.diff:
            parts += ["", self.diff.rstrip("\n")]
        for note in self.notes:
            parts.append(f"note: {note}")
        for suggestion in self.suggestions:
            parts += ["", f"- {suggestion.title}: {suggestion.why}"]
            if suggestion.code:
                parts += ["    " + line for line in suggestion.code.splitlines()]
        return "\n".join(parts)

    # -- HTML -----------------------------------------------------------------------------------
    def _repr_html_(self) -> str:
        e = html.escape
        out = [f"<div class='cudamem-oomfix'><p><b>{e(self.headline())}</b></p>"]
        if self.diagnosis is not None:
            rich = getattr(self.diagnosis, "_repr_html_", None)
            out.append(rich() if callable(rich) else f"<pre>{e(str(self.diagnosis))}</pre>")
        facts = self._facts()
        if facts:
            out.append("<p>" + "; ".join(e(fact) for fact in facts) + "</p>")
        if self.tries:
            out.append("<table><thead><tr><th>#</th><th>strategy</th><th>batch</th><th>result</th>"
                       "<th>peak</th><th>time</th><th>why</th></tr></thead><tbody>")
            for t in self.tries:
                colour = "#2e7d32" if t.fitted else "#c62828"
                out.append(
                    f"<tr><td>{t.number}</td><td>{e(STRATEGY_TITLES.get(t.strategy, t.strategy))}</td>"
                    f"<td>{'' if t.batch is None else t.batch}</td>"
                    f"<td style='color:{colour}'>{e(t.verdict)}</td><td>{e(format_bytes(t.peak_bytes))}</td>"
                    f"<td>{e(format_seconds(t.wall_s))}</td><td>{e(t.reason)}</td></tr>"
                )
            out.append("</tbody></table>")
        if self.diff:
            lines = []
            for line in self.diff.splitlines():
                style = ""
                if line.startswith("+") and not line.startswith("+++"):
                    style = " style='background:#e6ffed'"
                elif line.startswith("-") and not line.startswith("---"):
                    style = " style='background:#ffeef0'"
                lines.append(f"<span{style}>{e(line)}</span>")
            out.append("<pre>" + "\n".join(lines) + "</pre>")
        for note in self.notes:
            out.append(f"<p><i>{e(note)}</i></p>")
        if self.suggestions:
            out.append("<ul>")
            for s in self.suggestions:
                code = f"<pre>{e(s.code)}</pre>" if s.code else ""
                out.append(f"<li><b>{e(s.title)}</b>: {e(s.why)}{code}</li>")
            out.append("</ul>")
        out.append("</div>")
        return "".join(out)


# -- reading the cell for advice ------------------------------------------------------------------
@dataclass(frozen=True)
class CellTraits:
    """What a cell does, as far as its code shows."""

    trains: bool  # calls .backward() or an optimizer/trainer step
    hf_trainer: bool  # builds TrainingArguments (advice goes through its arguments)
    no_grad: bool  # already under no_grad / inference_mode
    autocast: bool  # already under autocast
    calls_model: bool  # calls what looks like a model (inference cells do)


def cell_traits(source: str, transform: Callable[[str], str] | None = None) -> CellTraits:
    try:
        from .rewrite import _parse

        tree = _parse(source, transform or _default_transform).tree
    except Exception:  # unparseable: the text is all we have
        return CellTraits(".backward(" in source, "TrainingArguments" in source, "no_grad" in source,
                          "autocast" in source, "(" in source)
    attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    return CellTraits(
        trains=bool({"backward", "train"} & attributes) or ("step" in attributes and "zero_grad" in attributes),
        hf_trainer="TrainingArguments" in names or "TrainingArguments" in attributes,
        no_grad=bool({"no_grad", "inference_mode"} & (attributes | names)),
        autocast=bool({"autocast", "autocast_mode"} & (attributes | names)),
        calls_model=any(_looks_like_model_call(call) for call in calls),
    )


_MODEL_WORDS = ("model", "net", "encoder", "decoder", "classifier", "backbone", "transformer", "module",
                "layer", "block", "head", "policy", "generator", "unet", "vae", "pipe")


def _looks_like_model_call(call: ast.Call) -> bool:
    """``model(x)``, ``self.encoder(x)``, ``net.forward(x)``, ``model[:3](x)``: not ``torch.randn(...)``."""
    func = call.func
    if isinstance(func, ast.Subscript):
        return True
    if isinstance(func, ast.Attribute) and func.attr == "forward":
        return True
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in ("torch", "nn", "F", "np"):
        return False
    lowered = name.lower()
    return any(word in lowered for word in _MODEL_WORDS) and not lowered.startswith(("make_", "build_", "create_", "load_"))


def accumulation_plan(batch_before: int, batch_fits: int) -> tuple[int, int]:
    """(micro batch, steps) with ``steps`` micro batches adding up to the original batch or just over.

    The micro batch is the smallest that needs no more steps, so it stays at or under what fitted and
    ``micro * steps`` equals the original batch whenever it divides evenly.
    """
    steps = max(math.ceil(batch_before / max(batch_fits, 1)), 1)
    return math.ceil(batch_before / steps), steps


def build_suggestions(
    source: str,
    traits: CellTraits,
    batch_before: int | None,
    batch_after: int | None,
    autocast_dtype: str | None,
    fragmented: bool,
    autocast_fitted: bool,
) -> tuple[Suggestion, ...]:
    """Advice that fits the cell: keep the effective batch, save activations, beat fragmentation."""
    found: list[Suggestion] = []
    if batch_before and batch_after and batch_after < batch_before and traits.trains:
        micro, steps = accumulation_plan(batch_before, batch_after)
        if traits.hf_trainer:
            code = f"TrainingArguments(..., per_device_train_batch_size={micro}, gradient_accumulation_steps={steps})"
        else:
            code = (
                f"accumulation_steps = {steps}  # {steps} x {micro} = {steps * micro} samples per optimizer step\n"
                f"for i, (x, y) in enumerate(loader):  # loader with batch_size={micro}\n"
                f"    loss = loss_fn(model(x), y) / accumulation_steps\n"
                f"    loss.backward()\n"
                f"    if (i + 1) % accumulation_steps == 0:\n"
                f"        optimizer.step()\n"
                f"        optimizer.zero_grad()"
            )
        found.append(Suggestion(
            "gradient accumulation",
            f"keeps the effective batch of {batch_before}: {steps} steps of {micro} per optimizer step"
            + ("" if micro * steps == batch_before else f" ({micro * steps} samples, the nearest even split)"),
            code,
        ))
    if not traits.trains and not traits.no_grad and traits.calls_model:
        found.append(Suggestion(
            "torch.no_grad() for inference",
            "the cell computes no gradients, yet autograd keeps every activation for a backward pass",
            "with torch.inference_mode():  # or torch.no_grad()\n    outputs = model(inputs)",
        ))
    if traits.trains:
        found.append(Suggestion(
            "activation checkpointing",
            "recomputes activations in the backward pass instead of storing them: less memory for about a third more compute",
            "from torch.utils.checkpoint import checkpoint\n"
            "def forward(self, x):\n"
            "    for block in self.blocks:\n"
            "        x = checkpoint(block, x, use_reentrant=False)\n"
            "    return x",
        ))
    if autocast_fitted and autocast_dtype == "float16" and traits.trains:
        found.append(Suggestion(
            "GradScaler for float16 training",
            "float16 gradients underflow without loss scaling (bfloat16 needs none; this card lacks it)",
            'scaler = torch.amp.GradScaler("cuda")  # torch < 2.3: torch.cuda.amp.GradScaler()\n'
            'with torch.autocast("cuda", dtype=torch.float16):\n'
            "    loss = loss_fn(model(x), y)\n"
            "scaler.scale(loss).backward()\n"
            "scaler.step(optimizer)\n"
            "scaler.update()\n"
            "optimizer.zero_grad()",
        ))
    if fragmented:
        found.append(Suggestion(
            "expandable segments",
            "the failure looks like fragmentation (much memory reserved but unallocated); this allocator "
            "setting takes effect only in a fresh kernel, before CUDA is first used",
            'import os\nos.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # first cell, before import torch',
        ))
    return tuple(found)
