"""Why a cell ran out of GPU memory, in one verdict, with the figures and holders behind it.

The verdicts (``Verdict``) are checked in their order, the first that applies acted on; beside the verdict the
failure's memory is split by category (the model state, the user's variables, activations and temporaries), and
the largest category gets the advice that fits it. Each rule and its reason: docs/oomfix-diagnosis.md.
"""

from __future__ import annotations

import copy
import html
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from enum import StrEnum

from .. import advice
from ..advice import EXPANDABLE as EXPANDABLE  # re-exported: the diagnosis names this setting
from ..report.text import TextReport
from ..sources.base import AllocatorReading
from ..units import MiB, format_bytes
from ..attribution.holders import Holder, HolderKind, Origin
from ..breakdown import MODEL_STATE, Category
from ..oom import KIND_WORDS, OomInfo, OomKind


_SIGNIFICANT_SHARE = 0.05
_NAMESPACE_SHARE = 0.5
# Where a category's figure at the failure comes from; the model state's parts are read from the objects.
_SOURCES = {Category.ACTIVATIONS: "the rest of what was allocated and asked for",
            Category.OTHER: "your variables' tensors beyond the models' state"}
# The OOM's figures the diagnosis lists, where its message gives them.
_FIGURES = (("asked for", "requested_bytes"), ("card capacity", "total_bytes"), ("per-process cap", "allowed_bytes"),
            ("free on the card", "free_bytes"), ("held by this process", "process_bytes"),
            ("allocated by PyTorch", "allocated_bytes"), ("in private pools (CUDA graphs)", "private_pool_bytes"),
            ("reserved by PyTorch, unallocated", "reserved_unallocated_bytes"))


class Verdict(StrEnum):
    """Why the cell ran out, in the words the diagnosis shows; it decides the advice and which notes follow."""

    TOO_BIG = "too big for the card"
    FRAGMENTATION = "fragmentation"
    HELD_BY_IPYTHON = "held by IPython after the error"
    HELD_BY_NAMESPACE = "held by namespace"


