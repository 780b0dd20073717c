"""Find the batch size in a cell's source and rewrite it, changing nothing else.

A cell is IPython input, not Python: it may start with a cell magic (``%%time``) and hold ``!cmd`` or
``%magic`` lines. We parse what IPython would run (its own input transformer), keep only the lines the
transformer left unchanged, and edit the *raw* text at the AST positions of the numbers we change. So
comments, spacing and IPython syntax survive a rewrite byte for byte, which ``ast.unparse`` of the
whole cell could not promise.

What counts as a batch size, most plausible first:

- an integer assigned to, passed as a keyword named, or given as a parameter default named like a batch
  size (``batch_size``, ``bs``, ``BATCH``, ``per_device_train_batch_size``, ``micro_batch_size``, ...);
- any name whose value is the leading dimension of a tensor constructor
  (``B = 64`` ... ``torch.randn(B, 3, 224, 224)``);
- the same literal leading dimension of tensor constructors (``torch.randn(512, 3, 224, 224)`` and
  ``torch.randint(0, 10, (512,))`` move together); a square ``torch.randn(8192, 8192)`` is a matrix,
  not a batch;
- a batch-like name the cell uses but an earlier cell set (``namespace`` given): the rewrite sets it on
  a new first line.
"""

from __future__ import annotations

import ast
import difflib
import io
import re
import tokenize
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

# Names that are nothing but a batch size (lower case, compared whole).
_EXACT_NAMES = {
    "batch_size",
    "batchsize",
    "bs",
    "bsz",
    "batch",
    "train_batch_size",
    "per_device_train_batch_size",
    "per_gpu_train_batch_size",
    "micro_batch_size",
    "train_micro_batch_size_per_gpu",
    "mini_batch_size",
    "minibatch_size",
    "global_batch_size",
}
_EVAL_WORDS = {"eval", "test", "val", "valid", "validation", "inference", "predict", "infer"}
# Callables whose arguments give a tensor's shape.
_SHAPE_CONSTRUCTORS = {"randn", "rand", "zeros", "ones", "empty", "full", "randint", "normal",
                       "new_zeros", "new_ones", "new_empty", "new_full", "empty_strided"}


def batch_like(name: str) -> bool:
    """Whether ``name`` reads as a batch size (``bs``, ``BATCH``, ``eval_batch_size``, ``micro_bs``)."""
    lower = name.lower()
    if lower in _EXACT_NAMES:
        return True
    words = [w for w in re.split(r"_+", lower) if w]
    if any(w in {"bs", "bsz", "batchsize"} for w in words):
        return True
    return any(a == "batch" and b == "size" for a, b in zip(words, words[1:]))


def _name_score(name: str) -> int:
    lower = name.lower()
    words = set(re.split(r"_+", lower))
    score = 10 if lower in _EXACT_NAMES else 8
    if words & _EVAL_WORDS:
        score -= 5  # an evaluation batch rarely sets a training cell's peak
    return score


@dataclass(frozen=True)
class Site:
    """Where one number sits in the raw cell: 1-based line, 0-based character columns."""

    line: int
    col: int
    end_col: int


@dataclass(frozen=True)
class BatchCandidate:
    """One setting of the batch size: every place that must change together to change it."""

    name: str
    kind: str  # "assignment", "keyword", "default", "dict", "tensor", "namespace"
    value: int
    line: int
    sites: tuple[Site, ...]
    score: int
    evidence: tuple[str, ...] = ()

    def describe(self) -> str:
        where = f"line {self.line}" if self.line else "set in an earlier cell"
        if self.kind == "keyword":
            text = f"{self.name}={self.value}"
        elif self.kind == "tensor":
            text = f"leading dimension {self.value} of tensor constructors"
        elif self.kind == "default":
            text = f"default {self.name}={self.value}"
        elif self.kind == "dict":
            text = f"'{self.name}': {self.value}"
        else:
            text = f"{self.name} = {self.value}"
        return f"{text} ({where})"


