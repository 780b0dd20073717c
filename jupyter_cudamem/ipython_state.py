"""What IPython itself holds: the last failure, the input history, and everything it keeps alive (the
output cache, the exception and its traceback); the one module that knows IPython's (and ipykernel's)
attribute names for them.

**Finding the failed cell.** ``last_execution_result`` is replaced by any later cell, silent frontend
executions included, so ``FailureRecorder`` (a ``post_run_cell`` callback, which silent executions do not
fire) remembers the last failed cell: its source, number, the chain's text and the OOM's figures, parsed
once, and a GPU OOM's exception until released. A ``UsageError`` is not the user's failure. Loaded after
the failure, ``last_failure`` falls back to ``last_execution_result``, then ``sys.last_exc``/``last_value``.

**What keeps memory alive** after a failed cell (tests/gpu/test_oomfix_free_gpu.py): the exception through
``sys.last_exc``/``last_value``/``last_traceback``, the execution result's ``error_in_exec`` and
``InteractiveTB.tb``, whose traceback's frames hold the tensors in their locals; a tensor a cell returned
stays in the output cache (``Out``/``_oh``, ``_N``, ``_``/``__``/``___``) and in the execution result.
"""

from __future__ import annotations

import inspect
import re
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from .ipython_names import OUTPUT_CACHE_NAMES
from .ipython_outputs import OutputIds
from .oom import OomInfo, describe_chain, exception_chain, parse_oom

if TYPE_CHECKING:
    from IPython.core.interactiveshell import ExecutionResult, InteractiveShell

_SYS_ATTRIBUTES = ("last_exc", "last_value", "last_traceback", "last_type")
# IPython's own frames (``run_code``) are cleared too but not worth naming in a report.
_MACHINERY_MODULES = ("IPython.", "ipykernel.")


class Origin(StrEnum):
    """Where something that may hold memory comes from: a user's variable or one of the things IPython keeps.
    Attribution names a holder, and judges its cause, by it."""

    VARIABLE = "variable"
    OUTPUT_CACHE = "output cache"  # Out[N], _N, _, the last execution result's value
    EXCEPTION = "exception"  # sys.last_*, the execution result's error, InteractiveTB.tb, a cell's own error
    FRAME = "traceback frame"  # a function's frame on a failed cell's traceback


@dataclass(slots=True)
class Reference:
    """Something IPython keeps that may hold the user's memory: its name, where it comes from, and it.

    ``name`` is plain (``"Out[3]"``, ``"sys.last_value"``, ``"f()"`` for a frame of ``f``);
    ``occurrence`` tells apart frames of one function (recursion, one frame per layer). Not frozen:
    a snapshot lists them before every measured cell, and frozen dataclasses are slow to make.
    """

    name: str
    origin: Origin
    value: object = field(repr=False, compare=False)
    occurrence: int = 1

    @property
    def label(self) -> str:
        if self.origin is Origin.FRAME:
            suffix = f" #{self.occurrence}" if self.occurrence > 1 else ""
            return f"frame of {self.name}{suffix} (from the failed cell's traceback)"
        return self.name


@dataclass(frozen=True)
class Failure:
    """One failed cell: its source, count, the chain's text, its OOM as parsed once (``None`` when it is
    not one), and the exception until it is released.

    Exceptions cannot be weakly referenced, so the recorder keeps a GPU OOM's exception (and so its
    traceback) only as long as IPython itself would (``sys.last_value`` keeps it until the next
    error): a later failure replaces it and ``release_ipython_references`` drops it, keeping the text.
    Other failures are recorded as text only: ``%oomfix`` needs no more to say they are not an OOM.
    """

    raw_cell: str | None
    execution_count: int | None
    exception_type: str
    text: str
    exception: BaseException | None = field(default=None, repr=False, compare=False)
    parsed_oom: OomInfo | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(
        cls, error: BaseException, raw_cell: str | None, execution_count: int | None, keep_any: bool = True
    ) -> Failure:
        """The failure of ``error``, its OOM parsed here once; the exception is kept when it is a GPU
        OOM, or whatever it is with ``keep_any``."""
        oom = parse_oom(error)
        keep = keep_any or oom is not None
        return cls(raw_cell, execution_count, type(error).__qualname__, describe_chain(error),
                   error if keep else None, oom)

    def oom(self) -> OomInfo | None:
        """The OOM in this failure (``None`` when it is none), as parsed when it was recorded."""
        return self.parsed_oom

    def without_exception(self) -> Failure:
        return replace(self, exception=None)