@dataclass(frozen=True, repr=False)
class Diagnosis(TextReport):
    """The OOM's figures, the largest holders, a verdict, one line explaining it, and what to try."""

    oom: OomInfo
    holders: list[Holder]
    verdict: Verdict
    explanation: str
    suggestions: tuple[str, ...] = ()
    readings: dict[int, AllocatorReading] | None = None
    ipython_only_bytes: int = 0
    cache_only_bytes: int = 0
    namespace_bytes: int = 0
    figures: tuple[tuple[str, str], ...] = field(default=())
    # At the failure, by category (bytes), where the models' state could be read; None where not.
    categories: dict[Category, int] | None = None

    # Everything behind the first line (the figures, categories, holders, advice) shows with it.
    verbose: bool = False

    def cause(self) -> str:
        """Why the cell ran out, in a few words, for the first line of what ``%oomfix`` shows."""
        oom = self.oom
        capped = oom.allowed_bytes is not None and oom.total_bytes is not None and oom.allowed_bytes < oom.total_bytes
        limit = (f"the {format_bytes(oom.allowed_bytes)} per-process cap" if capped
                 else f"the {format_bytes(oom.total_bytes)} card" if oom.total_bytes is not None else "the card")
        if self.verdict is Verdict.FRAGMENTATION:
            words = (f"{format_bytes(oom.reserved_unallocated_bytes)} was cached but not in one piece for the "
                     f"{format_bytes(oom.requested_bytes)} asked")
        elif self.verdict is Verdict.HELD_BY_IPYTHON:
            words = f"{format_bytes(self.cache_only_bytes)} was held only by IPython's output cache"
            traceback = self.ipython_only_bytes - self.cache_only_bytes
            if traceback >= MiB:  # the cleanup frees both: the first line says so
                words = (f"{format_bytes(self.ipython_only_bytes)} was held only by IPython: its output cache "
                         f"{format_bytes(self.cache_only_bytes)}, the failed cell's traceback "
                         f"{format_bytes(traceback)}")
        elif self.verdict is Verdict.HELD_BY_NAMESPACE:
            words = f"your variables hold {format_bytes(self.namespace_bytes)} of {limit}"
        elif oom.exceeds_capacity:
            words = f"one allocation of {format_bytes(oom.requested_bytes)} is more than {limit} allows"
        else:
            words = f"it needs more than {limit} allows" if capped or oom.free_bytes is None else (
                f"it needs more than the {format_bytes(oom.free_bytes)} free on the card")
        shown = self._shown_categories()
        if shown:
            largest = max(shown, key=shown.__getitem__)
            words += f"; the largest part: {_words(largest)}, {format_bytes(shown[largest])}"
        return words

    def _shown_categories(self) -> dict[Category, int]:
        """The split by category where it explains the verdict: not for memory in pieces or in IPython's cache."""
        return {} if self.verdict in (Verdict.FRAGMENTATION, Verdict.HELD_BY_IPYTHON) else self.categories or {}

    def headline(self) -> str:
        where = "" if self.oom.device_index is None else f" on GPU {self.oom.device_index}"
        return f"CUDA out of memory{where} ({KIND_WORDS[self.oom.kind]}): {self.cause()}"

    def text(self) -> str:
        if self.verbose:
            return self.full_text()
        lines = [self.headline()]
        if self.suggestions:
            lines.append(f"  try: {self.suggestions[0]}")
        lines.append("  (figures, holders and all the advice: --verbose)")
        return "\n".join(lines)

    def full_text(self) -> str:
        """Every part as aligned text: the verdict, the figures, the split by category, the holders, the advice."""
        where = "" if self.oom.device_index is None else f" on GPU {self.oom.device_index}"
        lines = [f"CUDA out of memory{where} ({KIND_WORDS[self.oom.kind]}): {self.verdict}"]
        lines.append(f"  {self.explanation}")
        if self.figures:
            width = max(len(label) for label, _ in self.figures)
            lines.append("  figures:")
            lines.extend(f"    {label.ljust(width)}  {value:>11}" for label, value in self.figures)
        rows = self.category_rows()
        if rows:
            width = max(len(words) for words, _, _ in rows)
            lines.append("  at the failure, by category:")
            lines.extend(f"    {words.ljust(width)}  {size:>11}  {note}".rstrip() for words, size, note in rows)
        if self.holders:
            lines.append("  largest holders of CUDA memory:")
            for h in self.holders:
                owner = "variable" if h.user_variable else "IPython"
                only = "" if h.exclusive_bytes in (0, h.cuda_bytes) else (
                    f", {format_bytes(h.exclusive_bytes)} only here")
                detail = f" [{h.detail}]" if h.detail else ""
                lines.append(f"    {format_bytes(h.cuda_bytes):>11}  {h.label} ({owner}, {h.kind}{only}){detail}")
        if self.suggestions:
            lines.append("  try:")
            lines.extend(f"    - {suggestion}" for suggestion in self.suggestions)
        return "\n".join(lines)

    def category_rows(self) -> list[tuple[str, str, str]]:
        """(category, size, where the figure comes from) at the failure; the largest marked."""
        shown = self._shown_categories()
        largest = max(shown, key=shown.__getitem__, default=None)
        return [(_words(category), format_bytes(size), _SOURCES.get(category, "read from your models and optimizers")
                 + ("; the largest" if category is largest else "")) for category, size in shown.items()]

    def cleanup_explanation(self, freed_bytes: int | None, deleted: tuple[str, ...] = ()) -> str:
        """Why what the cleanup freed differs from what the holders above listed, or "" when they agree: it
        frees what only IPython, the traceback and the ``deleted`` variables held, and what no name reaches."""
        if freed_bytes is None:
            return ""
        listed = max((h.cuda_bytes for h in self.holders if not h.user_variable), default=0)
        named = sum(h.exclusive_bytes for h in self.holders if h.user_variable and h.name in deleted)
        only = self.ipython_only_bytes + named
        slack = max(MiB, int(0.1 * max(listed, freed_bytes)))
        shared = listed - self.ipython_only_bytes
        if shared > slack and freed_bytes <= only + slack:
            return (f"{format_bytes(shared)} of the {format_bytes(listed)} listed under the failed cell's traceback is "
                    "also held by your variables, so it stays until they are deleted (%oomfix --del NAME frees one "
                    "you no longer need)")
        if freed_bytes > only + slack:
            return (f"{format_bytes(freed_bytes - only)} more than the holders listed: tensors only the failed "
                    "computation reached (its intermediate results and autograd's saved activations), which no name "
                    "holds")
        return ""

    def _repr_html_(self) -> str:
        e = html.escape
        if self.verbose:
            return self.full_html()
        try_line = f"<br>Try: {e(self.suggestions[0])}" if self.suggestions else ""
        return (f'<div class="cudamem-oomfix-diagnosis"><p><b>{e(self.headline())}</b>{try_line}</p>'
                f"<details><summary>figures, holders and all the advice</summary>{self.full_html()}</details></div>")

    def full_html(self) -> str:
        e = html.escape
        where = "" if self.oom.device_index is None else f" on GPU {self.oom.device_index}"
        parts = [
            '<div class="cudamem-oomfix-diagnosis">',
            f"<p><b>CUDA out of memory{e(where)}</b> ({e(KIND_WORDS[self.oom.kind])}): "
            f"<b>{e(self.verdict)}</b>. {e(self.explanation)}</p>",
        ]
        if self.figures:
            rows = "".join(_row("<>", e(label), e(value)) for label, value in self.figures)
            parts.append(f"<table>{rows}</table>")
        categories = "".join(_row("<><", e(words), e(size), e(note)) for words, size, note in self.category_rows())
        if categories:
            parts.append("<table><thead><tr><th style='text-align:left'>at the failure</th><th>size</th>"
                         f"<th style='text-align:left'>from</th></tr></thead><tbody>{categories}</tbody></table>")
        if self.holders:
            rows = "".join(_row("<<>><", f"<code>{e(h.label)}</code>",
                                f"{'variable' if h.user_variable else 'IPython'}, {e(h.kind)}",
                                e(format_bytes(h.cuda_bytes)), e(format_bytes(h.exclusive_bytes)),
                                f"{e(h.detail)}{_internals_html(h)}") for h in self.holders)
            parts.append(
                "<table><thead><tr><th style='text-align:left'>holder</th><th style='text-align:left'>kind</th>"
                "<th>CUDA memory</th><th>only here</th><th style='text-align:left'>detail</th></tr></thead>"
                f"<tbody>{rows}</tbody></table>"
            )
        if self.suggestions:
            items = "".join(f"<li>{e(s)}</li>" for s in self.suggestions)
            parts.append(f"<p>Try:</p><ul>{items}</ul>")
        parts.append("</div>")
        return "".join(parts)