@dataclass(frozen=True)
class BatchDiscovery:
    """What ``find_batch`` made of a cell: candidates best first, or why there are none."""

    source: str
    candidates: tuple[BatchCandidate, ...]
    problem: str | None = None  # a one-line reason when nothing can be shrunk
    body_line: int = 1  # first line after any cell-magic header, where a new assignment may go

    @property
    def chosen(self) -> BatchCandidate | None:
        return self.candidates[0] if self.candidates else None

    @property
    def others(self) -> tuple[BatchCandidate, ...]:
        return self.candidates[1:]

    def summary(self) -> str:
        if self.chosen is None:
            return self.problem or "no batch size found in the cell"
        text = f"batch size: {self.chosen.describe()}"
        if self.others:
            text += "; also seen: " + ", ".join(c.describe() for c in self.others)
        return text


# -- parsing IPython input ------------------------------------------------------------------------
def _default_transform(source: str) -> str:
    try:
        from IPython.core.inputtransformer2 import TransformerManager
    except ImportError:  # plain Python without IPython: the cell is Python
        return source
    return TransformerManager().transform_cell(source)


def _lines(text: str) -> list[str]:
    """Lines with their endings, split where Python's tokenizer splits (not at form feeds)."""
    return re.findall(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z", text)


def _split_cell_magics(lines: list[str]) -> int:
    """How many leading lines are cell-magic headers (``%%time``), whose body is Python again."""
    index = 0
    while index < len(lines) and not lines[index].strip():
        index += 1
    start = index
    while index < len(lines) and lines[index].lstrip().startswith("%%"):
        index += 1
    return index if index > start else 0


@dataclass
class _Parsed:
    tree: ast.Module
    transformed_lines: list[str]
    line_map: dict[int, int]  # transformed 1-based line -> raw 1-based line, for unchanged lines only
    header_lines: int


def _parse(source: str, transform: Callable[[str], str]) -> _Parsed:
    raw_lines = _lines(source)
    header = _split_cell_magics(raw_lines)
    body = "".join(raw_lines[header:])
    transformed = transform(body)
    tree = ast.parse(transformed)  # SyntaxError goes to the caller
    new_lines = _lines(transformed)
    old_lines = raw_lines[header:]
    matcher = difflib.SequenceMatcher(
        a=[line.rstrip("\r\n") for line in old_lines], b=[line.rstrip("\r\n") for line in new_lines], autojunk=False
    )
    line_map: dict[int, int] = {}
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal":
            for offset in range(a1 - a0):
                line_map[b0 + offset + 1] = header + a0 + offset + 1
    return _Parsed(tree, new_lines, line_map, header)


def _char_col(line_text: str, byte_col: int) -> int:
    """AST columns count UTF-8 bytes; edits need characters."""
    return len(line_text.encode("utf-8")[:byte_col].decode("utf-8", errors="ignore"))


def _int_constant(node: ast.AST | None) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    return None


def _callable_name(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""


def _shape_nodes(call: ast.Call) -> list[ast.AST]:
    """The nodes giving a constructor's dimensions, in order (``randn(512, 3)``, ``zeros((512, 3))``)."""
    name = _callable_name(call)
    if name not in _SHAPE_CONSTRUCTORS:
        return []
    for keyword in call.keywords:
        if keyword.arg == "size" and isinstance(keyword.value, (ast.Tuple, ast.List)):
            return list(keyword.value.elts)
    args = list(call.args)
    if name == "randint":
        # randint(high, size) or randint(low, high, size): the shape is the tuple argument.
        for arg in args:
            if isinstance(arg, (ast.Tuple, ast.List)):
                return list(arg.elts)
        return []
    if name in {"full", "new_full", "normal", "empty_strided"}:
        if args and isinstance(args[0], (ast.Tuple, ast.List)):
            return list(args[0].elts)
        return []
    if args and isinstance(args[0], (ast.Tuple, ast.List)):
        return list(args[0].elts)
    shape = []
    for arg in args:
        if isinstance(arg, ast.Starred):
            break
        shape.append(arg)
    return shape


class _Finder(ast.NodeVisitor):
    def __init__(self, parsed: _Parsed):
        self.parsed = parsed
        self.found: list[BatchCandidate] = []
        self.assigned: dict[str, list[tuple[int, ast.Constant]]] = {}
        self.leading_names: dict[str, int] = {}  # names used as a leading dimension -> times
        self.keyword_names: set[str] = set()  # names passed as the value of a batch-like keyword
        self.loaded: set[str] = set()
        self.tensor_literals: list[tuple[int, ast.Constant, bool]] = []  # value, node, is_batchlike_shape

    # positions ---------------------------------------------------------------------------------
    def site(self, node: ast.AST) -> Site | None:
        raw_line = self.parsed.line_map.get(getattr(node, "lineno", 0))
        if raw_line is None or node.lineno != node.end_lineno:  # type: ignore[attr-defined]
            return None
        text = self.parsed.transformed_lines[node.lineno - 1]  # type: ignore[attr-defined]
        return Site(raw_line, _char_col(text, node.col_offset), _char_col(text, node.end_col_offset))  # type: ignore[attr-defined]

    def add(self, name: str, kind: str, node: ast.Constant, score: int) -> None:
        site = self.site(node)
        value = _int_constant(node)
        if site is None or value is None or value < 2:
            return
        self.found.append(BatchCandidate(name, kind, value, site.line, (site,), score))

    # visitors ----------------------------------------------------------------------------------
    def _targets(self, target: ast.AST, value: ast.AST) -> None:
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant) and _int_constant(value) is not None:
            self.assigned.setdefault(target.id, []).append((_int_constant(value) or 0, value))
        elif isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)):
            if len(target.elts) == len(value.elts):
                for sub_target, sub_value in zip(target.elts, value.elts):
                    self._targets(sub_target, sub_value)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._targets(target, node.value)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self._targets(node.target, node.value)
        self.generic_visit(node)

    def _defaults(self, args: ast.arguments) -> None:
        positional = args.posonlyargs + args.args
        for arg, default in zip(positional[len(positional) - len(args.defaults):], args.defaults):
            if batch_like(arg.arg) and isinstance(default, ast.Constant):
                self.add(arg.arg, "default", default, _name_score(arg.arg) + 1)
        for arg, default in zip(args.kwonlyargs, args.kw_defaults):
            if default is not None and batch_like(arg.arg) and isinstance(default, ast.Constant):
                self.add(arg.arg, "default", default, _name_score(arg.arg) + 1)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._defaults(node.args)
        self.generic_visit(node)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._defaults(node.args)
        self.generic_visit(node)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._defaults(node.args)
        self.generic_visit(node)

    def visit_Dict(self, node: ast.Dict) -> None:
        for key, value in zip(node.keys, node.values):
            if isinstance(key, ast.Constant) and isinstance(key.value, str) and batch_like(key.value):
                if isinstance(value, ast.Constant):
                    self.add(key.value, "dict", value, _name_score(key.value) + 1)
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self.loaded.add(node.id)

    def visit_Call(self, node: ast.Call) -> None:
        for keyword in node.keywords:
            if keyword.arg and batch_like(keyword.arg):
                if isinstance(keyword.value, ast.Constant):
                    bonus = 3 if _callable_name(node) == "DataLoader" else 2
                    self.add(keyword.arg, "keyword", keyword.value, _name_score(keyword.arg) + bonus)
                elif isinstance(keyword.value, ast.Name):
                    self.keyword_names.add(keyword.value.id)
        shape = _shape_nodes(node)
        if shape:
            lead = shape[0]
            if isinstance(lead, ast.Name):
                self.leading_names[lead.id] = self.leading_names.get(lead.id, 0) + 1
            elif _int_constant(lead) is not None:
                rest = [_int_constant(n) for n in shape[1:]]
                # A square or repeated size is a matrix dimension, not a batch.
                batch_shaped = len(shape) >= 2 and _int_constant(lead) not in rest
                self.tensor_literals.append((_int_constant(lead) or 0, lead, batch_shaped))  # type: ignore[arg-type]
        self.generic_visit(node)

    # results -----------------------------------------------------------------------------------
    def candidates(self, namespace: Mapping[str, Any] | None, body_line: int) -> list[BatchCandidate]:
        found = list(self.found)
        for name, assignments in self.assigned.items():
            evidence = []
            if name in self.leading_names:
                evidence.append("leading dimension of a tensor")
            if name in self.keyword_names:
                evidence.append("passed as a batch size")
            if batch_like(name):
                score = _name_score(name) + 2
            elif evidence:
                score = 7  # ``B = 64`` used as ``torch.randn(B, ...)``
            else:
                continue
            score += 4 * bool(evidence) + (name in self.loaded)
            for value, node in assignments:
                site = self.site(node)
                if site is not None and value >= 2:
                    found.append(BatchCandidate(name, "assignment", value, site.line, (site,), score, tuple(evidence)))
        if namespace is not None:
            used = self.loaded | set(self.leading_names)
            for name in sorted(used - set(self.assigned)):
                value = namespace.get(name)
                if type(value) is not int or value < 2:
                    continue
                strong = name in self.leading_names or name in self.keyword_names
                if batch_like(name) or strong:
                    score = (_name_score(name) if batch_like(name) else 5) + 3 * strong
                    found.append(BatchCandidate(name, "namespace", value, 0, (), score))
        # Literal leading dimensions: one candidate per value, all constructors moving together.
        groups: dict[int, list[tuple[ast.Constant, bool]]] = {}
        for value, node, batch_shaped in self.tensor_literals:
            groups.setdefault(value, []).append((node, batch_shaped))
        for value, nodes in groups.items():
            if value < 2 or not any(batch_shaped for _, batch_shaped in nodes):
                continue
            sites = tuple(s for s in (self.site(node) for node, _ in nodes) if s is not None)
            if not sites:
                continue
            twin = next((c for c in found if c.value == value and c.kind != "namespace"), None)
            if twin is not None:
                # ``batch_size = 64`` and ``torch.randn(64, ...)``: the literal is that batch, written out.
                merged = replace(twin, sites=twin.sites + sites, score=twin.score + 2,
                                 evidence=twin.evidence + ("same number as a tensor's leading dimension",))
                found[found.index(twin)] = merged
                continue
            found.append(BatchCandidate(f"leading dimension {value}", "tensor", value, sites[0].line, sites,
                                        4 + min(len(sites) - 1, 3)))
        # One candidate per (name, kind, value); best first, then the earlier line.
        unique: dict[tuple[str, str, int], BatchCandidate] = {}
        for candidate in found:
            key = (candidate.name, candidate.kind, candidate.value)
            if key in unique:
                old = unique[key]
                candidate = replace(old, sites=old.sites + candidate.sites)
            unique[key] = candidate
        return sorted(unique.values(), key=lambda c: (-c.score, c.line or body_line))