def _is_usage_error(error: BaseException) -> bool:
    from IPython.core.error import UsageError

    return isinstance(error, UsageError)


class FailureRecorder:
    """Remembers the last failed cell through a ``post_run_cell`` callback (see the module docstring)."""

    def __init__(self) -> None:
        self.last: Failure | None = None
        self._paused = 0

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Record nothing meanwhile: ``%oomfix``'s own reruns are not the user's failures."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def attach(self, shell: InteractiveShell) -> None:
        shell.events.register("post_run_cell", self.post_run_cell)
        _recorders[id(shell)] = self

    def detach(self, shell: InteractiveShell) -> None:
        try:
            shell.events.unregister("post_run_cell", self.post_run_cell)
        except ValueError:  # already gone
            pass
        if _recorders.get(id(shell)) is self:
            del _recorders[id(shell)]

    def forget(self) -> None:
        """Drop the record, e.g. once the failure has been fixed by a rerun."""
        self.last = None

    def post_run_cell(self, result: ExecutionResult | None = None) -> None:
        # A callback must never raise into the kernel: a result we cannot read is simply not recorded.
        try:
            if result is None or self._paused:  # ipykernel passes None when the cell was cancelled
                return
            error = result.error_in_exec if result.error_in_exec is not None else result.error_before_exec
            if error is None or _is_usage_error(error):
                return
            info = getattr(result, "info", None)
            self.last = Failure.of(error, getattr(info, "raw_cell", None), result.execution_count, keep_any=False)
        except Exception:
            return

    def drop_exception(self) -> None:
        """Keep the record's text and source but not the exception (nor, so, its traceback)."""
        if self.last is not None and self.last.exception is not None:
            self.last = self.last.without_exception()


_recorders: dict[int, FailureRecorder] = {}


def recorder_for(shell: InteractiveShell) -> FailureRecorder | None:
    return _recorders.get(id(shell))


def _cell_number(shell: InteractiveShell, filename: str) -> int | None:
    mapping = getattr(getattr(shell, "compile", None), "_filename_map", None)
    if isinstance(mapping, dict):
        number = mapping.get(filename)
        if isinstance(number, int):
            return number
    return None


def input_history(shell: InteractiveShell) -> list[str]:
    """The raw input history: index ``k`` holds the source of ``In[k]`` as the user typed it."""
    history = getattr(getattr(shell, "history_manager", None), "input_hist_raw", None)
    if history is None:
        history = shell.user_ns.get("In")
    return [str(cell) for cell in history] if isinstance(history, list) else []


def _cell_source(shell: InteractiveShell, number: int) -> str | None:
    history = input_history(shell)
    if 0 < number < len(history):
        return history[number]
    return None


def _tracebacks(error: BaseException) -> Iterator[types.TracebackType]:
    for linked in exception_chain(error):
        if linked.__traceback__ is not None:
            yield linked.__traceback__


def _failed_cell_of(shell: InteractiveShell, error: BaseException) -> tuple[str | None, int | None]:
    """The outermost frame whose code came from a cell is the cell that ran; its number gives its source."""
    tb = error.__traceback__
    while tb is not None:
        number = _cell_number(shell, tb.tb_frame.f_code.co_filename)
        if number is not None:
            return _cell_source(shell, number), number
        tb = tb.tb_next
    return None, None


def last_failure(shell: InteractiveShell) -> Failure | None:
    """The last failed cell the user ran, or ``None`` when none is known (see the module docstring)."""
    recorder = recorder_for(shell)
    if recorder is not None and recorder.last is not None:
        return recorder.last
    result = getattr(shell, "last_execution_result", None)
    error = getattr(result, "error_in_exec", None)
    if error is not None and not _is_usage_error(error):
        info = getattr(result, "info", None)
        return Failure.of(error, getattr(info, "raw_cell", None), getattr(result, "execution_count", None))
    error = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if error is None or _is_usage_error(error):
        return None
    source, number = _failed_cell_of(shell, error)
    return Failure.of(error, source, number)


