"""Run a cell body inside a magic exactly the way IPython runs a plain cell.

IPython's own steps, in its order (``InteractiveShell.run_cell_async``, ``run_ast_nodes``, ``run_code``):
IPython syntax is transformed (``!cmd``, ``%magic``), the source is parsed under the cell's cached name
(so tracebacks show its lines), AST transformers apply, then each top-level statement is compiled and
run on its own: a statement that does not compile (``return`` outside a function) stops the cell after
the ones before it ran, as in a plain cell. The last expression is compiled in ``single`` mode, and
top-level ``await`` is allowed where IPython allows it.

What differs from ``run_cell`` is only *when* things are shown: the caller measures between running
and showing. ``Ran.show_values`` shows the last expression's value through the display hook (with
IPython's own rule for a trailing ``;``). ``Ran.fail`` raises the user's error from the magic, as
``%time`` does, so the code around the magic stops (``%cudamem 1/0`` then ``print``; ``try:``/``except``
around it; ``run_line_magic`` from code); where the magic is the whole cell (a ``%%cudamem`` cell the
user ran) nothing of theirs follows, and it shows the error as a plain cell shows it instead (same
traceback, none of the magic's frames, same ``SystemExit`` note) and marks the cell as failed, so
``error_in_exec`` is set and a notebook run that stops on errors stops there. So does a line form that stands
alone in its cell and does not compile (``%cudamem def f(:``): IPython prints every frame a raised
``SyntaxError`` passed through, where a plain cell shows the error alone.
"""

from __future__ import annotations

import ast
import asyncio
import bdb
import inspect
import io
import os
import sys
import threading
import tokenize
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import CodeType, FrameType, TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

from .base import CudaMemMagicsBase, RaisedAtTheMagic, current_cell_number

if TYPE_CHECKING:
    from IPython.core.interactiveshell import ExecutionInfo, InteractiveShell
    from traitlets.utils.bunch import Bunch

NO_VALUE = object()

# How a plain cell shows each kind of failure (see ``Ran.fail``).
_SYNTAX = "syntax"  # the cell did not parse: showsyntaxerror(), no frames
_BEFORE = "before"  # a statement did not compile, or the input transformers failed: showtraceback()
_EXIT = "exit"  # SystemExit: the exception only, and IPython's "To exit" note
_QUIT = "quit"  # bdb.BdbQuit: shown by the debugger already
_CUSTOM = "custom"  # one of shell.custom_exceptions: the user's handler
_RAISED = "raised"  # anything else, KeyboardInterrupt included: the full traceback


