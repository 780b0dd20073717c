"""The names IPython itself puts in a user namespace, in one place.

``attribution.holders`` leaves them out of "your variables" (the output cache and input history are
reported under their own holders) and ``oomfix.driver`` leaves them out of what a rerun may change.
"""

from __future__ import annotations

import re

# Output cache, input history, the directory history, and the shell's helpers.
IPYTHON_NAMES = frozenset(
    {"_", "__", "___", "_i", "_ii", "_iii", "_ih", "_oh", "_dh", "In", "Out", "exit", "quit", "get_ipython"}
)
# ``_12`` and ``_i12`` (an output and an input of cell 12), and dunder names such as ``__builtins__``.
IPYTHON_NAME_PATTERN = re.compile(r"^_i?\d+$|^__\w+__$")


def is_ipython_name(name: str) -> bool:
    return name in IPYTHON_NAMES or (name[:1] == "_" and IPYTHON_NAME_PATTERN.match(name) is not None)
