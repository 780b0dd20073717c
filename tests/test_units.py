from __future__ import annotations

import ast
from pathlib import Path

import pytest

from jupyter_cudamem.errors import CudaMemError
from jupyter_cudamem.units import format_bytes, format_seconds, parse_size

# Nothing here runs a library whose version `make test-min` changes (tests/versioned.py).
pytestmark = pytest.mark.dependency_free


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * 1024**3),
        ("24 GiB", 24 * 1024**3),
        ("1.5gib", int(1.5 * 1024**3)),
        ("512MiB", 512 * 1024**2),
        ("24GB", 24 * 10**9),
        ("4096", 4096),
        (2048, 2048),
        ("1TiB", 1024**4),
        ("100k", 100_000),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["abc", "", "GiB", "12 parsecs", "-1GiB", "0", True])
def test_parse_size_rejects_with_a_hint(text):
    with pytest.raises(CudaMemError) as error:
        parse_size(text)
    message = str(error.value)
    assert "\n" not in message
    assert "GiB" in message or "positive" in message


@pytest.mark.parametrize(
    ("size", "signed", "expected"),
    [
        (0, False, "0 B"),
        (1023, False, "1023 B"),
        (1024, False, "1.00 KiB"),
        (1536 * 1024**2, False, "1.50 GiB"),
        (-2 * 1024**3, True, "-2.00 GiB"),
        (3 * 1024**2, True, "+3.00 MiB"),
        (5 * 1024**4, False, "5.00 TiB"),
        (None, False, "n/a"),
    ],
)
def test_format_bytes(size, signed, expected):
    assert format_bytes(size, signed=signed) == expected


def test_format_seconds():
    assert format_seconds(0.25) == "250 ms"
    assert format_seconds(3.214) == "3.21 s"
    assert format_seconds(125) == "2 min 5 s"


# -- every size constant lives in units.py ---------------------------------------------------------
# A size written out (1024**2, 2**20, 1 << 20, 1024 * 1024, 1_048_576) or a MiB/GiB of a module's own
# elsewhere in the package is a second definition of a unit: the package imports KiB, MiB, GiB, TiB.

PACKAGE = Path(__file__).resolve().parents[1] / "jupyter_cudamem"
_UNIT_NAMES = {"KiB", "MiB", "GiB", "TiB", "KIB", "MIB", "GIB", "TIB"}
_SIZE_VALUES = {1024, 1024**2, 1024**3, 1024**4}
_SHIFTS = {10, 20, 30, 40}
_COUNT_PARAMETERS = {"max_batch"}  # a bound on a number of samples (1 << 30), not a size


def _int(node: ast.AST) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    return None


def _size_literals(tree: ast.AST) -> list[tuple[int, str]]:
    counts = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            positional = node.args.posonlyargs + node.args.args
            pairs = list(zip(positional[len(positional) - len(node.args.defaults):], node.args.defaults))
            pairs += [(arg, default) for arg, default in zip(node.args.kwonlyargs, node.args.kw_defaults) if default]
            counts |= {id(part) for arg, default in pairs if arg.arg in _COUNT_PARAMETERS for part in ast.walk(default)}
    found = []
    for node in ast.walk(tree):
        if id(node) in counts:
            continue
        if isinstance(node, ast.BinOp):
            left, right = _int(node.left), _int(node.right)
            if isinstance(node.op, ast.Pow) and ((left == 2 and right in _SHIFTS) or (left == 1024 and right)):
                found.append((node.lineno, f"{left}**{right}"))
            elif isinstance(node.op, ast.LShift) and left is not None and right in _SHIFTS:
                found.append((node.lineno, f"{left} << {right}"))
        elif _int(node) in _SIZE_VALUES:
            found.append((node.lineno, str(_int(node))))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and target.id.lstrip("_") in _UNIT_NAMES:
                    found.append((node.lineno, f"{target.id} ="))
    return sorted(set(found))


def test_sizes_come_only_from_units():
    modules = [path for path in sorted(PACKAGE.rglob("*.py")) if path != PACKAGE / "units.py"]
    assert len(modules) > 50
    written_out = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
        for path in modules
        for line, what in _size_literals(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert not written_out, "use KiB, MiB, GiB or TiB from jupyter_cudamem.units:\n" + "\n".join(written_out)


def test_the_size_check_sees_each_way_of_writing_a_size():
    source = """
a = 256 * 1024**2
b = x / 2**30
c = 20 << 20
d = 1024 * 1024
e = 1_048_576
MiB = 2**20
_GIB = 1 << 30
f = 1024
gib = size / GiB
g = (1 << 64) - 1
h = 2**k
def largest(max_batch: int = 1 << 30, *, limit: int = 1 << 30): ...
"""
    lines = [line for line, _ in _size_literals(ast.parse(source))]
    assert sorted(set(lines)) == [2, 3, 4, 5, 6, 7, 8, 9, 13]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 0, -1, 0.04, 101, 1e308, True, "5", None])
def test_number_in_refuses_what_is_not_a_finite_number_in_range(value):
    from jupyter_cudamem.units import number_in

    with pytest.raises(CudaMemError) as error:
        number_in(value, "--wait", 0.05, 100, "seconds")
    assert str(error.value).startswith("--wait takes seconds from 0.05 to 100; got ") and "\n" not in str(error.value)


@pytest.mark.parametrize("value, expected", [(0.05, 0.05), (100, 100.0), (3, 3.0)])
def test_number_in_keeps_a_number_in_range(value, expected):
    from jupyter_cudamem.units import number_in

    assert number_in(value, "--wait", 0.05, 100, "seconds") == expected


@pytest.mark.parametrize("text, expected", [
    ("0", 0), ("12", 12), (" 3 ", 3), ("²", None), ("١٢", None), ("1_0", None), ("-1", None), ("", None), ("1.0", None),
])
def test_whole_number_takes_ascii_digits_only(text, expected):
    from jupyter_cudamem.units import whole_number

    assert whole_number(text) == expected


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_parse_size_refuses_what_is_not_finite(value):
    with pytest.raises(CudaMemError, match="not a size"):
        parse_size(value)
