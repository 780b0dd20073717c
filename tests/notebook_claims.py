"""What a tutorial's words claim about its outputs, read so a machine can hold the two together (tests only).

A markdown cell speaks about the code cells beside it: those after it up to the next markdown cell, and those
before it back to the previous one (its *neighbours*). The first markdown cell, the notebook's header,
speaks about the whole notebook. Three kinds of claim are read:

- **figures**: a size (``2.05 GiB``, ``512 MiB``), a time (``215 ms``, ``1.07 s``), a percentage, and a
  count tied to a word that makes it a result (``batch 236``, ``found 376``, ``4 micro batches of 256``,
  ``8 steps of 128``). Each must appear among the neighbours' output figures, in any binary unit
  and to the precision written (``7 GiB`` quotes ``6.85 GiB``; ``2.1 GiB`` does not quote ``2.05 GiB`` at
  ``2.0``...; ``2,993`` is ``2993``). Decimal ``GB``/``MB`` are not read: the outputs print binary units,
  and prose uses ``GB`` for a card's marketed size (``a 24 GB card``). A bare number is not a claim
  (``notebook 4``, ``section 2``, a year), nor is anything in a code span, a fenced block, a link or an
  HTML comment; a figure whose number is a literal of a neighbour's code is an input the cell was given
  (``--limit 2GiB``, ``batch_size = 1024``, ``0.3 * free`` for 30%), not a claim about what it printed;
- **verdicts**: "fits"/"fitted", "does not fit"/"ran out of memory"/"failed", "runs unchanged", "fits under
  autocast": where a neighbour shows a ``%oomfix``/``%%oomfix``/``%%cudamem`` report, one of the neighbours'
  outputs (those reports, ``%oomfix``'s headline or the second of its three lines, and out-of-memory errors)
  must say the same. The header's verdicts are not read:
  it speaks in general ("until a later cell runs out of memory");
- **rerun counts**: "3 reruns", "one try": a neighbouring ``%oomfix`` output must report that many.

``<!-- claim: not-output -->`` in a markdown cell marks all of its claims as deliberately not about the
outputs (a default, a rule of thumb); ``<!-- claim: not-output 90%, 4 GiB -->`` marks only those figures (the marker may say why, after them).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
SCALES = {
    "KiB": 2.0**10, "MiB": 2.0**20, "GiB": 2.0**30, "TiB": 2.0**40,
    "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0,
    "%": 1.0,
}
DIMENSION = {"KiB": "bytes", "MiB": "bytes", "GiB": "bytes", "TiB": "bytes", "µs": "time", "us": "time", "ms": "time", "s": "time", "%": "%"}
FIGURE = re.compile(rf"(?<![\w.,])({NUMBER})\s?(KiB|MiB|GiB|TiB|µs|us|ms|s|%)(?!\w)")
# A count is a claim only beside a word that makes it a result.
COUNT = re.compile(
    rf"\b(?:batch(?: size)?(?: of)?|found|largest batch(?: of)?)\s+({NUMBER})\b(?!\s?(?:KiB|MiB|GiB|TiB|ms|s|%))"
    rf"|(?<![\w.,])({NUMBER})\s+(?:accumulation\s+)?(?:steps|micro[- ]?batch(?:es)?)\s+of\s+({NUMBER})\b",
    re.IGNORECASE,
)
WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12}
RERUNS = re.compile(rf"(?<![\w.,])(\d+|{'|'.join(WORDS)})\s+(?:more\s+)?(?:re-?runs?|tries|try|attempts?)\b", re.IGNORECASE)
OUTPUT_RERUNS = re.compile(r"\b(\d+) reruns?\b")
CODE_LITERAL = re.compile(r"(?<![\w.])\d[\d_]*(?:\.\d+)?")
OUTPUT_NUMBER = re.compile(rf"(?<![\w.,])(?:{NUMBER})(?![\d])")

# What a markdown cell may leave out of the reading.
NOT_OUTPUT = re.compile(r"<!--\s*claim:\s*not-output\b(.*?)-->", re.DOTALL)
NOT_READ = [
    re.compile(r"<!--.*?-->", re.DOTALL),
    re.compile(r"^(```|~~~).*?^\1", re.DOTALL | re.MULTILINE),
    re.compile(r"`[^`]*`"),
    re.compile(r"\]\([^)]*\)"),
    re.compile(r"<https?://[^>]*>|https?://\S+"),
]

# Verdicts, in the outputs...
OOMFIX_HEADLINE = re.compile(r"%oomfix: (fits unchanged|fits under autocast|fits with batch|fits in chunks|nothing fitted)")
# The second of the three lines %oomfix leads with (the headline above is behind --verbose): what fixed it.
OOMFIX_LEAD = re.compile(r"^(?:Fixed (with batch|with chunks|under \S*autocast|by the cleanup)|(Not fixed))\b", re.MULTILINE)
LEAD_VERDICTS = {"with batch": "batch", "with chunks": "batch", "by the cleanup": "unchanged"}
CELL_OOM = re.compile(r"%%oomfix: the cell ran out of GPU memory")
CUDAMEM_HEADER = re.compile(r"^cudamem \[\d+\] · [^\n]*", re.MULTILINE)
# ...and in the words.
SAYS_NO_FIT = re.compile(
    r"\b(?:does|did|do|would|will|could|can)(?: not|n't) fit\b|\bcannot fit\b"
    r"|\b(?:ran|runs|run|running) out of (?:GPU |CUDA )?memory\b"
    r"|\bfail(?:s|ed)\b(?=\s*(?:[.,;:!)…]|$|with\b|here\b|again\b|halfway\b))",
    re.IGNORECASE | re.MULTILINE,
)
SAYS_FITS = re.compile(r"(?<!not )(?<!n't )\b(?:fits|fitted)\b", re.IGNORECASE)
SAYS_UNCHANGED = re.compile(r"\b(?:re)?(?:runs?|ran)\s+(?:it\s+|the cell\s+)?unchanged\b", re.IGNORECASE)
SAYS_AUTOCAST = re.compile(r"\b(?:fits|fitted|runs?|ran|reruns?)\s+under\s+(?:torch\.)?autocast\b", re.IGNORECASE)


@dataclass(frozen=True)
class Figure:
    text: str  # as written
    value: float
    decimals: int
    unit: str | None  # None: a count


def _number(text: str) -> tuple[float, int]:
    plain = text.replace(",", "")
    return float(plain), len(plain.split(".")[1]) if "." in plain else 0


def readable(markdown: str) -> str:
    """The words of a markdown cell a claim can be in: no code, links, URLs or comments."""
    for pattern in NOT_READ:
        markdown = pattern.sub(" ", markdown)
    return markdown


def exemptions(markdown: str) -> tuple[bool, str]:
    """Whether the whole cell is marked not-output, and the text of the markers that list figures (a figure
    written there, spaces aside, is marked; the marker may say why: ``<!-- claim: not-output 90%, the default -->``)."""
    whole, listed = False, []
    for match in NOT_OUTPUT.finditer(markdown):
        if match.group(1).strip():
            listed.append(_normal(match.group(1)))
        else:
            whole = True
    return whole, " ".join(listed)


def is_marked(figure: Figure, listed: str) -> bool:
    return bool(listed) and _normal(figure.text) in listed


def _normal(text: str) -> str:
    return re.sub(r"\s+", "", text)


def figures_in(text: str) -> list[Figure]:
    """The figures a text quotes: sizes, times and percentages with their unit, and counts tied to a word."""
    found = []
    for match in FIGURE.finditer(text):
        value, decimals = _number(match.group(1))
        found.append(Figure(match.group(0), value, decimals, match.group(2)))
    for match in COUNT.finditer(text):
        for group in match.groups():
            if group is not None:
                value, decimals = _number(group)
                found.append(Figure(match.group(0), value, decimals, None))
    return found


def output_figures(text: str) -> tuple[list[tuple[float, str]], set[float]]:
    """What an output shows: each figure with a unit, as (value in the unit's base, dimension), and every number."""
    with_unit = [(_number(m.group(1))[0] * SCALES[m.group(2)], DIMENSION[m.group(2)]) for m in FIGURE.finditer(text)]
    numbers = {_number(m.group(0))[0] for m in OUTPUT_NUMBER.finditer(text)}
    return with_unit, numbers


def code_literals(source: str) -> set[float]:
    return {float(m.group(0).replace("_", "")) for m in CODE_LITERAL.finditer(source)}


def shown(figure: Figure, with_unit: list[tuple[float, str]], numbers: set[float]) -> bool:
    """Whether an output shows the figure, to the precision it is written in."""
    if figure.unit is None:
        return figure.value in numbers
    tolerance = 0.5 * 10.0**-figure.decimals * (1 + 1e-9)
    scale, dimension = SCALES[figure.unit], DIMENSION[figure.unit]
    return any(kind == dimension and abs(value / scale - figure.value) <= tolerance for value, kind in with_unit)


def is_input(figure: Figure, literals: set[float]) -> bool:
    """A figure whose number the neighbours' code wrote (30% also as 0.3)."""
    return figure.value in literals or (figure.unit == "%" and any(abs(figure.value / 100 - literal) < 1e-12 for literal in literals))


def reports_a_verdict(plain_text: str) -> bool:
    """Whether an output holds a report of a magic that says whether the cell fitted."""
    return bool(OOMFIX_HEADLINE.search(plain_text) or OOMFIX_LEAD.search(plain_text) or CELL_OOM.search(plain_text)
                or CUDAMEM_HEADER.search(plain_text))


def output_verdicts(cell, plain_text: str) -> set[str]:
    """What a code cell's outputs say about fitting: ``fits``, ``oom``, ``unchanged``, ``autocast``, ``batch``."""
    verdicts = set()
    for match in OOMFIX_HEADLINE.finditer(plain_text):
        headline = match.group(1)
        if headline == "nothing fitted":
            verdicts.add("oom")
        else:
            verdicts.add("fits")
            verdicts.add({"fits unchanged": "unchanged", "fits under autocast": "autocast"}.get(headline, "batch"))
    for fixed, not_fixed in OOMFIX_LEAD.findall(plain_text):
        if not_fixed:
            verdicts.add("oom")
        else:
            verdicts.add("fits")
            verdicts.add(LEAD_VERDICTS.get(fixed, "autocast"))
    if CELL_OOM.search(plain_text):
        verdicts.add("oom")
    for header in CUDAMEM_HEADER.findall(plain_text):
        verdicts.add("oom" if "failed with" in header and "OutOfMemoryError" in header else "fits")
    for output in cell.get("outputs", []):
        if output.get("output_type") == "error":
            said = f"{output.get('ename')} {output.get('evalue')}"
            if "OutOfMemoryError" in said or "out of memory" in said:
                verdicts.add("oom")
    return verdicts


def claimed_verdicts(words: str) -> dict[str, str]:
    """The verdicts a markdown cell's words give, each with the phrase that gives it."""
    claims = {}
    for pattern, verdict in ((SAYS_NO_FIT, "oom"), (SAYS_FITS, "fits"), (SAYS_UNCHANGED, "unchanged"), (SAYS_AUTOCAST, "autocast")):
        match = pattern.search(words)
        if match:
            claims[verdict] = match.group(0)
    return claims


def claimed_reruns(words: str) -> list[tuple[int, str]]:
    return [(WORDS.get(m.group(1).lower()) or int(m.group(1)), m.group(0)) for m in RERUNS.finditer(words)]


def neighbours(cells: list, index: int) -> list[int]:
    """The code cells a markdown cell speaks about: all of them for the first markdown cell; otherwise those
    after it up to the next markdown cell and those before it back to the previous one."""
    markdown = [i for i, cell in enumerate(cells) if cell.cell_type == "markdown"]
    if markdown and index == markdown[0]:
        return [i for i, cell in enumerate(cells) if cell.cell_type == "code"]
    around = []
    for step in (-1, 1):
        i = index + step
        while 0 <= i < len(cells) and cells[i].cell_type == "code":
            around.append(i)
            i += step
    return sorted(around)


@dataclass
class Beside:
    """What the neighbours of a markdown cell show, and the numbers their code wrote."""

    with_unit: list[tuple[float, str]] = field(default_factory=list)  # (value in the unit's base, dimension)
    numbers: set[float] = field(default_factory=set)
    verdicts: set[str] = field(default_factory=set)  # read only where a magic's report is among them
    reruns: set[int] = field(default_factory=set)
    literals: set[float] = field(default_factory=set)


def beside(cells: list, index: int, plain: Callable[[object], str]) -> Beside:
    """What the neighbours of markdown cell ``index`` show; ``plain`` gives a code cell's outputs as text."""
    found, verdicts, reported = Beside(), set(), False
    for i in neighbours(cells, index):
        cell = cells[i]
        text = plain(cell)
        with_unit, numbers = output_figures(text)
        found.with_unit += with_unit
        found.numbers |= numbers
        verdicts |= output_verdicts(cell, text)
        reported = reported or reports_a_verdict(text)
        found.reruns |= {int(count) for count in OUTPUT_RERUNS.findall(text)}
        found.literals |= code_literals(cell.source)
    found.verdicts = verdicts if reported else set()
    return found