@dataclass
class Ran:
    """What running a body did: its displayable values and its error, not yet shown."""

    started: bool  # False when the body ran no statement: it did not transform, parse or compile
    values: list[object] = field(default_factory=list)
    quiet: bool = False  # a trailing ';' (IPython's rule): show no value
    error: BaseException | None = None
    kind: str = ""
    traceback: TracebackType | None = None

    @property
    def value(self) -> object:
        """The last value the body would display (``NO_VALUE`` for none or a trailing ``;``)."""
        return self.values[-1] if self.values and not self.quiet else NO_VALUE

    def show_values(self, shell: InteractiveShell) -> None:
        """Display the values as a plain cell does: ``Out[N]``, ``_`` and the rest through the display hook."""
        if self.quiet:
            return
        for value in self.values:
            shell.displayhook(value)

    def fail(self, shell: InteractiveShell, frames: bool = True) -> None:
        """Raise the user's error from the magic; where the magic is the whole running cell, show it as a
        plain cell shows it and mark the cell as failed instead (see ``error_is_raised``).

        ``frames=False``: the exception without its frames (they were cleared to free what they held).
        """
        __tracebackhide__ = True  # noqa: F841 - hides this frame in IPython tracebacks
        error, kind, traceback = self.error, self.kind, self.traceback
        if error is None:
            return
        # A body that does not compile has no frame worth showing; IPython prints every frame a raised
        # SyntaxError passed through, so where nothing of the user's follows the magic it is shown, not raised.
        compiles = kind != _SYNTAX and not (kind == _BEFORE and isinstance(error, SyntaxError))
        if error_is_raised(shell) and (compiles or not _line_magic_is_the_cell(shell)):
            _raise(error, traceback if compiles and frames else None)
        result = shell.displayhook.exec_result
        result.error_in_exec = error
        _failed_after_all(shell)
        # The error carries every frame it passed on its way up (a plan's runs): exception groups and
        # SyntaxErrors are printed from it, not from ``traceback``.
        error.__traceback__ = traceback
        # IPython's printers read the error from sys.exc_info(), else from sys.last_*: set the latter
        # (as showing it would), so they show the user's error wherever this is called from.
        sys.last_type, sys.last_value, sys.last_traceback = type(error), error, traceback
        if sys.version_info >= (3, 12):
            sys.last_exc = error
        exc_tuple = (type(error), error, traceback)
        if kind == _SYNTAX:
            shell.showsyntaxerror()
        elif kind == _BEFORE:
            shell.showtraceback(exc_tuple)
        elif kind == _EXIT:
            shell.showtraceback(exc_tuple, exception_only=True)
            warnings.warn("To exit: use 'exit', 'quit', or Ctrl-D.", stacklevel=_first_level_outside_us())
        elif not frames:
            shell.showtraceback(exc_tuple, tb_offset=0, exception_only=True)
        elif kind == _CUSTOM:
            shell.CustomTB(*exc_tuple)
        elif kind == _RAISED:
            # tb_offset=0: the traceback starts at the cell's own frame already (see ``_from_cell``).
            shell.showtraceback(exc_tuple, tb_offset=0, running_compiled_code=True)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _first_level_outside_us() -> int:
    """The ``stacklevel`` that makes a warning of our caller name the first frame outside this package (the
    IPython frame that called the magic), where a plain cell's names IPython's: never a line of ours."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def _raise(error: BaseException, traceback: TracebackType | None) -> NoReturn:
    """Raise the user's ``error`` with its ``traceback``; where IPython would print every frame it passes through
    (an exception group, a ``SyntaxError``) or the last one, hidden or not (no ``traceback``), the magic raises
    it from its own frame (``RaisedAtTheMagic``): one frame of ours shown, not every one."""
    __tracebackhide__ = True  # noqa: F841
    if traceback is None or isinstance(error, (SyntaxError, BaseExceptionGroup)):
        raise RaisedAtTheMagic(error, traceback)
    raise error.with_traceback(traceback)


# Bodies of ours running now, nested magics included: a magic called inside one is never the whole cell.
_bodies_running = 0


def error_is_raised(shell: InteractiveShell) -> bool:
    """Whether a body's error is raised from the magic (``Ran.fail``): always, but where the magic is the
    whole cell IPython is running (``whole_cell``).

    There nothing of the user's runs after the magic returns, so showing the error and marking the cell
    failed is what raising it would do, with the traceback of a plain cell (no ``run_cell_magic`` line).
    """
    return whole_cell(shell) is None


def whole_cell(shell: InteractiveShell) -> ExecutionInfo | None:
    """IPython's record of the running cell where that cell is one cell magic of ours the user ran, with
    no body of ours around it (nothing of the user's ran before it, nothing runs after); else ``None``."""
    running = _running_cell(shell)
    first = running[1].lstrip().split(None, 1) if running is not None else None
    if running is None or not first or not first[0].startswith("%%") or not hasattr(shell, "find_cell_magic"):
        return None
    return running[0] if _ours(shell.find_cell_magic(first[0][2:])) else None


def _line_magic_is_the_cell(shell: InteractiveShell) -> bool:
    """Whether the cell IPython is running is one line magic of ours and nothing else (``%cudamem def f(:``):
    nothing of the user's runs after it, so showing its body's error and failing the cell is what raising
    it would do."""
    running = _running_cell(shell)
    if running is None:
        return False
    try:
        body = ast.parse(shell.transform_cell(running[1])).body
    except Exception:  # noqa: BLE001 - not a cell that is one line magic
        return False
    name = _line_magic_called(body[0]) if len(body) == 1 else None
    return _ours(shell.find_line_magic(name) if name is not None else None)


def _running_cell(shell: InteractiveShell) -> tuple[ExecutionInfo, str] | None:
    """IPython's record of the cell it is running and its source, where no body of ours runs (a magic
    inside one is never the whole cell); ``None`` too where it keeps no source."""
    info = getattr(getattr(getattr(shell, "displayhook", None), "exec_result", None), "info", None)
    source = getattr(info, "raw_cell", None)
    if _bodies_running or info is None or not isinstance(source, str):
        return None
    return info, source


def _ours(magic: object) -> bool:
    """Whether ``magic`` (a bound magic function, or ``None``) is one of this extension's."""
    return isinstance(getattr(magic, "__self__", None), CudaMemMagicsBase)


def _line_magic_called(statement: ast.stmt) -> str | None:
    """``name`` where ``statement`` is ``get_ipython().run_line_magic('name', ...)``, IPython's form of
    ``%name ...`` standing alone; ``None`` for any other statement."""
    call = statement.value if isinstance(statement, ast.Expr) else None
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute) or call.func.attr != "run_line_magic":
        return None
    owner = call.func.value
    if not (isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "get_ipython"):
        return None
    name = call.args[0] if call.args else None
    return name.value if isinstance(name, ast.Constant) and isinstance(name.value, str) else None


