"""What every magics class of ours shares: the hardware, one-line errors, and a clean close."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from IPython.core.error import UsageError
from IPython.core.magic import Magics
from IPython.display import display

from ..errors import CudaMemError
from ..hardware import Hardware
from ..units import whole_number

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

    from ..report import CellReport
    from . import Extension

P = ParamSpec("P")
R = TypeVar("R")


class RaisedAtTheMagic(Exception):
    """Carries a user's error up to ``one_line_errors``, which raises it there with ``traceback`` (the body's own
    frames): a ``SyntaxError`` (a body that does not compile, in a cell with code around the magic, or one the
    body raised) or an exception group, whose every frame IPython prints, ``__tracebackhide__`` or not; and an
    error with no frame of the body's, where IPython shows the last frame, hidden or not. Raised from the
    magic's own frame, one frame of ours is shown (``%time`` shows two of its own)."""

    def __init__(self, error: BaseException, traceback: TracebackType | None = None):
        super().__init__(error)
        self.error = error
        self.traceback = traceback


def one_line_errors(method: Callable[P, R]) -> Callable[P, R]:
    """Turn our ``CudaMemError`` into IPython's ``UsageError``: one red line, no traceback; and raise a
    body's ``SyntaxError`` from here (``RaisedAtTheMagic``), out of the ``except``, so that the user's error keeps
    its own context and gets none of ours."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        __tracebackhide__ = True  # noqa: F841 - read by IPython's traceback printer
        try:
            return method(*args, **kwargs)
        except CudaMemError as error:
            raise UsageError(str(error)) from None
        except RaisedAtTheMagic as raised:
            carried = raised
        raise carried.error.with_traceback(carried.traceback)

    return wrapper


def note(message: str) -> None:
    """A one-line warning: what could not be measured or done (stderr, where a plain cell's output stays as
    it would be without us)."""
    print(f"cudamem: {message}", file=sys.stderr)


def show_report(shell: InteractiveShell, report: CellReport) -> None:
    """``display(report)``, the same bundle made directly: the text and, where the front end takes it,
    the HTML. IPython's display formatters ask each of their dozen formatters in turn, and that took
    most of the time a shown ``%%cudamem`` report cost; ours answers two."""
    formatter = shell.display_formatter
    if formatter is None:
        display(report)
        return
    html = formatter.formatters.get("text/html")
    bundle = {"text/plain": report.text()}
    if html is not None and html.enabled and "text/html" in formatter.active_types:
        bundle["text/html"] = report._repr_html_()
    display(bundle, raw=True)


def current_cell_number(shell: InteractiveShell) -> int | None:
    """The ``In[N]`` of the cell running now.

    IPython 9 increments ``execution_count`` before running a cell, IPython 8 after; the display
    hook's ``prompt_count`` is the current cell's number in both.
    """
    displayhook = getattr(shell, "displayhook", None)
    count = getattr(displayhook, "prompt_count", None)
    return count if isinstance(count, int) else getattr(shell, "execution_count", None)


def parse_devices(text: str | Sequence[int], option: str = "--devices") -> tuple[int, ...]:
    """``"0,1"`` -> ``(0, 1)``: PyTorch's ``cuda:N`` numbers, for the magic's ``option``."""
    if not isinstance(text, str):
        values = list(text)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise CudaMemError(f"devices must be CUDA device numbers such as [0, 1], got {values!r}")
        return tuple(dict.fromkeys(values))
    numbers = [whole_number(token.strip().removeprefix("cuda:")) for token in text.split(",")]
    if not all(number is not None for number in numbers):
        raise CudaMemError(
            f"{option} takes CUDA device numbers separated by commas, such as {option} 0,1; got {text!r}"
        )
    return tuple(dict.fromkeys(number for number in numbers if number is not None))


class CudaMemMagicsBase(Magics):
    """A ``Magics`` that measures through a shared ``Hardware`` and can be closed on unload."""

    shell: InteractiveShell  # IPython types it Optional; ours always have one

    def __init__(self, shell: InteractiveShell, hardware: Hardware, extension: Extension, **kwargs: object):
        super().__init__(shell=shell, **kwargs)
        self.hardware = hardware
        self.extension = extension  # the ``magics.Extension`` this belongs to, to find siblings

    def note(self, message: str) -> None:
        """A one-line warning (``note``)."""
        note(message)

    def tell(self, message: str) -> None:
        """A one-line answer to what the user asked (a monitor stopped, one not running): stdout, not the
        red of an error."""
        print(f"cudamem: {message}")

    def close(self) -> None:
        """Undo whatever this class started (threads, event callbacks). Called on unload."""
