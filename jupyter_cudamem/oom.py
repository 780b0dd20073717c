"""Recognise a GPU out-of-memory error and read the figures its message carries.

PyTorch has worded its allocator's message three ways over the years, and a GPU can also run out of
memory outside the caching allocator (the driver, cuBLAS, cuDNN) or in another library, so the
figures come from the text, form by form:

- PyTorch 1.x (and 2.0): ``CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total
  capacity; 14.52 GiB already allocated; 3.19 MiB free; [2.00 GiB allowed; ]14.75 GiB reserved in
  total by PyTorch)``; before 1.4 the last figure read ``... GiB cached)``.
- PyTorch 2.1 and later: ``CUDA out of memory. Tried to allocate 200.00 GiB. GPU 0 has a total
  capacity of 79.18 GiB of which 78.66 GiB is free. [Process 1234 has ... memory in use. ]Including
  non-PyTorch memory, this process has 518.00 MiB memory in use. [1.58 GiB allowed; ]Of the allocated
  memory 0 bytes is allocated by PyTorch, [with ... allocated in private pools (e.g., CUDA Graphs), ]and
  0 bytes is reserved by PyTorch but unallocated. ...`` (2.1 spelt it ``total capacty``).
- The driver: ``CUDA error: out of memory`` (and ``CUDA driver error: out of memory``, ``cuda runtime
  error (2) : out of memory`` from PyTorch before 1.0); cuBLAS: ``CUBLAS_STATUS_ALLOC_FAILED``; cuDNN:
  ``CUDNN_STATUS_ALLOC_FAILED``; others: CuPy's ``OutOfMemoryError``, JAX/XLA ``RESOURCE_EXHAUSTED``,
  cuFFT/cuSOLVER/cuSPARSE allocation failures.

An OOM is often re-raised by a library around it (``raise RuntimeError(...) from oom``, or an error
raised while handling it), so the whole ``__cause__``/``__context__`` chain is searched.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum

from .units import UNIT_FACTORS as _FACTORS

# Sizes as PyTorch's ``format_size`` and other libraries print them: "0 bytes", "3.19 MiB", "1,024 bytes".
_SIZE = r"([0-9][0-9,]*(?:\.[0-9]+)?)\s*(bytes|B|KiB|MiB|GiB|TiB|PiB|KB|MB|GB|TB)\b"


class OomKind(StrEnum):
    """Who ran out of memory, which decides what freeing PyTorch's cache can do for it."""

    ALLOCATOR = "allocator"  # PyTorch's caching allocator: torch.OutOfMemoryError
    CUBLAS = "cublas"
    CUDNN = "cudnn"
    DRIVER = "driver"  # CUDA error: out of memory
    OTHER = "other"  # CuPy, JAX, cuFFT...


# Kinds, most informative first: when an exception chain matches several, the first kind here wins.
_KIND_ORDER: tuple[OomKind, ...] = (
    OomKind.ALLOCATOR, OomKind.CUBLAS, OomKind.CUDNN, OomKind.DRIVER, OomKind.OTHER
)

# Who ran out, in words, for each kind.
KIND_WORDS: dict[OomKind, str] = {
    OomKind.ALLOCATOR: "PyTorch's allocator",
    OomKind.DRIVER: "the CUDA driver",
    OomKind.CUBLAS: "cuBLAS (its workspace or handle)",
    OomKind.CUDNN: "cuDNN (its workspace)",
    OomKind.OTHER: "a library outside PyTorch",
}