def _failed_after_all(shell: InteractiveShell) -> None:
    """IPython sets ``last_execution_succeeded`` from its own view of the cell (no exception reached it)
    once the magic returns; correct it when it does.

    ``post_run_cell`` cannot: IPython does not send it for a ``silent`` cell, which is how
    ``ipython script.ipy`` runs every cell, and the script's exit status is that flag (a failed
    ``%%cudamem`` cell must make the script exit 1 as the same cell without the magic does). So the
    flag is set to False now, and an observer puts it back to False when the cell's end sets it True.
    """

    def correct(change: Bunch) -> None:
        if change.get("new"):
            shell.unobserve(correct, names="last_execution_succeeded")
            shell.last_execution_succeeded = False

    try:
        shell.last_execution_succeeded = False
        shell.observe(correct, names="last_execution_succeeded")
    except Exception:  # a shell that is not a HasTraits: the execution result itself is marked
        pass


def semicolon_at_end(source: str) -> bool:
    """IPython's display hook rule: the last token that is not a comment or newline is ``;``.

    IPython 8.14 and later have it as ``DisplayHook.semicolon_at_end_of_expression``; 8.12 keeps the
    same loop inside ``DisplayHook.quiet``, which reads the cell that holds our magic, not its body.
    """
    from IPython.core.displayhook import DisplayHook

    rule = getattr(DisplayHook, "semicolon_at_end_of_expression", None)
    try:
        if rule is not None:
            return bool(rule(source))
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return False
    for token in reversed(tokens):
        if token.type in (tokenize.ENDMARKER, tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
            continue
        return token.type == tokenize.OP and token.string == ";"
    return False


def _split(shell: InteractiveShell, nodes: list[ast.stmt]) -> tuple[list[ast.stmt], list[ast.stmt]]:
    """IPython's ``ast_node_interactivity``: which statements run in ``single`` mode (shown)."""
    interactivity = getattr(shell, "ast_node_interactivity", "last_expr")
    if not nodes:
        return [], []
    if interactivity == "last_expr_or_assign":
        last = nodes[-1]
        target: ast.expr | None = None
        if isinstance(last, ast.Assign) and len(last.targets) == 1:
            target = last.targets[0]
        elif isinstance(last, (ast.AugAssign, ast.AnnAssign)):
            target = last.target
        if isinstance(target, ast.Name):
            shown = ast.Expr(ast.Name(target.id, ast.Load()))
            ast.copy_location(shown, last)
            ast.fix_missing_locations(shown)
            nodes = [*nodes, shown]
        interactivity = "last_expr"
    if interactivity == "last_expr":
        interactivity = "last" if isinstance(nodes[-1], ast.Expr) else "none"
    if interactivity == "all":
        return [], nodes
    if interactivity == "last":
        return nodes[:-1], nodes[-1:]
    return nodes, []


def _run_coroutine(shell: InteractiveShell, coroutine: Awaitable[object]) -> object:
    """Top-level ``await``: IPython's loop runner where no event loop is running this thread (a terminal,
    a script); in a kernel, on an event loop of its own in a worker thread (see ``_await_beside``)."""
    __tracebackhide__ = True  # noqa: F841
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is None:  # outside the `except` above, so the user's errors carry no context of ours
        return shell.loop_runner(coroutine)
    return _await_beside(coroutine)


def _await_beside(coroutine: Awaitable[object]) -> object:
    """Run ``coroutine`` to completion on a new event loop in a worker thread, and wait for it.

    In a kernel a cell runs inside the kernel's event loop, and a magic is a plain call within it: the
    loop cannot run the body's coroutine until the magic returns, and cannot be re-entered. IPython runs a
    plain cell's top-level ``await`` by awaiting the whole cell; ``%%time`` does not run it at all. Here the
    coroutine gets a loop of its own: ``asyncio.sleep``, ``asyncio.gather`` of coroutines it starts,
    clients it opens all work; what is bound to the kernel's loop (a Task or Future made in an earlier
    cell) cannot be awaited from another loop, and says so in asyncio's words. An interrupt cancels it, and
    the body's ``CancelledError`` is raised, at the user's line, as ipykernel shows an interrupted plain cell.
    """
    __tracebackhide__ = True  # noqa: F841
    from ..sources.torch_state import carry_thread_state

    loop = asyncio.new_event_loop()
    outcome: dict[str, Any] = {}
    as_in_the_cell = carry_thread_state()  # torch's per-thread state: current device, grad mode

    async def body() -> object:
        try:
            return await coroutine
        except BaseException as error:  # noqa: BLE001 - the body's own, with its frames (a cancel's too)
            outcome["error"] = error
            raise

    def run() -> None:
        as_in_the_cell()
        asyncio.set_event_loop(loop)
        try:
            task = loop.create_task(body())
            outcome["task"] = task
            outcome["value"] = loop.run_until_complete(task)
        except BaseException as error:  # noqa: BLE001 - raised in the cell's thread
            outcome.setdefault("error", error)
        finally:
            asyncio.set_event_loop(None)
            loop.close()
            done.set()

    done = threading.Event()
    threading.Thread(target=run, name="cudamem-await", daemon=True).start()
    interrupted = _wait_for(done)
    if interrupted is not None:
        task = outcome.get("task")
        if task is not None:
            loop.call_soon_threadsafe(task.cancel)
        if _wait_for(done) is not None or "error" not in outcome:
            raise interrupted.with_traceback(None)
    if "error" in outcome:
        error = outcome.pop("error")
        raise error
    return outcome.get("value")


def _wait_for(done: threading.Event) -> KeyboardInterrupt | None:
    """Wait until ``done`` is set; the interrupt that stopped the wait, if one did. (An event, not
    ``Thread.join``: a join interrupted at the wrong moment leaves ``is_alive()`` False for a live thread.)"""
    try:
        while not done.wait(0.05):
            pass
    except KeyboardInterrupt as interrupt:
        return interrupt
    return None


def run_cell_body(shell: InteractiveShell, raw_cell: str) -> Ran:
    """Run ``raw_cell`` in the user namespace as a plain cell would; show nothing yet (see ``Ran``)."""
    __tracebackhide__ = True  # noqa: F841 - hides this frame in IPython tracebacks
    try:
        transformed = shell.transform_cell(raw_cell)
    except Exception as error:
        return Ran(False, error=error, kind=_BEFORE, traceback=error.__traceback__)
    compiler = shell.compile
    try:
        filename = compiler.cache(transformed, current_cell_number(shell) or 0, raw_code=raw_cell)
    except UnicodeError as error:  # IPython names a cell by a hash of its UTF-8, which a lone '\udcff' has not:
        return Ran(False, error=error, kind=_BEFORE)  # a plain cell fails there too, with no frame to show
    try:
        tree = compiler.ast_parse(transformed, filename=filename)
    except (OverflowError, SyntaxError, ValueError, TypeError, MemoryError) as error:
        return Ran(False, error=error, kind=_SYNTAX, traceback=error.__traceback__)
    try:
        tree = shell.transform_ast(tree)
    except Exception as error:  # InputRejected, or a transformer's own failure
        return Ran(False, error=error, kind=_BEFORE, traceback=error.__traceback__)
    executed, shown = _split(shell, list(tree.body))
    ran = Ran(False, quiet=bool(shown) and semicolon_at_end(transformed))  # tokenized only where a value shows
    flags = getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0) if getattr(shell, "autoawait", False) else 0
    steps: list[tuple[ast.stmt, str]] = [(node, "exec") for node in executed] + [(node, "single") for node in shown]
    for node, mode in steps:
        module: ast.mod = ast.Module([node], []) if mode == "exec" else ast.Interactive([node])
        try:
            if flags:
                with compiler.extra_flags(flags):
                    code = compiler(module, filename, mode)
            else:  # extra_flags(0) changes nothing, and its generator costs a few µs a statement
                code = compiler(module, filename, mode)
        except BaseException as error:  # a statement that parses but does not compile: stop here
            ran.error, ran.kind, ran.traceback = error, _BEFORE, error.__traceback__
            return ran
        ran.started = True
        if not _execute(shell, code, ran, capture=ran.values.append if mode == "single" else None):
            return ran
    return ran


