"""The package's rooms (top-level modules and folders of ``jupyter_cudamem``) and the imports between them.

    python scripts/import_graph.py            # every arrow, the arrows up the map, the circles (rooms, then modules)

A room's imports are read from its modules' ``import`` statements (``TYPE_CHECKING`` blocks included: a
circle there is still a circle for a reader). The map's order is ``ROOMS``: data flows one way, from the
hardware (``sources``) through measurement and models (``reruns``, ``batchsearch``, ``batch``, ``attribution``) to
the features (``oomfix``, ``capacity``, ``engines``) and ``magics``; a room may import only rooms before it, and
no two modules of one folder import each other, however far round (``module_graph``);
``tests/test_import_graph.py`` holds the package to both.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jupyter_cudamem"

ROOMS = (
    "errors", "units", "oom", "breakdown", "growth", "sources", "hardware", "collector", "measure",
    "repeats", "trace", "cell", "ipython_names", "ipython_outputs", "ipython_state", "reruns", "batchsearch", "batch", "attribution",
    "history", "advice", "report", "monitor", "oomfix", "capacity", "engines", "magics",
)
"""The map, lowest first, in the order of the house style's map; the rooms it does not name sit beside the
rooms they serve. ``__init__`` (the extension's entry points) may import anything. ``errors`` comes before
``units``, which raises its one exception type on a size it cannot read. ``growth`` (the memory model: pure
arithmetic on plain tuples, importing only ``units``) sits below ``sources``, as ``units`` does, so that
``sources.torch_trace`` reads torch's trace into its events. ``ipython_state`` (what IPython itself holds)
sits below ``attribution``: it names what it lists (``Origin``, ``Reference``) and is told what reaches CUDA
memory (``holds_cuda``), so attribution takes IPython's references as roots without IPython's module asking
it anything. ``batchsearch`` (the batch search's policy and what its tries showed) sits above ``reruns``."""


def room_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "jupyter_cudamem" or len(parts) < 2:
        return None
    return parts[1]


def imports(path: Path, package: list[str] | None = None) -> set[str]:
    """The package modules a file imports, as dotted names, relative imports resolved and imports inside
    functions included: ``from ..advice import x`` gives ``jupyter_cudamem.advice`` (and ``.x``), ``from
    .. import advice`` and ``from jupyter_cudamem import advice`` both ``jupyter_cudamem.advice``.
    ``package`` is what its relative imports start from (``["jupyter_cudamem", "attribution"]``): by
    default the folder it sits in in the package (``__init__.py`` included)."""
    if package is None:
        package = list(path.relative_to(PACKAGE.parent).parts[:-1])
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # a name may be a module
    return {name for name in found if name.startswith("jupyter_cudamem")}


def graph() -> dict[str, set[str]]:
    arrows: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        source = relative.parts[0].removesuffix(".py")
        if source == "__init__":
            continue
        for name in imports(path):
            target = room_of(name)
            if target and target != source and target != "__init__":
                arrows[source].add(target)
    return arrows


def module_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Arrows between modules of one folder (``jupyter_cudamem.batch.reader`` -> ``...batch.expressions``), for
    "no circle inside a folder". A folder's ``__init__`` is left out either way: it gathers its modules'
    names for the rooms below, and a module reaches a sibling through it only by naming the sibling."""
    modules = {path: path.relative_to(package.parent).with_suffix("").parts for path in package.rglob("*.py")}
    names = {".".join(parts) for parts in modules.values() if parts[-1] != "__init__"}
    arrows: dict[str, set[str]] = defaultdict(set)
    for path, parts in modules.items():
        if parts[-1] == "__init__":
            continue
        source, folder = ".".join(parts), ".".join(parts[:-1])
        for name in imports(path, list(parts[:-1])):
            if name in names and name != source and name.rsplit(".", 1)[0] == folder:
                arrows[source].add(name)
    return arrows


def upward(arrows: dict[str, set[str]]) -> list[tuple[str, str]]:
    order = {room: index for index, room in enumerate(ROOMS)}
    return sorted((a, b) for a, targets in arrows.items() for b in targets
                  if a in order and b in order and order[b] > order[a])


def unknown(arrows: dict[str, set[str]]) -> set[str]:
    rooms = set(arrows) | {b for targets in arrows.values() for b in targets}
    return rooms - set(ROOMS)


def circles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one room (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10_000)

    def visit(room: str) -> None:
        index[room] = low[room] = counter[0]
        counter[0] += 1
        stack.append(room)
        on_stack.add(room)
        for target in arrows.get(room, ()):
            if target not in index:
                visit(target)
                low[room] = min(low[room], low[target])
            elif target in on_stack:
                low[room] = min(low[room], index[target])
        if low[room] == index[room]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == room:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for room in sorted(set(arrows) | {b for t in arrows.values() for b in t}):
        if room not in index:
            visit(room)
    return found


def main() -> None:
    arrows = graph()
    for room in ROOMS:
        if arrows.get(room):
            print(f"{room} -> {', '.join(sorted(arrows[room], key=ROOMS.index))}")
    print("up the map:", upward(arrows) or "none")
    print("circles:", circles(arrows) or "none")
    print("rooms not on the map:", sorted(unknown(arrows)) or "none")
    print("circles inside a folder:", circles(module_graph()) or "none")


if __name__ == "__main__":
    main()
