"""Which names a cell can have bound, deleted, read or changed in place, from its text alone.

Read from the raw text by one regular expression, with no parse (a cell costs microseconds): every
identifier in it, in code, strings and comments alike, so the set is never smaller than what the cell's
code names (a name in a comment only costs a look that finds nothing changed). ``None`` where the text
cannot tell: code that reaches the namespace without naming what it touches (``exec``, ``eval``,
``globals()``, ``vars()``, ``locals()``, ``__import__``, ``sys.modules['__main__']``, ``get_ipython()``),
``from m import *``, and a magic that is not known to bind only names written in its line (``%run``,
``%reset``, ``%load``, ``%store``, ``%pylab``, ``%load_ext``...).
"""

from __future__ import annotations

import re
import types
from functools import lru_cache

_IDENTIFIER = re.compile(r"[^\W\d]\w*")
# A magic as IPython finds it: at a line's start (``%run``, ``%%capture``) or after ``=`` (``x = %time f()``).
_MAGIC = re.compile(r"(?:^|\n)[ \t]*%%?([A-Za-z_]\w*)|=[ \t]*%([A-Za-z_]\w*)")
_STAR_IMPORT = re.compile(r"\bimport[ \t(\\]*\*")
# Names through which code reaches the namespace without naming what it touches.
_REACHES_NAMESPACE = frozenset(
    {"exec", "eval", "globals", "vars", "locals", "__import__", "__main__", "__builtins__", "get_ipython",
     "import_module", "run_path", "run_module", "user_ns", "f_globals", "__globals__"}
)
# Magics that bind no name or only names written in their own line, or run their body as a plain cell.
SAFE_MAGICS = frozenset(
    {"time", "timeit", "capture", "cudamem", "cudamem_history", "cudamem_monitor", "writefile", "who", "whos",
     "who_ls", "config", "matplotlib", "pip", "conda", "env", "cd", "pwd", "ls", "history", "prun", "precision",
     "debug", "pdb", "xmode", "page", "pinfo", "pinfo2", "psource", "pdoc", "pdef", "bash", "sh", "script",
     "html", "HTML", "markdown", "latex", "javascript", "js", "svg", "sx", "system", "lsmagic", "magic"}
)


@lru_cache(maxsize=256)
def cell_names(source: str, unsafe_magics: frozenset[str] = frozenset()) -> frozenset[str] | None:
    """The names ``source`` can touch, or ``None`` when its text cannot tell (see the module docstring).

    ``unsafe_magics``: magic names that, written bare at a line's start (IPython's automagic, ``run x.py``),
    are run as magics; a line starting with one of them that is not a name the text binds is ``None``.
    """
    identifiers = frozenset(_IDENTIFIER.findall(source))
    if not _REACHES_NAMESPACE.isdisjoint(identifiers) or _STAR_IMPORT.search(source):
        return None
    for line_magic, assigned_magic in _MAGIC.findall(source):
        if (line_magic or assigned_magic) not in SAFE_MAGICS:
            return None
    if unsafe_magics and not identifiers.isdisjoint(unsafe_magics):
        for line in source.splitlines():
            first = _IDENTIFIER.match(line.lstrip())
            rest = line.lstrip()[first.end():] if first else ""
            if first and first.group() in unsafe_magics and (not rest or rest[0] in " \t") and "=" not in rest[:3]:
                return None
    return identifiers


def code_names(code: types.CodeType) -> set[str]:
    """Every global (and attribute) name a code object, and the code nested in it, may read."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= code_names(constant)
    return names