def _execute(shell: InteractiveShell, code: CodeType, ran: Ran, capture: Callable[[Any], None] | None) -> bool:
    """IPython's ``run_code`` with the error kept for later: True when the statement ran."""
    # IPython's own marker (its ``run_code`` has it): this frame and all above are hidden, silently.
    __tracebackhide__ = "__ipython_bottom__"  # noqa: F841
    global _bodies_running
    is_async = bool(code.co_flags & inspect.CO_COROUTINE)
    old_excepthook, sys.excepthook = sys.excepthook, shell.excepthook
    old_displayhook = sys.displayhook
    if capture is not None:  # `single` mode prints through sys.displayhook: keep the value instead
        sys.displayhook = lambda value: None if value is None else capture(value)
    _bodies_running += 1
    try:
        try:
            if is_async:
                _run_coroutine(shell, eval(code, shell.user_global_ns, shell.user_ns))
            else:
                exec(code, shell.user_global_ns, shell.user_ns)
        finally:
            _bodies_running -= 1
            sys.excepthook = old_excepthook
            sys.displayhook = old_displayhook
    except SystemExit as error:
        ran.error, ran.kind = error, _EXIT
    except bdb.BdbQuit as error:
        ran.error, ran.kind = error, _QUIT
    except BaseException as error:
        custom = tuple(getattr(shell, "custom_exceptions", ()) or ())
        ran.error, ran.kind = error, (_CUSTOM if custom and isinstance(error, custom) else _RAISED)
    else:
        return True
    ran.traceback = _from_cell(ran.error.__traceback__, code.co_filename)
    return False