def user_variables(shell: InteractiveShell) -> dict[str, Any]:
    """The user's namespace without what IPython put there at start-up (``user_ns_hidden``)."""
    hidden = getattr(shell, "user_ns_hidden", {})
    missing = object()
    return {name: value for name, value in shell.user_ns.items() if hidden.get(name, missing) is not value}


def _known_exceptions(shell: InteractiveShell, exception: BaseException | None) -> list[BaseException]:
    found: list[BaseException] = []
    recorder = recorder_for(shell)
    result = getattr(shell, "last_execution_result", None)
    candidates = [
        exception,
        recorder.last.exception if recorder is not None and recorder.last is not None else None,
        *map(vars(sys).get, ("last_exc", "last_value")),  # a dict's get: a missing module attribute costs 1.5 µs
        getattr(result, "error_in_exec", None),
        getattr(result, "error_before_exec", None),
    ]
    for candidate in candidates:
        if isinstance(candidate, BaseException) and all(candidate is not f for f in found):
            found.append(candidate)
    return found


def _frame_label(frame: types.FrameType) -> str:
    code = frame.f_code
    return f"{getattr(code, 'co_qualname', code.co_name)}()"


def _output_cache(shell: InteractiveShell) -> dict[Any, Any] | None:
    cache = shell.user_ns.get("_oh")
    if not isinstance(cache, dict):
        cache = getattr(getattr(shell, "history_manager", None), "output_hist", None)
    return cache if isinstance(cache, dict) else None


def ipython_references(shell: InteractiveShell) -> list[Reference]:
    """Everything IPython itself keeps that can hold the user's memory, each with its origin.

    The failed cell's traceback frames (function frames only: the cell's own frame has the user
    namespace as its locals) are listed one by one, so a report can say which function's locals hold
    the memory.
    """
    refs = [Reference(name, origin, value) for name, origin, value in _exception_values(shell)]
    refs.extend(_output_references(shell))
    refs.extend(_frame_references(_known_exceptions(shell, None)))
    return refs


_Kept = tuple[str, Origin, object]
"""One value IPython keeps: its name, its origin, the value."""

_RESULT_ATTRIBUTES = (("error_in_exec", Origin.EXCEPTION), ("error_before_exec", Origin.EXCEPTION),
                      ("result", Origin.OUTPUT_CACHE))


def _exception_values(shell: InteractiveShell) -> list[_Kept]:
    """``sys.last_*``, the last execution result's error and value, the traceback handlers' ``tb``: what
    ``ipython_references`` names and ``ipython_reference_ids`` counts, read in this one place."""
    kept: list[_Kept] = []
    found = vars(sys)  # a dict's get: a missing module attribute costs 1.5 µs, asked before every measured cell
    for name in _SYS_ATTRIBUTES[:3]:
        if (value := found.get(name)) is not None:
            kept.append((f"sys.{name}", Origin.EXCEPTION, value))
    result = getattr(shell, "last_execution_result", None)
    for attribute, origin in _RESULT_ATTRIBUTES:
        if (value := getattr(result, attribute, None)) is not None:
            kept.append((f"last_execution_result.{attribute}", origin, value))
    for handler in ("InteractiveTB", "SyntaxTB"):
        if (value := getattr(getattr(shell, handler, None), "tb", None)) is not None:
            kept.append((f"{handler}.tb", Origin.EXCEPTION, value))
    return kept


def _display_hook_values(shell: InteractiveShell) -> list[_Kept]:
    """The display hook's ``_``, ``__``, ``___`` (an empty one is ``''``)."""
    kept: list[_Kept] = []
    displayhook = getattr(shell, "displayhook", None)
    for name in OUTPUT_CACHE_NAMES:  # loops, not comprehensions: each costs a frame a cell
        value = getattr(displayhook, name, None)
        if value is not None and not isinstance(value, str):
            kept.append((name, Origin.OUTPUT_CACHE, value))
    return kept


