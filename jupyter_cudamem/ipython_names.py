"""The names IPython itself puts in a user namespace, in one place.

``attribution.holders`` leaves them out of "your variables" (the output cache and input history are
reported under their own holders); ``reruns.set_aside`` never sets them aside, and undoes a failed
try's bindings of them only for the output cache (``OUTPUT_CACHE_NAMES``).
"""

from __future__ import annotations

import re

# Output cache, input history, the directory history, and the shell's helpers.
IPYTHON_NAMES = frozenset(
    {"_", "__", "___", "_i", "_ii", "_iii", "_ih", "_oh", "_dh", "In", "Out", "exit", "quit", "get_ipython"}
)
# The output cache's last three values: a try that displayed a tensor keeps it there.
OUTPUT_CACHE_NAMES = ("_", "__", "___")
# ``_12`` and ``_i12`` (an output and an input of cell 12), and dunder names such as ``__builtins__``.
IPYTHON_NAME_PATTERN = re.compile(r"^_i?\d+$|^__\w+__$")


def is_ipython_name(name: str) -> bool:
    return name in IPYTHON_NAMES or (name[:1] == "_" and IPYTHON_NAME_PATTERN.match(name) is not None)