def find_batch(
    source: str,
    namespace: Mapping[str, Any] | None = None,
    transform: Callable[[str], str] | None = None,
) -> BatchDiscovery:
    """Every plausible batch size in ``source`` (IPython input), most plausible first.

    ``namespace`` (the user's) lets a name set in an earlier cell count. ``transform`` turns IPython
    input into Python; by default IPython's own ``TransformerManager`` (the shell's ``transform_cell``
    gives the same). Never raises for bad input: ``problem`` says what is wrong.
    """
    transform = transform or _default_transform
    try:
        parsed = _parse(source, transform)
    except SyntaxError as error:
        return BatchDiscovery(source, (), f"the cell does not parse ({error.msg}, line {error.lineno}), so its batch size cannot be changed")
    except Exception as error:  # IPython's transformer on odd input
        return BatchDiscovery(source, (), f"the cell could not be read as IPython input ({error}), so its batch size cannot be changed")
    finder = _Finder(parsed)
    finder.visit(parsed.tree)
    candidates = finder.candidates(namespace, parsed.header_lines + 1)
    if not candidates:
        return BatchDiscovery(source, (), "no batch size in the cell: no integer named like a batch size, "
                              "no tensor with a literal leading dimension", parsed.header_lines + 1)
    return BatchDiscovery(source, tuple(candidates), None, parsed.header_lines + 1)