def _output_references(shell: InteractiveShell) -> list[Reference]:
    """The output cache (``Out[N]`` and its ``_N``) and the display hook's ``_``, ``__``, ``___``."""
    refs: list[Reference] = []
    cache = _output_cache(shell)
    if cache is not None:
        for number, value in list(cache.items()):
            refs.append(Reference(f"Out[{number}]", Origin.OUTPUT_CACHE, value))
            if shell.user_ns.get(f"_{number}") is value:
                refs.append(Reference(f"_{number}", Origin.OUTPUT_CACHE, value))
    refs.extend(Reference(name, origin, value) for name, origin, value in _display_hook_values(shell))
    return refs


def ipython_reference_ids(shell: InteractiveShell, outputs: OutputIds | None = None) -> frozenset[int]:
    """The ids of what ``ipython_references`` lists, read without naming any (what a snapshot before each measured
    cell keeps, where making a ``Reference`` of each cost more than the reading): the frames only where an
    exception is kept, the output cache's through ``outputs`` where given, which keeps them from call to call."""
    ids = {id(value) for _, _, value in _exception_values(shell)}
    for _, _, value in _display_hook_values(shell):
        ids.add(id(value))
    known = _known_exceptions(shell, None)
    if known:
        ids.update(id(reference.value) for reference in _frame_references(known))
    cache = _output_cache(shell)
    if cache is None:
        return frozenset(ids)
    if outputs is None:
        ids.update(map(id, list(cache.values())))
        return frozenset(ids)
    kept = outputs.of(cache)
    return kept if ids <= kept else kept | ids  # ``_`` and the last result are outputs: mostly no copy


def _frame_references(errors: list[BaseException]) -> list[Reference]:
    """The frames of functions on the errors' tracebacks, one each, but the cell's, ours and IPython's."""
    refs: list[Reference] = []
    counts: dict[str, int] = {}
    seen: set[int] = set()
    for error in errors:
        for first in _tracebacks(error):
            tb: types.TracebackType | None = first
            while tb is not None:
                frame = tb.tb_frame
                module = str(frame.f_globals.get("__name__", ""))
                ours = module.startswith(_MACHINERY_MODULES) or module.startswith("jupyter_cudamem.")
                if frame.f_code.co_name != "<module>" and not ours and id(frame) not in seen:
                    seen.add(id(frame))
                    label = _frame_label(frame)
                    counts[label] = counts.get(label, 0) + 1
                    refs.append(Reference(label, Origin.FRAME, frame, counts[label]))
                tb = tb.tb_next
    return refs


def cell_references(shell: InteractiveShell, value: object = None, error: BaseException | None = None) -> list[Reference]:
    """What IPython keeps, plus what a cell run inside a magic has not handed to IPython yet: its
    value (about to enter the output cache as ``Out[N]``) and its exception with its frames."""
    refs = ipython_references(shell)
    if value is not None:
        count = getattr(getattr(shell, "displayhook", None), "prompt_count", None)
        name = f"Out[{count}]" if isinstance(count, int) else "the cell's value"
        refs.append(Reference(name, Origin.OUTPUT_CACHE, value))
    if error is not None:
        refs.append(Reference("the cell's exception", Origin.EXCEPTION, error))
        refs.extend(_frame_references([error]))
    return refs


_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
"""A generator's or coroutine's frame: it may be paused, and before Python 3.13 clearing a paused one
finalizes it (the user's stream would end); a finished one goes with the traceback detached after."""


def _clear_traceback(tb: types.TracebackType | None, cleared: list[str]) -> None:
    """Drop every frame's locals (a frame still executing cannot be cleared, a generator's is left: see
    ``_RESUMABLE``), and before Python 3.13 the snapshot of them a read of ``f_locals`` left on a function
    frame, which reading it again empties."""
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_flags & _RESUMABLE:
            tb = tb.tb_next
            continue
        try:
            frame.clear()
        except RuntimeError:
            pass
        else:
            if frame.f_code.co_flags & inspect.CO_OPTIMIZED:  # a module frame's locals are the namespace
                frame.f_locals  # noqa: B018  read for its effect: the snapshot loses what clear() dropped
            module = str(frame.f_globals.get("__name__", ""))
            if frame.f_code.co_name != "<module>" and not module.startswith(_MACHINERY_MODULES):
                label = _frame_label(frame)
                if label not in cleared:
                    cleared.append(label)
        tb = tb.tb_next


