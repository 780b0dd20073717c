"""A simulated cell whose GPU memory follows a chosen function of its batch size.

``SimulatedCell.train_step(batch)`` allocates ``peak(batch)`` bytes on a ``FakeMachine`` in chunks
(as a real step grows its activations), frees them, and raises an error worded exactly like
PyTorch 2.x's ``torch.OutOfMemoryError`` when the machine's per-process cap (or a lower hidden
limit playing fragmentation) is reached. ``run_source`` executes a cell's source the way the
driver's ``run_source`` must: it returns the exception, or ``None``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from IPython.core.inputtransformer2 import TransformerManager

from tests.fakes import FakeAllocator, FakeMachine, FakeNvml, FakeOutOfMemoryError, GiB, MiB

from jupyter_cudamem.hardware import Hardware


def _size(value: float) -> str:
    if value >= GiB:
        return f"{value / GiB:.2f} GiB"
    if value >= MiB:
        return f"{value / MiB:.2f} MiB"
    return f"{int(value)} bytes"


def torch_oom_message(requested: int, total: int, free: int, process: int, allowed: int | None,
                      allocated: int, reserved_unallocated: int, device: int = 0) -> str:
    """The text of a ``torch.OutOfMemoryError`` as torch 2.11 words it (read from a real OOM on the H100)."""
    cap = f" {_size(allowed)} allowed;" if allowed is not None else ""
    return (
        f"CUDA out of memory. Tried to allocate {_size(requested)}. GPU {device} has a total capacity of "
        f"{_size(total)} of which {_size(free)} is free. Including non-PyTorch memory, this process has "
        f"{_size(process)} memory in use.{cap} Of the allocated memory {_size(allocated)} is allocated by "
        f"PyTorch, and {_size(reserved_unallocated)} is reserved by PyTorch but unallocated. If reserved but "
        "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
        "fragmentation.  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )


class OutOfMemoryError(RuntimeError):
    """Named like ``torch.OutOfMemoryError`` (a ``RuntimeError`` too), carrying its real text."""


def fake_hardware(machine: FakeMachine) -> Hardware:
    return Hardware(allocator=FakeAllocator(machine), nvml=FakeNvml(machine), pid=machine.pid, pid_exists=lambda p: True)


def capped_machine(cap_bytes: int, held_bytes: int = 0) -> FakeMachine:
    """An 80 GiB card capped at ``cap_bytes`` for this process, with ``held_bytes`` already allocated."""
    machine = FakeMachine()
    gpu = machine.gpus[0]
    gpu.fraction = cap_bytes / gpu.total_bytes
    gpu.has_context = True
    if held_bytes:
        machine.allocate(0, held_bytes)
    return machine


class SimulatedCell:
    """Memory of a training step as ``peak(batch)`` bytes above the start."""

    def __init__(self, machine: FakeMachine, peak: Callable[[int], float], chunks: int = 8,
                 hidden_limit_bytes: int | None = None):
        self.machine = machine
        self.peak = peak
        self.chunks = chunks
        self.hidden_limit_bytes = hidden_limit_bytes  # usable less than the cap: fragmentation
        self.calls: list[int] = []
        self.transform = TransformerManager().transform_cell

    def fits(self, batch: int) -> bool:
        gpu = self.machine.gpus[0]
        limit = gpu.fraction * gpu.total_bytes - gpu.allocated
        if self.hidden_limit_bytes is not None:
            limit = min(limit, self.hidden_limit_bytes)
        return self.peak(batch) <= limit

    def largest_fitting(self, upper: int) -> int:
        return max((b for b in range(1, upper + 1) if self.fits(b)), default=0)

    def _raise(self, requested: int, stuck: int = 0) -> None:
        """``stuck``: bytes the allocator holds in pieces it cannot use (the hidden limit's fragments)."""
        gpu = self.machine.gpus[0]
        allowed = int(gpu.fraction * gpu.total_bytes)
        raise OutOfMemoryError(torch_oom_message(
            requested, gpu.total_bytes, gpu.total_bytes - gpu.reserved - gpu.context_bytes,
            gpu.reserved + gpu.context_bytes, allowed, gpu.allocated, max(gpu.reserved - gpu.allocated, stuck)))

    def train_step(self, batch: int) -> None:
        self.calls.append(batch)
        total = int(self.peak(batch))
        chunk = max(total // self.chunks, 1)
        held = 0
        start = self.machine.gpus[0].allocated
        try:
            while held < total:
                size = min(chunk, total - held)
                if self.hidden_limit_bytes is not None and held + size > self.hidden_limit_bytes:
                    gpu = self.machine.gpus[0]
                    self._raise(size, max(int(gpu.fraction * gpu.total_bytes) - start - self.hidden_limit_bytes, 0))
                try:
                    self.machine.allocate(0, size)
                except FakeOutOfMemoryError:
                    self._raise(size)
                held += size
        finally:
            self.machine.free(0, self.machine.gpus[0].allocated - start)

    def run_source(self, namespace: dict[str, Any]) -> Callable[[str], BaseException | None]:
        """A ``run_source`` for the driver: execute IPython input in ``namespace``."""
        namespace.setdefault("train_step", self.train_step)

        def run(source: str) -> BaseException | None:
            try:
                exec(compile(self.transform(source), "<cell>", "exec"), namespace)
            except Exception as error:  # the cell's error is the result
                return error
            return None

        return run


BLOCK = 2 * MiB  # PyTorch's caching allocator rounds allocations above 1 MiB up to 2 MiB multiples


def _rounded(size: float) -> int:
    size = int(size)
    return -(-size // BLOCK) * BLOCK if size > MiB else size


class MemoryModel:
    """A step's allocations as a function of its batch, for the search alone (no machine).

    ``fixed_bytes`` is allocated whatever the batch, half before the batch-sized tensors (weights built
    in the cell) and half after them (gradients of weights, optimizer state made at the first step);
    ``per_sample`` lists the per-sample bytes of the tensors alive at the peak, each allocation
    rounded up to the allocator's 2 MiB blocks; ``noise`` a relative jitter of each run's peak (another
    cuDNN algorithm, another workspace); ``fragments`` the allocator's unusable pieces at the peak, as
    a share of the largest batch-sized tensor (PyTorch holds them reserved, split, and cannot give them
    to a new block). A try fails at the first allocation past ``usable_bytes`` less the fragments,
    reporting what it held, what it asked for and the fragments, as an OOM message does.
    """

    def __init__(self, fixed_bytes: float, per_sample: list[float], usable_bytes: float, noise: float = 0.0,
                 seed: int = 0, fragments: float = 0.0):
        import random

        self.fixed_bytes = fixed_bytes
        self.per_sample = per_sample
        self.usable_bytes = usable_bytes
        self.noise = noise
        self.fragments = fragments
        self.rng = random.Random(seed)

    def allocations(self, batch: int) -> list[int]:
        jitter = 1 + self.rng.uniform(-self.noise, self.noise)
        half = _rounded(self.fixed_bytes / 2)
        return [half] + [_rounded(a * batch * jitter) for a in self.per_sample] + [half]

    def peak(self, batch: int) -> int:
        return sum(self.allocations(batch))

    def stuck(self, batch: int) -> int:
        """The fragments at ``batch``'s peak."""
        return int(self.fragments * max((_rounded(a * batch) for a in self.per_sample), default=0))

    def fits(self, batch: int) -> bool:
        half = _rounded(self.fixed_bytes / 2)
        usable = self.usable_bytes * (1 - self.noise) - self.stuck(batch)
        return 2 * half + sum(_rounded(a * batch) for a in self.per_sample) <= usable

    def largest_fitting(self, upper: int) -> int:
        low, high = 0, upper + 1  # fits(low) (0 by convention), not fits(high)
        while high - low > 1:
            middle = (low + high) // 2
            if self.fits(middle):
                low = middle
            else:
                high = middle
        return low

    def run(self, batch: int) -> tuple[bool, int, int | None]:
        """``(fitted, peak or held bytes, need lower bound for a failure)``."""
        held = 0
        usable = self.usable_bytes - self.stuck(batch)
        for size in self.allocations(batch):
            if held + size > usable:
                return False, held, held + size
            held += size
        return True, held, None

    def observe(self, batch: int):
        """``run(batch)`` as the search sees it (``Observation``), the fragments in a failure's figures."""
        from jupyter_cudamem.batchsearch import Observation

        ok, held, need = self.run(batch)
        if ok:
            return Observation(True, held)
        return Observation(False, need_bytes=need, held_bytes=held, stuck_bytes=self.stuck(batch) or None)


def search_outcome(model: MemoryModel, start: int, budget_bytes: float, max_tries: int = 3):
    """Run ``batchsearch.BatchSearch`` on ``model`` from a failure at ``start``: ``(found, reruns, search)``."""
    from jupyter_cudamem.batchsearch import BatchSearch

    failed = model.observe(start)
    assert not failed.fitted, "the start must fail"
    search = BatchSearch(start, int(budget_bytes), max_tries=max_tries, need_bytes=failed.need_bytes,
                         stuck_bytes=failed.stuck_bytes)
    found = run_search(search, model.observe)
    return found, len(search.attempts), search


def run_search(search, try_batch: Callable[[int], Any]) -> int | None:
    """Drive ``search`` as ``%oomfix``'s driver does: try each batch ``next()`` gives and ``record`` what
    ``try_batch`` shows; the largest batch that fitted."""
    while (batch := search.next()) is not None:
        search.record(batch, try_batch(batch))
    return search.best