_NOT_CUDA = re.compile(r"\b(?:MPS backend|XPU|HIP) out of memory", re.IGNORECASE)
_PATTERNS: dict[OomKind, tuple[re.Pattern[str], ...]] = {
    OomKind.ALLOCATOR: (re.compile(r"CUDA out of memory\.", re.IGNORECASE),),
    OomKind.CUBLAS: (re.compile(r"CUBLAS_STATUS_ALLOC_FAILED"),),
    OomKind.CUDNN: (
        re.compile(r"CUDNN_STATUS_ALLOC_FAILED"),
        re.compile(r"cuDNN[^\n]*out of memory", re.IGNORECASE),
    ),
    OomKind.DRIVER: (
        re.compile(r"CUDA (?:driver )?error: out of memory", re.IGNORECASE),
        re.compile(r"cuda runtime error \(2\) : out of memory", re.IGNORECASE),
        re.compile(r"cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY"),
        re.compile(r"Cuda failure '?out of memory'?", re.IGNORECASE),  # NCCL's wording
    ),
    OomKind.OTHER: (
        re.compile(r"Out of memory allocating [0-9,]+ bytes"),  # CuPy
        re.compile(r"RESOURCE_EXHAUSTED:?\s*Out of memory", re.IGNORECASE),  # JAX / XLA
        re.compile(r"OOM when allocating tensor"),  # TensorFlow
        re.compile(r"CUFFT_ALLOC_FAILED|CUSOLVER_STATUS_ALLOC_FAILED|CUSPARSE_STATUS_ALLOC_FAILED"),
    ),
}

