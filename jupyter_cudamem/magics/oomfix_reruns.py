"""``%oomfix``'s reruns through the shell: each try runs as IPython input (so ``!cmd`` and magics work),
and its out-of-memory error, an expected outcome of a try, is recorded instead of printed."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ..oom import OomInfo, parse_oom

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

_ABSENT = object()


class ShellReruns:
    """Runs a fix's tries on ``shell`` and hands the driver each try's OOM, parsed once."""

    def __init__(self, shell: InteractiveShell):
        self.shell = shell
        # The last rerun's exception (by id: no reference to its frames) and its OOM, parsed once by the
        # hook that hides its traceback, for the driver to read (``oom_of``).
        self._try_oom: tuple[int, OomInfo | None] | None = None

    def run_source(self, source: str) -> BaseException | None:
        """Run IPython input through the shell (so ``!cmd`` and magics work); return its exception."""
        with self.quiet_oom_tracebacks():
            result = self.shell.run_cell(source, store_history=False)
        return result.error_in_exec if result.error_in_exec is not None else result.error_before_exec

    def oom_of(self, error: BaseException) -> OomInfo | None:
        """A rerun's OOM as ``showtraceback`` parsed it (the driver still holds ``error``, so its id is
        its own), else parsed now; read once."""
        seen, self._try_oom = self._try_oom, None
        return seen[1] if seen is not None and seen[0] == id(error) else parse_oom(error)

    def forget(self) -> None:
        """The fix is over: keep nothing of its last try."""
        self._try_oom = None

    @contextmanager
    def quiet_oom_tracebacks(self) -> Iterator[None]:
        """While rerunning, an OOM is an expected outcome of a try: record it, do not print its traceback."""
        shell = self.shell
        before = vars(shell).get("showtraceback", _ABSENT)  # an instance attribute someone set, or none
        original = shell.showtraceback

        def showtraceback(*args: Any, **kwargs: Any) -> Any:
            # A magic that shows its body's error itself (a rerun of a %%cudamem cell) hands it over as
            # ``exc_tuple``; IPython's own callers leave it in sys.exc_info().
            given = args[0] if args else kwargs.get("exc_tuple")
            error = given[1] if isinstance(given, tuple) and len(given) == 3 else sys.exc_info()[1]
            oom = None if error is None else parse_oom(error)
            if error is not None:
                self._try_oom = (id(error), oom)  # the driver reads it next (``oom_of``)
            if oom is not None:
                return None
            return original(*args, **kwargs)

        vars(shell)["showtraceback"] = showtraceback
        try:
            yield
        finally:
            if before is _ABSENT:
                vars(shell).pop("showtraceback", None)  # the class's method shows again
            else:
                vars(shell)["showtraceback"] = before  # what was there before us
