"""Rerun a cell that ran out of GPU memory until a form of it fits, measuring every try.

The driver knows nothing of IPython: it is handed a function that runs a cell's source and returns
the exception it raised (``None`` when it ran), a function that frees what a failure left behind,
and the ``Hardware`` to measure with. The magic passes the shell's ``run_cell`` and the real cleanup;
tests pass a simulated cell and fake hardware (``tests/oomfix/simulated.py``).

Tries stop at ``max_tries``, at the first try that fits (for a batch search: once the search says a
larger batch will not fit), and at any error that is not an OOM: that one is the user's to see.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from ..errors import CudaMemError
from ..hardware import Hardware
from ..measure import Meter
from ..units import format_bytes
from .parse import OomInfo, is_cuda_oom, parse_oom
from .rewrite import BatchDiscovery, _default_transform, find_batch, rewrite_batch, wrap_in_autocast
from .search import BatchSearch
from .strategies import (
    STRATEGIES,
    Outcome,
    TryResult,
    build_suggestions,
    cell_traits,
)

RunSource = Callable[[str], "BaseException | None"]
Cleanup = Callable[["BaseException | None"], Any]


def headroom_bytes(hardware: Hardware, torch_index: int) -> int | None:
    """What a cell starting now may allocate on ``cuda:torch_index``, in bytes.

    The least of: the per-process cap less what PyTorch has reserved, and what the device has free
    (NVML, so other processes count); plus what PyTorch has reserved but not allocated, which it
    reuses first. ``None`` when the allocator cannot be read.
    """
    allocator = hardware.allocator
    if allocator.status() is not None or not allocator.is_initialized():
        return None
    reading = allocator.read(torch_index)
    total = allocator.device(torch_index).total_bytes
    fraction = allocator.memory_fraction(torch_index)
    room = int(total * (fraction if fraction is not None else 1.0)) - reading.reserved_bytes
    device = next((d for d in hardware.device_map.devices() if d.torch_index == torch_index), None)
    if device is not None and device.nvml_index is not None and hardware.nvml.status() is None:
        try:
            room = min(room, hardware.nvml.memory(device.nvml_index).free_bytes)
        except CudaMemError:
            pass
    return max(room, 0) + reading.reserved_unallocated_bytes


def _needed_bytes(oom: OomInfo | None, allocated_before: int | None) -> int | None:
    """A lower bound of what the failed cell needs: what it had allocated when it failed, plus the ask."""
    if oom is None or allocated_before is None or oom.allocated_bytes is None or oom.requested_bytes is None:
        return None
    return max(oom.allocated_bytes - allocated_before, 0) + oom.requested_bytes


# IPython's own names in a user namespace: its caches are the cleanup's business, not the undo's.
from ..ipython_names import IPYTHON_NAMES as _IPYTHON_NAMES  # noqa: E402 - one list with attribution


def undo_bindings(namespace: MutableMapping[str, Any], before: Mapping[str, Any]) -> list[str]:
    """Put ``namespace`` back as it was in ``before``: names the run bound anew are removed, rebound
    names get their old object back. Returns the names changed.

    A try that fails half-way leaves what it already assigned: a ``loss`` whose ``backward()`` ran
    out of memory keeps its whole autograd graph (every saved activation) alive, which then shrinks
    the room for the next try. Seen on the H100: a failed try's graph made the next, smaller try
    fail too, and stayed allocated after ``%oomfix`` ended.
    """
    changed = []
    for name in list(namespace):
        if name.startswith("_") or name in _IPYTHON_NAMES:
            continue
        if name not in before:
            del namespace[name]
            changed.append(name)
        elif namespace[name] is not before[name]:
            namespace[name] = before[name]
            changed.append(name)
    for name, value in before.items():
        if name not in namespace and not name.startswith("_"):
            namespace[name] = value
            changed.append(name)
    return changed


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > 160:
        first = first[:159] + "…"
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


@dataclass
class Driver:
    """Runs the strategies in order for one failed cell; see the module docstring."""

    run_source: RunSource
    hardware: Hardware
    cleanup: Cleanup
    max_tries: int = 3
    strategies: tuple[str, ...] = STRATEGIES
    autocast_dtype: Callable[[], str] | None = None
    transform: Callable[[str], str] | None = None
    margin: float = 0.04

    def __post_init__(self) -> None:
        if self.max_tries < 1:
            raise CudaMemError(f"--max-tries must be at least 1, got {self.max_tries}")
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown:
            raise CudaMemError(f"unknown strategy {unknown[0]!r}; choose from {', '.join(STRATEGIES)}")
        self._tries: list[TryResult] = []
        self._notes: list[str] = []
        self._namespace: Mapping[str, Any] | None = None

    # -- one measured try -------------------------------------------------------------------------
    def _try(self, strategy: str, source: str, reason: str, device: int, batch: int | None = None) -> TryResult:
        namespace = self._namespace if isinstance(self._namespace, MutableMapping) else None
        before = dict(namespace) if namespace is not None else None
        meter = Meter(self.hardware, devices=[device])
        baseline = meter.start()
        started = time.perf_counter()
        error = self.run_source(source)
        wall_s = time.perf_counter() - started
        measurement = meter.stop(baseline, error=None if error is None else type(error).__name__)
        if error is not None and namespace is not None and before is not None:
            # A failed try leaves nothing behind: the variables are as the last try that fitted left them.
            undo_bindings(namespace, before)
        del before
        peak = next((d.peak_above_start_bytes for d in measurement.devices), None)
        oom = error is not None and is_cuda_oom(error)
        result = TryResult(
            number=len(self._tries) + 1,
            strategy=strategy,
            source=source,
            fitted=error is None,
            out_of_memory=oom,
            peak_bytes=peak,
            wall_s=wall_s,
            reason=reason,
            batch=batch,
            error=None if error is None or oom else _one_line(error),
        )
        self._tries.append(result)
        # Free what this try left (a failed try holds its frames like the original failure did).
        self.cleanup(error)
        return result

    def _left(self) -> int:
        return self.max_tries - len(self._tries)

    # -- the whole fix ------------------------------------------------------------------------------
    def fix(
        self,
        source: str,
        error: BaseException | None,
        namespace: Mapping[str, Any] | None = None,
        freed_bytes: int | None = None,
        diagnosis: object | None = None,
        oom: OomInfo | None = None,
        allocated_before: int | None = None,
    ) -> Outcome:
        """Try the strategies on ``source``, which failed with ``error``; cleanup has already run.

        ``oom`` is the failure as parsed (pass it when the exception itself was released by the
        cleanup); ``error`` and ``oom`` both ``None`` means the cell has not run yet (``%%oomfix``).
        ``allocated_before`` is what PyTorch had allocated when the failed cell started: with the
        OOM's figures it bounds what the cell needs, which decides whether a plain rerun can fit.
        ``freed_bytes`` is what the cleanup freed (the fallback for that decision).
        """
        self._namespace = namespace
        if oom is None and error is not None:
            oom = parse_oom(error)
        if error is not None and oom is None:
            raise CudaMemError(f"the last failure was not a GPU out-of-memory error ({_one_line(error)}); %oomfix does nothing for it")
        device = oom.device_index if oom is not None and oom.device_index is not None else 0
        transform = self.transform or _default_transform
        budget = headroom_bytes(self.hardware, device)
        discovery = find_batch(source, namespace, transform)
        traits = cell_traits(source, transform)
        fragmented = bool(oom is not None and oom.looks_fragmented)
        fitted: TryResult | None = None
        strategy: str | None = None
        batch_before = batch_after = None

        for name in self.strategies:
            if fitted is not None or self._left() <= 0:
                break
            if name == "cleanup":
                needed = _needed_bytes(oom, allocated_before)
                fitted = self._cleanup_alone(source, oom, freed_bytes, needed, budget, fragmented, device)
            elif name == "batch":
                fitted, batch_before, batch_after = self._smaller_batch(discovery, budget, device)
            elif name == "autocast":
                has_torch = namespace is not None and getattr(namespace.get("torch"), "autocast", None) is not None
                fitted = self._autocast(source, traits, device, import_torch=not has_torch)
            if fitted is not None:
                strategy = name
        if fitted is None and self._left() <= 0 and len(self.strategies) > 1:
            self._notes.append(f"stopped after --max-tries {self.max_tries} reruns")
        if self._tries and not self._tries[-1].fitted and fitted is not None:
            self._notes.append(
                f"the last rerun (#{self._tries[-1].number}) failed after #{fitted.number} fitted: the variables "
                "hold what the failed rerun left; run the fixed cell again to get its results"
            )
        autocast_dtype = self._dtype() if "autocast" in self.strategies else None
        suggestions = build_suggestions(
            source, traits, batch_before, batch_after, autocast_dtype, fragmented, strategy == "autocast"
        )
        return Outcome(
            original_source=source,
            fixed_source=None if fitted is None else fitted.source,
            strategy=strategy,
            tries=tuple(self._tries),
            batch_before=batch_before,
            batch_after=batch_after,
            batch_summary=discovery.summary() if "batch" in self.strategies else "",
            budget_bytes=budget,
            freed_bytes=freed_bytes,
            suggestions=suggestions,
            notes=tuple(self._notes),
            diagnosis=diagnosis,
        )

    # -- strategies ---------------------------------------------------------------------------------
    def _cleanup_alone(
        self,
        source: str,
        oom: OomInfo | None,
        freed_bytes: int | None,
        needed_bytes: int | None,
        budget: int | None,
        fragmented: bool,
        device: int,
    ) -> TryResult | None:
        if oom is None:
            reason = "as written"  # the cell has not failed yet (``%%oomfix``)
        elif fragmented:
            reason = "the failure looked like fragmentation"
        elif needed_bytes is not None and budget is not None:
            if needed_bytes > budget:
                self._notes.append(
                    f"skipped a plain rerun: the cell needs at least {format_bytes(needed_bytes)} "
                    f"(what it held when it failed plus the allocation that failed), {format_bytes(budget)} is free"
                )
                return None
            reason = f"at least {format_bytes(needed_bytes)} needed, {format_bytes(budget)} free now"
        else:
            # What the cell held when it failed is unknown: a plain rerun is worth it only when the
            # cleanup freed more than the allocation that failed.
            asked = oom.requested_bytes
            if freed_bytes is None or asked is None or freed_bytes < asked:
                self._notes.append(
                    f"skipped a plain rerun: cleanup freed {format_bytes(freed_bytes)}, less than the "
                    f"{format_bytes(asked)} allocation that failed"
                )
                return None
            reason = "cleanup freed more than the allocation that failed"
        result = self._try("cleanup", source, reason, device)
        return result if result.fitted else self._stop_on_error(result)

    def _smaller_batch(
        self, discovery: BatchDiscovery, budget: int | None, device: int
    ) -> tuple[TryResult | None, int | None, int | None]:
        chosen = discovery.chosen
        if chosen is None:
            self._notes.append(discovery.summary())
            return None, None, None
        if chosen.value < 2:
            self._notes.append(f"the batch size is already {chosen.value}; it cannot shrink")
            return None, chosen.value, None
        if budget is None:
            self._notes.append("the free memory could not be read, so the batch search has no budget")
            return None, chosen.value, None
        search = BatchSearch(chosen.value, budget, max_tries=self._left(), margin=self.margin)
        best: TryResult | None = None
        while True:
            choice = search._choose()
            if choice is None:
                break
            batch, reason = choice
            result = self._try("batch", rewrite_batch(discovery, batch), reason, device, batch=batch)
            search.record(batch, result.fitted, result.peak_bytes, reason)
            if result.fitted and (best is None or batch > (best.batch or 0)):
                best = result
            if not result.fitted and not result.out_of_memory:
                self._stop_on_error(result)
                break
        last_fitted = next((t for t in reversed(self._tries) if t.fitted), None)
        if best is not None and last_fitted is not best and self._left() > 0:
            # Failed tries are undone, so the variables hold the last try that fitted; when that is
            # not the best, rerun the best so they hold the run the outcome reports.
            confirm = self._try("batch", best.source, "rerun of the largest batch that fitted", device, batch=best.batch)
            if confirm.fitted:
                best = confirm
        return best, chosen.value, None if best is None else best.batch

    def _autocast(self, source: str, traits: Any, device: int, import_torch: bool = True) -> TryResult | None:
        if traits.autocast:
            self._notes.append("the cell already uses autocast")
            return None
        dtype = self._dtype()
        try:
            wrapped = wrap_in_autocast(source, dtype, import_torch=import_torch, transform=self.transform)
        except SyntaxError as error:
            self._notes.append(f"could not wrap the cell in autocast: it does not parse ({error.msg})")
            return None
        result = self._try("autocast", wrapped, f"torch.autocast('cuda', dtype=torch.{dtype})", device)
        return result if result.fitted else self._stop_on_error(result)

    def _dtype(self) -> str:
        if self.autocast_dtype is not None:
            return self.autocast_dtype()
        from .strategies import default_autocast_dtype

        return default_autocast_dtype()

    def _stop_on_error(self, result: TryResult) -> None:
        if not result.fitted and not result.out_of_memory:
            # A rewritten cell that fails otherwise (a shape that needed the old batch...) is not
            # ours to keep retrying; spend no more tries.
            self._notes.append(f"rerun #{result.number} failed with {result.error}; stopped")
            self.max_tries = len(self._tries)
        return None