def _row(aligns: str, *cells: str) -> str:
    """One HTML table row of ``cells``, each aligned as ``aligns`` says ("<" left, ">" right)."""
    return "<tr>" + "".join(f"<td style='text-align:{'left' if align == '<' else 'right'}'>{cell}</td>"
                            for align, cell in zip(aligns, cells)) + "</tr>"


def _internals_html(holder: Holder) -> str:
    """Python's and IPython's own names for a holder, one click away (collapsed)."""
    return ("<details style='display:inline'><summary>Python's names</summary>"
            f"<code>{html.escape(holder.internals)}</code></details>") if holder.internals else ""


def _in_user_words(holder: Holder) -> Holder:
    """An output-cache holder named by what the user knows (``Out[3] / _3``), IPython's own names kept aside."""
    if holder.kind is not HolderKind.IPYTHON:
        return holder
    parts = holder.name.split(" / ")
    shown = [part for part in parts if not is_internal_name(part)]
    if len(shown) == len(parts):
        return holder
    return replace(holder, name=" / ".join(shown) or "the last cell's result", internals=holder.name)


def _figures(oom: OomInfo, readings: dict[int, AllocatorReading] | None) -> tuple[tuple[str, str], ...]:
    """The OOM's figures, each process's, and what is allocated and reserved now where the GPU could be read."""
    rows: list[tuple[str, int | None]] = [(label, getattr(oom, name)) for label, name in _FIGURES]
    rows += [(f"process {pid}", used) for pid, used in oom.other_processes]
    if readings:
        rows += [("allocated now", sum(r.allocated_bytes for r in readings.values())),
                 ("reserved now", sum(r.reserved_bytes for r in readings.values()))]
    return tuple((label, format_bytes(value)) for label, value in rows if value is not None)


