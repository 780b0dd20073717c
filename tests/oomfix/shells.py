"""A clean test shell for the %oomfix tests."""

from __future__ import annotations

import sys

from IPython.core.interactiveshell import InteractiveShell


def shell_without_failures() -> InteractiveShell:
    """The process-wide test shell with no failure left over from other tests (sys.last_*, tracebacks)."""
    shell = InteractiveShell.instance()
    shell.reset(new_session=False)
    for name in ("last_exc", "last_value", "last_traceback", "last_type"):
        if hasattr(sys, name):
            delattr(sys, name)
    shell.InteractiveTB.tb = None
    return shell