def _line_ending(source: str) -> str:
    return "\r\n" if "\r\n" in source else "\n"


def rewrite_batch(discovery: BatchDiscovery, new_value: int, candidate: BatchCandidate | None = None) -> str:
    """``discovery.source`` with the (chosen) candidate's number(s) replaced by ``new_value``.

    Only the characters of those numbers change. A name set in an earlier cell gets a new first line
    (after any cell-magic header) assigning it.
    """
    candidate = candidate or discovery.chosen
    if candidate is None:
        raise ValueError("nothing to rewrite: " + discovery.summary())
    if new_value < 1:
        raise ValueError(f"a batch size must be at least 1, got {new_value}")
    lines = _lines(discovery.source)
    if candidate.kind == "namespace":
        newline = _line_ending(discovery.source)
        index = discovery.body_line - 1
        insert = f"{candidate.name} = {new_value}  # set by %oomfix, was {candidate.value}{newline}"
        if index > 0 and not lines[index - 1].endswith(("\n", "\r")):
            lines[index - 1] += newline
        return "".join(lines[:index] + [insert] + lines[index:])
    for site in sorted(candidate.sites, key=lambda s: (s.line, s.col), reverse=True):
        text = lines[site.line - 1]
        lines[site.line - 1] = text[: site.col] + str(new_value) + text[site.end_col :]
    return "".join(lines)