def _total(holders: list[Holder], attribute: str, sizes: Iterable[int]) -> int:
    """A ``Holders`` total; for a plain list, whose per-holder figures overlap, the largest of ``sizes`` (sure)."""
    total = getattr(holders, attribute, None)
    return total if isinstance(total, int) else max(sizes, default=0)


def is_internal_name(name: str) -> bool:
    """Whether a name is Python's, IPython's or a library's own rather than the user's: a private part
    (``Module._call_impl()``) or a keeper of the last error (``sys.last_exc``, ``InteractiveTB.tb``)."""
    if name.startswith(("sys.", "last_execution_result", "InteractiveTB", "SyntaxTB")):
        return True
    return any(part.startswith("_") for part in name.rstrip("()").split("."))


def _user_frames(names: list[str]) -> list[str]:
    """The frames a user can recognise (their functions, a model's ``forward()``), internals left out."""
    return [name for name in dict.fromkeys(names) if not is_internal_name(name)]


def _graph_kept(holders: list[Holder]) -> bool | None:
    """Whether the failed run kept an autograd graph: its traceback's frames reach saved tensors
    (``Holder.graph_bytes``); ``None`` where the traceback held no device memory (nothing to tell by)."""
    held = [h for h in holders if h.kind is HolderKind.TRACEBACK and h.cuda_bytes > 0]
    return any(h.graph_bytes > 0 for h in held) if held else None


def _traceback_as_one(holders: list[Holder]) -> list[Holder]:
    """The failed cell's exception, traceback and frames as one holder in the user's words: they keep the same
    tensors alive through each other, so listing each repeats one figure; their own names go to ``internals``."""
    parts = [h for h in holders if h.kind is HolderKind.TRACEBACK]
    if not parts:
        return list(holders)
    by_size = sorted(parts, key=lambda h: -h.cuda_bytes)
    frames = list(dict.fromkeys(h.name for h in by_size if h.origin is Origin.FRAME))
    others = list(dict.fromkeys(h.name for h in by_size if h.origin is not Origin.FRAME))
    shown = _user_frames(frames)
    where = f" (in {', '.join(shown[:3])}{', ...' if len(shown) > 3 else ''})" if shown else ""
    merged = Holder(f"the failed cell's traceback{where}", HolderKind.TRACEBACK, max(h.cuda_bytes for h in parts),
                    user_variable=False, exclusive_bytes=max(h.exclusive_bytes for h in parts),
                    tensor_count=max(h.tensor_count for h in parts), origin=Origin.EXCEPTION,
                    internals="; ".join([f"frame of {name}" for name in frames] + others))
    result = [h for h in holders if h.kind is not HolderKind.TRACEBACK]
    result.insert(holders.index(parts[0]), merged)  # where the first part was: it keeps its place among equals
    return sorted(result, key=lambda h: -h.cuda_bytes)


def failure_categories(oom: OomInfo, model_state: dict[Category, int] | None,
                       namespace_bytes: int = 0) -> dict[Category, int] | None:
    """The failure's memory by category: the model state as read from the objects, what the user's variables
    hold beyond it (``Category.OTHER``, where any), and as activations the rest of what the allocator held plus
    the failed request. ``None`` without the figures to do it."""
    if not model_state or not any(model_state.values()) or oom.allocated_bytes is None:
        return None
    held = {category: int(model_state.get(category, 0)) for category in MODEL_STATE}
    variables = max(namespace_bytes - sum(held.values()), 0)
    needed = oom.allocated_bytes + (oom.requested_bytes or 0)
    split = {**held, Category.OTHER: variables} if variables else held
    return {**split, Category.ACTIVATIONS: max(needed - sum(split.values()), 0)}


