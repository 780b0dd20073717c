"""Cell bodies of many forms, and what running one did, compared between a plain cell and our magics.

``bodies()`` builds the forms from parts (statements, last lines, failures, IPython syntax, odd
text) so that each test tries their combinations, not a fixed list. ``Observed`` is everything a
user can see or use after a cell: whether it failed and with what, its output (cell numbers and
colours normalised), the names it left and their values, ``_`` and whether ``Out`` grew.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any

# Statements that do something a cell might do; each leaves the namespace in a state the last
# lines below can read.
STATEMENTS = (
    "",
    "x = 1",
    "x = 1; y = 2",
    "def f(a):\n    return a * 2",
    "class C:\n    attr = 3\n    def m(self):\n        return self.attr",
    "import math",
    "global g\ng = 3",
    "x = 5\ndel x",
    "for i in range(3):\n    pass",
    "total = 0\nwhile total < 3:\n    total += 1",
    "with open(__import__('os').devnull) as fh:\n    pass",
    "squares = [i * i for i in range(5)]",
    "print('hi there')",
    "s = 'ünïcødé ✓ 🚀'",
    "try:\n    1 / 0\nexcept ZeroDivisionError:\n    caught = True",
    "@staticmethod\ndef decorated():\n    pass",
    "if True:\n    branch = 'yes'\nelse:\n    branch = 'no'",
    "a, *rest = range(4)",
    "lam = lambda: 0",
    "import asyncio\nawaited = await asyncio.sleep(0, result=7)",
)

# Last lines: displayed values, values hidden by `;` (with comments and spaces after it), nothing.
LAST_LINES = (
    "",
    "1 + 1",
    "'text'",
    "None",
    "[1, 2, 3]",
    "1 + 1;",
    "1 + 1;  # note",
    "1 + 1 ;   ",
    "1 + 1  # a comment",
    "1 + 1; # ;",
    "'a;b'",
    "'ends with ;'",
    "len('x;')",
    "(1,\n 2)",
    "print('printed')",
    "x = 7",
    "x = 7;",
    "# only a comment",
    "await asyncio.sleep(0, result='awaited')",
    "{'k': 'ü'}",
)

# Bodies that fail, in every way IPython knows.
FAILURES = (
    "1/0",
    "raise ValueError('boom')",
    "raise ValueError('outer') from KeyError('inner')",
    "try:\n    1/0\nexcept Exception:\n    raise RuntimeError('during handling')",
    "undefined_name_xyz",
    "def g():\n    return h()\ndef h():\n    return 1/0\ng()",
    "assert False, 'message'",
    "raise KeyboardInterrupt",
    "import sys\nsys.exit()",
    "import sys\nsys.exit(3)",
    "raise SystemExit('bye')",
    "x = (",
    "x = )",
    "def f():\nreturn 1",
    "if True:\n  a = 1\n    b = 2",
    "return 5",
    "yield 1",
    "nonlocal q",
    "before = 1\nreturn 5",
    "before = 1\nx = (",
    "f(**)",
    "'unterminated",
    "\"\"\"unterminated",
    "x = 1\n\tif x:\n  pass",
    "%%%bad",
    "%undefined_magic_xyz",
    "raise StopIteration",
    "raise BaseException('base')",
    "raise GeneratorExit",
    "class E(Exception):\n    def __str__(self):\n        return 'custom ü'\nraise E()",
    "import nonexistent_module_xyz",
    "exec('1/0')",
    "compile('x = (', 'f', 'exec')",
    "await asyncio.sleep(0)\n1/0",
)

# IPython's own syntax inside a body.
IPYTHON_SYNTAX = (
    "%env CUDAMEM_PLAIN_TEST=1",
    "lines = !echo hello\nlines[0]",
    "!echo shell",
    "%time z = 1",
    "%%time\nz = 2",
    "%who_ls",
    "len?",
    "z = 3\n%xdel z",
    "_ip = get_ipython()\n_ip is not None",
    "   x = 1\n   x + 1",  # indented as a whole: IPython removes the common indentation
    ">>> x = 4\n>>> x",  # a pasted prompt
)

ODD = (
    "",
    "\n",
    "   \n\n   ",
    "# only a comment",
    "\n\n# comment\n\n",
    "pass",
    ";",
    "x = 1;;",
    "'ü' * 3",
    "\ufeffx = 1",
    "x = [" + ", ".join(["1"] * 20000) + "]\nlen(x)",  # long and flat (a deep `1 + 1 + ...` breaks IPython itself)
    "\n".join(f"v{i} = {i}" for i in range(2000)) + "\nv1999",
    "s = '''" + "long line " * 2000 + "'''\nlen(s)",
    "print('\\x1b[31mred\\x1b[0m')",
    "x = 1\r\nx",
)


def bodies() -> list[str]:
    """Every combination of a statement and a last line, then the failures (alone and after a
    statement), IPython syntax and odd text."""
    found: list[str] = []
    for statement in STATEMENTS:
        for last in LAST_LINES:
            found.append("\n".join(part for part in (statement, last) if part))
    for failure in FAILURES:
        found.append(failure)
        found.append("import asyncio\nx = 1\n" + failure)
    found.extend(IPYTHON_SYNTAX)
    found.extend(ODD)
    return list(dict.fromkeys(found))


_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
_NUMBERS = (
    (re.compile(r"(In|Out|Cell In) ?\[\d+\]"), r"\1[N]"),
    (re.compile(r"<ipython-input-\d+-[0-9a-f]+>"), "<ipython-input>"),
    (re.compile(r"/tmp/ipykernel_\d+/\d+\.py"), "<cell file>"),
    (re.compile(r"at 0x[0-9a-f]+"), "at 0x…"),
    (re.compile(r"[0-9.]+(e[+-]?\d+)? ?(ms|µs|μs|us|ns|s)\b"), "T"),  # %time's figures
    # IPython shows its own run_code frame above a SyntaxError raised at run time (compile(), exec()):
    # machinery, not the user's; a magic's body shows the user's frames only.
    (re.compile(r"\n  File \S+IPython/core/interactiveshell\.py:\d+ in run_code\n    exec\(code_obj[^\n]*\n"), ""),
)
_WARNING_PLACE = re.compile(r"^\S+\.py:\d+: (\w*Warning): ", re.MULTILINE)


def normalise(text: str) -> str:
    text = _COLOUR.sub("", text)
    for pattern, replacement in _NUMBERS:
        text = pattern.sub(replacement, text)
    lines = [line for line in text.splitlines() if not line.lstrip().startswith(("warn(", "warnings.warn("))]
    return _WARNING_PLACE.sub(r"\1: ", "\n".join(lines))


def _shown(value: Any) -> str:
    text = repr(value)
    return re.sub(r" at 0x[0-9a-f]+", "", text)


@dataclass(frozen=True)
class Observed:
    success: bool
    error: str | None
    stdout: str
    stderr: str
    names: dict[str, str]
    underscore: str
    out_grew: bool

    @classmethod
    def run(cls, shell: Any, source: str, capsys: Any, baseline: dict[str, Any]) -> Observed:
        """Run ``source`` as a cell from the namespace ``baseline``; what a user sees and has after it."""
        _restore(shell, baseline)
        capsys.readouterr()
        out_before = len(shell.user_ns["Out"])
        result = shell.run_cell(source, store_history=True)
        captured = capsys.readouterr()
        error = result.error_before_exec if result.error_before_exec is not None else result.error_in_exec
        names = {
            name: _shown(value)
            for name, value in shell.user_ns.items()
            if not name.startswith("_") and name not in baseline and name not in ("In", "Out")
        }
        changed = {
            name: _shown(shell.user_ns.get(name, "<deleted>"))
            for name, value in baseline.items()
            if not name.startswith("_") and shell.user_ns.get(name, "<deleted>") is not value
        }
        return cls(
            success=result.success,
            error=None if error is None else normalise(f"{type(error).__name__}: {error}"),
            stdout=normalise(captured.out),
            stderr=normalise(captured.err),
            names={**names, **changed},
            underscore=_shown(shell.user_ns.get("_")),
            out_grew=len(shell.user_ns["Out"]) > out_before,
        )


def baseline(shell: Any) -> dict[str, Any]:
    shell.user_ns.pop("x", None)
    shell.user_ns["_"] = "before"
    return dict(shell.user_ns)


def _restore(shell: Any, saved: dict[str, Any]) -> None:
    for name in [name for name in shell.user_ns if name not in saved]:
        del shell.user_ns[name]
    shell.user_ns.update(saved)
    for name in ("last_exc", "last_value", "last_traceback", "last_type"):
        if hasattr(sys, name):
            delattr(sys, name)


def same_as_plain(plain: Observed, magic: Observed, ignore_stderr_lines: tuple[str, ...] = ()) -> list[str]:
    """The differences a user could notice, as readable lines (empty: the same)."""
    differences = []
    stderr = "\n".join(
        line for line in magic.stderr.splitlines() if not any(part in line for part in ignore_stderr_lines)
    )
    for field in ("success", "error", "stdout", "names", "underscore", "out_grew"):
        if getattr(plain, field) != getattr(magic, field):
            differences.append(f"{field}: plain {getattr(plain, field)!r} != magic {getattr(magic, field)!r}")
    if plain.stderr != stderr:
        differences.append(f"stderr: plain {plain.stderr!r} != magic {stderr!r}")
    return differences