def unified_diff(before: str, after: str, name: str = "cell") -> str:
    """A unified diff of two versions of a cell, for display."""
    diff = difflib.unified_diff(
        before.splitlines(keepends=True),
        after.splitlines(keepends=True),
        fromfile=f"{name} (failed)",
        tofile=f"{name} (fits)",
    )
    return "".join(line if line.endswith("\n") else line + "\n" for line in diff)


def _string_continuation_lines(python: str) -> set[int]:
    """1-based lines that continue a multi-line string token: indenting them would change the string."""
    inside: set[int] = set()
    try:
        for token in tokenize.generate_tokens(io.StringIO(python).readline):
            if token.type == tokenize.STRING or getattr(tokenize, "FSTRING_MIDDLE", -1) == token.type:
                inside.update(range(token.start[0] + 1, token.end[0] + 1))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        pass
    return inside


def wrap_in_autocast(
    source: str,
    dtype: str = "bfloat16",
    import_torch: bool = True,
    transform: Callable[[str], str] | None = None,
) -> str:
    """``source`` with its body inside ``with torch.autocast("cuda", dtype=torch.<dtype>):``.

    A cell-magic header stays first. Lines are indented by four spaces except lines inside a
    multi-line string (found by tokenizing what IPython would run, so ``!cmd`` lines do not confuse
    it); IPython accepts indented ``!cmd`` and ``%magic`` lines. Raises ``SyntaxError`` when the
    cell does not parse, so a broken cell is never wrapped.
    """
    if dtype not in {"bfloat16", "float16"}:
        raise ValueError(f"autocast dtype must be bfloat16 or float16, got {dtype!r}")
    transform = transform or _default_transform
    parsed = _parse(source, transform)
    raw_lines = _lines(source)
    header, body = raw_lines[: parsed.header_lines], raw_lines[parsed.header_lines :]
    newline = _line_ending(source)
    transformed = "".join(parsed.transformed_lines)
    inside_string = {parsed.line_map[t] for t in _string_continuation_lines(transformed) if t in parsed.line_map}
    wrapped = []
    for number, line in enumerate(body, start=parsed.header_lines + 1):
        if not line.strip() or number in inside_string:
            wrapped.append(line)
        else:
            wrapped.append("    " + line)
    if not any(line.strip() for line in wrapped):
        wrapped.append("    pass" + newline)
    if wrapped and not wrapped[-1].endswith(("\n", "\r")):
        wrapped[-1] += newline
    opening = []
    if import_torch:
        opening.append("import torch" + newline)
    opening.append(f'with torch.autocast("cuda", dtype=torch.{dtype}):' + newline)
    if header and not header[-1].endswith(("\n", "\r")):
        header[-1] += newline
    return "".join(header + opening + wrapped)