def _words(category: Category) -> str:
    """A category as the diagnosis names it: the variables' tensors are the user's, not "other"."""
    return "your variables" if category is Category.OTHER else category.words


def _room_left(oom: OomInfo, capped: bool) -> str:
    """What the cell needed more than: the cap, or what was left (and free, where the message says)."""
    if capped:
        return (f"the per-process cap allows ({format_bytes(oom.allowed_bytes)}, "
                "set by torch.cuda.set_per_process_memory_fraction)")
    return "was left" if oom.free_bytes is None else f"was left ({format_bytes(oom.free_bytes)} was free)"


def _what_cleanup_frees(oom: OomInfo, holders: list[Holder], own: int, cached_now: int, verdict: Verdict) -> str:
    """What the explanation adds: the failed cell's traceback's own tensors (``own`` bytes), and a cache
    that a non-allocator failure could not use, both of which the cleanup frees."""
    text = ""
    if own >= MiB:
        frames = _user_frames([h.name for h in holders if h.origin is Origin.FRAME])
        where = f" (in {', '.join(frames[:3])})" if frames else ""
        text += (f" The failed cell's traceback still holds {format_bytes(own)} of its own tensors{where}; "
                 "the cleanup frees it.")
    if oom.kind is not OomKind.ALLOCATOR and cached_now and verdict is not Verdict.FRAGMENTATION:
        text += (f" PyTorch's cache holds {format_bytes(cached_now)} unused, which {KIND_WORDS[oom.kind]} cannot use "
                 "until the cleanup returns it (empty_cache).")
    return text


def _with_category_advice(suggestions: list[str], categories: dict[Category, int], holders: list[Holder]) -> list[str]:
    """The advice for what the cell needed, by category; where activations lead, it replaces the general
    advice on batch, autocast and checkpointing (said again with this cell's bytes)."""
    fitting = advice.category_advice(categories, graph_kept=_graph_kept(holders))
    if fitting and fitting[0].category is Category.ACTIVATIONS:
        general = set(advice.needs_more_advice()) | set(advice.too_big_advice(capped=False))
        suggestions = [item for item in suggestions if item not in general]
    return suggestions + [item.text("what the cell needed") for item in fitting]


def _fits_without_variables(oom: OomInfo, model_state: dict[Category, int] | None, namespace: int,
                            cache_only: int) -> bool:
    """Whether the cell's own need fits once what the cleanup can free is gone: the user's variables'
    tensors beyond the models' state (``--del``) and IPython's output cache. Unknown (``False``) where the
    models' state could not be read: the variables' figure would count the weights the cell needs."""
    if model_state is None or oom.allocated_bytes is None or oom.capacity_bytes is None:
        return False
    variables = max(namespace - sum(model_state.get(category, 0) for category in MODEL_STATE), 0)
    needed = oom.allocated_bytes + (oom.requested_bytes or 0)
    return (variables >= _SIGNIFICANT_SHARE * oom.capacity_bytes
            and needed - variables - cache_only <= oom.capacity_bytes)