def release_ipython_references(
    shell: InteractiveShell,
    exception: BaseException | None = None,
    *,
    holds_cuda: Callable[[object], bool],
) -> list[str]:
    """Release everything IPython keeps from the failed cell; never a user variable.

    Clears the frames of every known failed exception's traceback chain (``exception``, the
    recorder's, ``sys.last_*``, the last execution result's), detaches tracebacks and chained
    exceptions, removes ``sys.last_*``, the execution result's error, ``InteractiveTB.tb`` and
    ipykernel's ``_last_traceback``, and the output-cache entries that reach CUDA memory (``holds_cuda``:
    this module knows what IPython keeps, not what reaches a tensor). Afterwards ``%debug`` has no traceback to open.
    Returns one line per thing released.
    """
    released = _release_tracebacks(shell, exception)
    released.extend(_release_last_error(shell, holds_cuda))
    released.extend(release_output_cache(shell, holds_cuda))
    return released


def _release_tracebacks(shell: InteractiveShell, exception: BaseException | None) -> list[str]:
    """Clear the frames of every known failed exception's chain, and detach its tracebacks and links."""
    released: list[str] = []
    frames: list[str] = []
    chained = 0
    for error in _known_exceptions(shell, exception):
        for linked in list(exception_chain(error)):
            _clear_traceback(linked.__traceback__, frames)
            linked.__traceback__ = None
            if linked is not error:
                chained += 1
        error.__cause__ = None
        error.__context__ = None
    recorder = recorder_for(shell)
    if recorder is not None:
        recorder.drop_exception()
    if frames:
        released.append(f"locals of {', '.join(frames)} in the failed cell's traceback")
    if chained:
        released.append(f"{chained} chained exception{'s' if chained > 1 else ''} (__cause__/__context__)")
    return released


def _release_last_error(shell: InteractiveShell, holds_cuda: Callable[[object], bool]) -> list[str]:
    """Remove ``sys.last_*``, the last execution result's error (and its value where it reaches CUDA
    memory), the traceback handlers' ``tb`` and ipykernel's last formatted traceback."""
    released: list[str] = []
    present = [name for name in _SYS_ATTRIBUTES if getattr(sys, name, None) is not None]
    for name in _SYS_ATTRIBUTES:
        if hasattr(sys, name):
            delattr(sys, name)
    if present:
        released.append(", ".join(f"sys.{name}" for name in present))

    result = getattr(shell, "last_execution_result", None)
    if result is not None:
        if getattr(result, "error_in_exec", None) is not None:
            result.error_in_exec = None
            released.append("the last execution result's error")
        if getattr(result, "result", None) is not None and holds_cuda(result.result):
            result.result = None
            released.append("the last execution result's value")

    for handler in ("InteractiveTB", "SyntaxTB"):
        owner = getattr(shell, handler, None)
        if owner is not None and getattr(owner, "tb", None) is not None:
            owner.tb = None
            released.append(f"{handler}.tb")
    if getattr(shell, "_last_traceback", None) is not None:  # ipykernel's shell only
        setattr(shell, "_last_traceback", None)  # noqa: B010 - not an attribute of IPython's own shell
        released.append("the kernel's last formatted traceback")
    return released


def release_output_cache(shell: InteractiveShell, holds_cuda: Callable[[object], bool]) -> list[str]:
    """Drop the output-cache entries (``Out``, ``_N``, ``_``...) that reach CUDA memory (``holds_cuda``);
    one line per entry released."""
    user_ns = shell.user_ns
    hidden = getattr(shell, "user_ns_hidden", {})
    displayhook = getattr(shell, "displayhook", None)
    doomed: list[object] = []
    released = _release_numbered_outputs(shell, holds_cuda, doomed)
    for name in OUTPUT_CACHE_NAMES:
        value = getattr(displayhook, name, None)
        if value is None or isinstance(value, str):
            continue
        if any(value is d for d in doomed) or holds_cuda(value):
            setattr(displayhook, name, "")
            if user_ns.get(name) is value:
                user_ns[name] = ""
            # ``shell.push(..., interactive=False)`` also records them in ``user_ns_hidden``, which
            # ``displayhook.flush()`` forgets: that copy alone kept a returned tensor alive (tests/gpu/test_oomfix_free_gpu.py).
            if hidden.get(name) is value:
                hidden[name] = ""
            released.append(f"{name} (output cache)")
    return released