_DEVICE = (re.compile(r"\bGPU (\d+) has a total capac"), re.compile(r"\(GPU (\d+);"))
_REQUESTED = (
    re.compile(r"Tried to allocate " + _SIZE),
    re.compile(r"Out of memory (?:while trying to allocate|allocating) " + _SIZE, re.IGNORECASE),
)
_TOTAL = (re.compile(r"total capaci?ty of " + _SIZE), re.compile(_SIZE + r" total capacity"))
_FREE = (re.compile(r"of which " + _SIZE + r" is free"), re.compile(_SIZE + r" free[;)]"))
_PROCESS = (re.compile(r"this process has " + _SIZE + r" memory in use", re.IGNORECASE),)
_ALLOWED = (re.compile(_SIZE + r" allowed;"),)
_ALLOCATED = (
    re.compile(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch"),
    re.compile(_SIZE + r" already allocated"),
    re.compile(r"allocated so far: " + _SIZE),  # CuPy
)
_PRIVATE_POOLS = (re.compile(r"with " + _SIZE + r" allocated in private pools"),)
_RESERVED_UNALLOCATED = (re.compile(_SIZE + r" is reserved by PyTorch but unallocated"),)
_RESERVED_TOTAL = (re.compile(_SIZE + r" (?:reserved in total by PyTorch|cached)\)"),)
_OTHER_PROCESS = re.compile(r"Process (\d+) has " + _SIZE + r" memory in use")

_MESSAGE_LINES = 6
_MESSAGE_CHARS = 1200


@dataclass(frozen=True)
class OomInfo:
    """What one out-of-memory error says, in bytes; ``None`` where the message does not say.

    ``kind`` says who ran out (``OomKind``). ``other_processes`` lists ``(pid, bytes)`` PyTorch
    attributed to processes it could not identify as itself; inside a container, where NVML shows
    host PIDs, that is often this very process.
    """

    kind: OomKind
    message: str
    device_index: int | None = None
    requested_bytes: int | None = None
    total_bytes: int | None = None
    free_bytes: int | None = None
    process_bytes: int | None = None
    allowed_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_unallocated_bytes: int | None = None
    private_pool_bytes: int | None = None
    other_processes: tuple[tuple[int, int], ...] = ()
    exception_type: str | None = None

    @property
    def capacity_bytes(self) -> int | None:
        """What this process may use on the device: the per-process cap where one is set, else the card."""
        return self.allowed_bytes if self.allowed_bytes is not None else self.total_bytes

    @property
    def room_under_cap_bytes(self) -> int | None:
        """What PyTorch could still reserve under the per-process cap when it failed: the cap less what it
        had reserved. The cap (``set_per_process_memory_fraction``) counts PyTorch's own segments only,
        never the CUDA context that the message's "this process has ... in use" includes. ``None``
        without a cap or PyTorch's figures."""
        if self.allowed_bytes is None or self.reserved_bytes is None:
            return None
        return max(self.allowed_bytes - self.reserved_bytes, 0)

    @property
    def reserved_bytes(self) -> int | None:
        """Everything PyTorch's allocator held: allocated plus cached-but-unallocated."""
        if self.allocated_bytes is None or self.reserved_unallocated_bytes is None:
            return None
        return self.allocated_bytes + self.reserved_unallocated_bytes

    @property
    def exceeds_capacity(self) -> bool:
        """The single allocation asked for more than this process may ever have on the device."""
        capacity = self.capacity_bytes
        return self.requested_bytes is not None and capacity is not None and self.requested_bytes > capacity

    @property
    def fits_unfragmented(self) -> bool:
        """Whether the allocation that failed would have fit had PyTorch's cached memory been in one
        piece: at most what this process may still use (its cap, or the card, less what PyTorch has
        allocated; no more than the device's free memory plus PyTorch's cache). Only then can
        ``expandable_segments`` help. True where the message does not say."""
        capacity, allocated, asked = self.capacity_bytes, self.allocated_bytes, self.requested_bytes
        if capacity is None or allocated is None or asked is None:
            return True
        room = capacity - allocated
        if self.free_bytes is not None and self.reserved_unallocated_bytes is not None:
            room = min(room, self.free_bytes + self.reserved_unallocated_bytes)
        return asked <= room

    @property
    def looks_fragmented(self) -> bool:
        """PyTorch had the room cached, only not in one piece.

        True when the memory reserved by PyTorch but unallocated could have held the request by
        itself, and is not a trifle: at least 5% of what this process may use (so a 20 MiB request
        against 25 MiB of slack on a 16 GiB card is not called fragmentation). Then
        ``expandable_segments:True`` (or ``empty_cache()`` between phases) is the cure, not a
        smaller batch.
        """
        slack, asked = self.reserved_unallocated_bytes, self.requested_bytes
        if slack is None or asked is None or slack < asked:
            return False
        capacity = self.capacity_bytes
        return capacity is None or slack >= 0.05 * capacity


def oom_device(oom: OomInfo | None) -> int:
    """The device an OOM names; 0 where it names none (an older message, another library's), as PyTorch's
    default device."""
    return oom.device_index if oom is not None and oom.device_index is not None else 0


def _to_bytes(number: str, unit: str) -> int:
    return int(round(float(number.replace(",", "")) * _FACTORS[unit.lower()]))


def _first_size(patterns: tuple[re.Pattern[str], ...], text: str) -> int | None:
    for pattern in patterns:
        match = pattern.search(text)
        if match:
            return _to_bytes(match.group(1), match.group(2))
    return None


def exception_chain(error: BaseException) -> Iterator[BaseException]:
    """The error, then what caused it or was being handled, then any grouped errors; each once."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        for linked in (current.__cause__, current.__context__):
            if linked is not None:
                pending.append(linked)
        grouped = getattr(current, "exceptions", None)  # ExceptionGroup
        if isinstance(grouped, tuple):
            pending.extend(e for e in grouped if isinstance(e, BaseException))


def _type_name(error: BaseException) -> str:
    kind = type(error)
    module = kind.__module__
    return kind.__qualname__ if module in ("builtins", "__main__") else f"{module}.{kind.__qualname__}"


def _text_of(error: BaseException) -> str:
    try:
        text = str(error)
    except Exception:  # a broken __str__ must not hide the OOM
        text = ""
    notes = getattr(error, "__notes__", None)
    if isinstance(notes, list):
        text = "\n".join([text, *(str(note) for note in notes)])
    return text


def _kind_of_text(text: str) -> OomKind | None:
    if _NOT_CUDA.search(text):
        return None
    for kind in _KIND_ORDER:
        if any(pattern.search(text) for pattern in _PATTERNS[kind]):
            return kind
    return None


def _kind_of_type(error: BaseException) -> OomKind | None:
    """Kinds that follow from the exception's class alone, whatever its text says."""
    for klass in type(error).__mro__:
        if klass.__name__ == "OutOfMemoryError":
            module = klass.__module__ or ""
            if module.startswith("torch"):
                return OomKind.ALLOCATOR
            if module.startswith("cupy"):
                return OomKind.OTHER
    return None


def _shorten(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    short = "\n".join(lines[:_MESSAGE_LINES])
    if len(short) > _MESSAGE_CHARS:
        short = short[: _MESSAGE_CHARS - 1] + "…"
    return short


def _from_text(kind: OomKind, text: str, exception_type: str | None) -> OomInfo:
    device = None
    for pattern in _DEVICE:
        match = pattern.search(text)
        if match:
            device = int(match.group(1))
            break
    total = _first_size(_TOTAL, text)
    allocated = _first_size(_ALLOCATED, text)
    unallocated = _first_size(_RESERVED_UNALLOCATED, text)
    if unallocated is None and allocated is not None:
        reserved_total = _first_size(_RESERVED_TOTAL, text)  # PyTorch 1.x gives the total instead
        if reserved_total is not None:
            unallocated = max(reserved_total - allocated, 0)
    process = _first_size(_PROCESS, text)
    # Where NVML could not answer, PyTorch prints 2**64-1 bytes ("17179869184.00 GiB"): not a figure.
    if process is not None and total is not None and process > total:
        process = None
    others = []
    for match in _OTHER_PROCESS.finditer(text):
        used = _to_bytes(match.group(2), match.group(3))
        if total is None or used <= total:
            others.append((int(match.group(1)), used))
    return OomInfo(
        kind=kind,
        message=_shorten(text),
        device_index=device,
        requested_bytes=_first_size(_REQUESTED, text),
        total_bytes=total,
        free_bytes=_first_size(_FREE, text),
        process_bytes=process,
        allowed_bytes=_first_size(_ALLOWED, text),
        allocated_bytes=allocated,
        reserved_unallocated_bytes=unallocated,
        private_pool_bytes=_first_size(_PRIVATE_POOLS, text),
        other_processes=tuple(others),
        exception_type=exception_type,
    )


def parse_oom(error_or_text: BaseException | str) -> OomInfo | None:
    """The GPU OOM in an exception (or its causes) or in a message; ``None`` when there is none.

    Given an exception, every error in its ``__cause__``/``__context__`` chain is examined and the
    most informative match kept (the allocator's own message over a driver or library one), so an
    OOM re-raised by a library is still found.
    """
    if isinstance(error_or_text, str):
        kind = _kind_of_text(error_or_text)
        return None if kind is None else _from_text(kind, error_or_text, None)
    if not isinstance(error_or_text, BaseException):
        return None
    best: tuple[int, BaseException, OomKind, str] | None = None
    for error in exception_chain(error_or_text):
        text = _text_of(error)
        kind = _kind_of_text(text) or (None if _NOT_CUDA.search(text) else _kind_of_type(error))
        if kind is None:
            continue
        rank = _KIND_ORDER.index(kind)
        if best is None or rank < best[0]:
            best = (rank, error, kind, text)
    if best is None:
        return None
    _, error, kind, text = best
    return _from_text(kind, text, _type_name(error))


def is_cuda_oom(error: BaseException | None) -> bool:
    """Whether ``error`` (or anything in its cause chain) is a GPU out-of-memory error."""
    return error is not None and parse_oom(error) is not None


def describe_chain(error: BaseException) -> str:
    """``Type: message`` for the error and each error in its cause chain, one paragraph each.

    Kept where the exception object itself must not be (it holds its traceback's frames), so the OOM
    can still be parsed from text after the exception is released.
    """
    return "\n\n".join(f"{_type_name(e)}: {_text_of(e)}" for e in exception_chain(error))