def diagnose(
    oom: OomInfo,
    holders: list[Holder],
    readings: dict[int, AllocatorReading] | None,
    model_state: dict[Category, int] | None = None,
) -> Diagnosis:
    """Decide the verdict (see the module docstring) from the OOM's figures, the holders and the
    allocator's readings taken after the failure (``None`` where there is no GPU to read); with
    ``model_state`` (bytes of parameters, gradients and optimizer state), split the failure by category."""
    renamed = copy.copy(holders)  # a ``Holders`` keeps its totals; the caller's list is left as it was
    renamed[:] = [_in_user_words(h) for h in holders]
    holders = renamed
    capacity = oom.capacity_bytes
    asked = oom.requested_bytes
    kept = [h for h in holders if not h.user_variable]  # by IPython: its output cache and the traceback
    ipython_only = _total(holders, "ipython_only_bytes",
                          (h.exclusive_bytes for h in kept if h.kind in (HolderKind.IPYTHON, HolderKind.TRACEBACK)))
    cache_only = _total(holders, "cache_only_bytes", (h.exclusive_bytes for h in kept if h.kind is HolderKind.IPYTHON))
    namespace = _total(holders, "namespace_bytes", (h.cuda_bytes for h in holders if h.user_variable))
    cached_now = sum(r.reserved_unallocated_bytes for r in readings.values()) if readings else 0
    capped = oom.allowed_bytes is not None and oom.total_bytes is not None and oom.allowed_bytes < oom.total_bytes
    categories = failure_categories(oom, model_state, namespace)
    suggestions: list[str] = []
    if oom.exceeds_capacity:
        verdict = Verdict.TOO_BIG
        limit = "the per-process cap" if capped else "the card"
        explanation = (
            f"one allocation asked for {format_bytes(asked)}, more than {limit} allows "
            f"({format_bytes(capacity)}): no cleanup can make it fit; the computation must shrink."
        )
        suggestions += advice.too_big_advice(capped)
    elif oom.looks_fragmented:
        verdict = Verdict.FRAGMENTATION
        explanation = (
            f"PyTorch had {format_bytes(oom.reserved_unallocated_bytes)} cached but unallocated, enough for the "
            f"{format_bytes(asked)} asked, but not in one piece."
        )
        suggestions += advice.fragmentation_advice(oom.reserved_unallocated_bytes)
    elif cache_only > 0 and (asked is None or cache_only >= asked) and (
            capacity is None or cache_only >= _SIGNIFICANT_SHARE * capacity):
        verdict = Verdict.HELD_BY_IPYTHON
        keepers = [h.label for h in holders if h.kind is HolderKind.IPYTHON][:3]
        explanation = (
            f"{format_bytes(cache_only)} is kept alive only by IPython's output cache "
            f"({'; '.join(keepers)}), not by any of your variables; the cleanup releases it."
        )
        suggestions += advice.held_by_ipython_advice()
    elif capacity is not None and (namespace >= _NAMESPACE_SHARE * capacity
                                   or _fits_without_variables(oom, model_state, namespace, cache_only)):
        verdict = Verdict.HELD_BY_NAMESPACE
        largest = [h for h in holders if h.user_variable][:3]
        explanation = (
            f"your variables hold {format_bytes(namespace)} of the {format_bytes(capacity)} this process may use "
            f"(largest: {', '.join(f'{h.label} {format_bytes(h.cuda_bytes)}' for h in largest)})."
        )
        # A gradient is not a variable: deleting the tensor it belongs to frees it.
        named = [(h.name, h.exclusive_bytes) for h in largest if h.kind is not HolderKind.GRADIENT]
        suggestions += advice.held_by_namespace_advice(named)
    else:
        verdict = Verdict.TOO_BIG
        explanation = (
            f"the cell needs more GPU memory than {_room_left(oom, capped)}; a smaller or cheaper computation must fit."
        )
        suggestions += advice.needs_more_advice()
    explanation += _what_cleanup_frees(oom, holders, ipython_only - cache_only, cached_now, verdict)
    if categories is not None and verdict not in (Verdict.FRAGMENTATION, Verdict.HELD_BY_IPYTHON):
        suggestions = _with_category_advice(suggestions, categories, holders)
    stuck = oom.reserved_unallocated_bytes or 0
    # Not for a request larger than all the room there is (not ``fits_unfragmented``): no allocator setting helps.
    if (verdict is not Verdict.FRAGMENTATION and oom.fits_unfragmented and capacity
            and stuck >= _SIGNIFICANT_SHARE * capacity):
        suggestions.append(advice.cached_unusable_advice(stuck))
    return Diagnosis(oom, _traceback_as_one(holders), verdict, explanation, tuple(suggestions), readings,
                     ipython_only_bytes=ipython_only, cache_only_bytes=cache_only, namespace_bytes=namespace,
                     figures=_figures(oom, readings), categories=categories)