def _from_cell(traceback: TracebackType | None, filename: str) -> TracebackType | None:
    """The traceback from the cell's first frame on: a plain cell's shows none of the machinery that
    ran it (IPython hides its own ``run_code``; ours would read as a hidden frame)."""
    entry = traceback
    while entry is not None:
        if entry.tb_frame.f_code.co_filename == filename:
            return entry
        entry = entry.tb_next
    return traceback


class BodyRuns:
    """For a magic that runs its body several times and stops at the body's own error (``%%cudamem_plan``):
    ``run`` returns the value the body would display (``NO_VALUE`` for none) or raises its error;
    ``failure(error)`` is the ``Ran`` that raised it, so the magic shows it as a plain cell would
    (``Ran.fail``: the cell's traceback, none of the frames it passed through on its way up)."""

    def __init__(self, shell: InteractiveShell):
        self.shell = shell
        self._failed: Ran | None = None

    def run(self, raw_cell: str) -> object:
        __tracebackhide__ = True  # noqa: F841
        ran = run_cell_body(self.shell, raw_cell)
        if ran.error is not None:
            self._failed = ran
            raise ran.error.with_traceback(ran.traceback)
        return ran.value

    def failure(self, error: BaseException) -> Ran | None:
        """The run that raised ``error``, once (``None`` when ``error`` is not the body's own)."""
        ran, self._failed = self._failed, None
        return ran if ran is not None and ran.error is error else None