def _release_numbered_outputs(
    shell: InteractiveShell, holds_cuda: Callable[[object], bool], doomed: list[object]
) -> list[str]:
    """Drop ``Out[N]`` (and its ``_N``) where it reaches CUDA memory, adding each value dropped to ``doomed``."""
    released: list[str] = []
    user_ns = shell.user_ns
    hidden = getattr(shell, "user_ns_hidden", {})
    cache = _output_cache(shell)
    if cache is None:
        return released
    for number, value in list(cache.items()):
        if not holds_cuda(value):
            continue
        doomed.append(value)
        also = []
        del cache[number]
        key = f"_{number}"
        if user_ns.get(key) is value:
            del user_ns[key]
            also.append(key)
        if hidden.get(key) is value:
            del hidden[key]
        released.append(f"Out[{number}]" + (f" (also {', '.join(also)})" if also else ""))
    return released


_UNDERSCORES = ("_", "__", "___")
_NUMBERED = re.compile(r"_\d+")


def release_flushed_underscores(shell: InteractiveShell, numbered: bool = True) -> list[str]:
    """After ``%reset -f out``, drop the old values IPython still keeps under ``_``, ``__``, ``___``.

    IPython's display hook binds those names in the user namespace *and* in ``user_ns_hidden``; its
    ``flush()`` (what ``%reset -f out`` calls) resets the display hook and the namespace to ``''`` but
    not ``user_ns_hidden``, so the last values shown stay alive (a GPU tensor keeps its memory: seen in
    ``notebooks/02_finding_leaks.ipynb``, 128 MiB held into the next cell), and since the hidden and
    visible values then differ, IPython stops updating ``_`` at all. Where the display hook and the
    namespace agree on a name and the hidden entry does not, the hidden entry takes their value, as
    after any display. A name the user bound themselves (the namespace differs from the display hook)
    is left alone. ``numbered=False``: only ``_``, ``__`` and ``___`` (the numbered names take a pass over
    ``user_ns_hidden``). Returns the names released.
    """
    displayhook = getattr(shell, "displayhook", None)
    namespace, hidden = getattr(shell, "user_ns", None), getattr(shell, "user_ns_hidden", None)
    if displayhook is None or not isinstance(namespace, dict) or not isinstance(hidden, dict):
        return []
    released = []
    for name in _UNDERSCORES:
        if name not in namespace or name not in hidden or not hasattr(displayhook, name):
            continue
        value = namespace[name]
        if value is getattr(displayhook, name) and hidden[name] is not value:
            hidden[name] = value
            released.append(name)
    # IPython 8 also keeps the numbered names (``_1``) there after ``flush()`` took them out of the namespace.
    if not numbered:
        return released
    for name in [key for key in hidden if _NUMBERED.fullmatch(key) and key not in namespace]:
        del hidden[name]
        released.append(name)
    return released


def release_flushed_underscores_after_cell(shell: InteractiveShell) -> Callable[..., None]:
    """A ``post_run_cell`` callback running ``release_flushed_underscores``; it never raises into the kernel.

    The numbered names are looked for only after the output cache lost entries (``flush()`` clears it,
    IPython drops the oldest once it is full, ``%xdel`` takes one out): ``user_ns_hidden`` gains an ``_iN``
    for every cell run, and a pass over it costs about 1.6 ms a cell after 1,000 cells with outputs."""
    # The cache's size and newest key after the cell before: a cell adds at most one output, at the end.
    # None: the first cell looks (a flush may have come before the extension was loaded).
    seen: list[tuple[int, Any] | None] = [None]

    def after_cell(result: ExecutionResult | None = None) -> None:
        try:
            cache = _output_cache(shell)
            now = None if cache is None else (len(cache), next(reversed(cache), None))
            before, seen[0] = seen[0], now
            lost = now is None or before is None or now[0] < before[0] + (now[1] != before[1])
            release_flushed_underscores(shell, numbered=lost)
        except Exception:  # noqa: BLE001  IPython's internals changed: keep the cell's outcome intact
            pass

    return after_cell
