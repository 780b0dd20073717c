"""Why a cell ran out of GPU memory, in one verdict, with the figures and holders behind it.

The verdicts (``Verdict``) are checked in their order, the first that applies acted on; beside the verdict the
failure's memory is split by category (the model state, the user's variables, activations and temporaries), and
the largest category gets the advice that fits it. Each rule and its reason: docs/oomfix-diagnosis.md.
"""

from __future__ import annotations

import copy
import html
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
                         f"{format_bytes(self.cache_only_bytes)}, the failed cell's traceback {format_bytes(traceback)}")
        elif self.verdict is Verdict.HELD_BY_NAMESPACE:
            words = f"your variables hold {format_bytes(self.namespace_bytes)} of {limit}"
        elif oom.exceeds_capacity:
            words = f"one allocation of {format_bytes(oom.requested_bytes)} is more than {limit} allows"
        else:
            words = f"it needs more than {limit} allows" if capped or oom.free_bytes is None else (
                f"it needs more than the {format_bytes(oom.free_bytes)} free on the card")
        shown = self._shown_categories()
        if shown:
            largest = max(shown, key=lambda category: shown[category])
            words += f"; the largest part: {_words(largest)}, {format_bytes(shown[largest])}"
        return words

    def _shown_categories(self) -> dict[Category, int]:
        """The split by category, where it explains the verdict (not where the memory was there but in
        pieces, or held by IPython's cache)."""
        if not self.categories or self.verdict in (Verdict.FRAGMENTATION, Verdict.HELD_BY_IPYTHON):
            return {}
        return self.categories

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
            for holder in self.holders:
                owner = "variable" if holder.user_variable else "IPython"
                only = (
                    f", {format_bytes(holder.exclusive_bytes)} only here"
                    if holder.exclusive_bytes and holder.exclusive_bytes != holder.cuda_bytes
                    else ""
                )
                detail = f" [{holder.detail}]" if holder.detail else ""
                lines.append(
                    f"    {format_bytes(holder.cuda_bytes):>11}  {holder.label} ({owner}, {holder.kind}{only}){detail}"
                )
        if self.suggestions:
            lines.append("  try:")
            lines.extend(f"    - {suggestion}" for suggestion in self.suggestions)
        return "\n".join(lines)

    def category_rows(self) -> list[tuple[str, str, str]]:
        """(category, size, where the figure comes from) at the failure; the largest marked."""
        shown = self._shown_categories()
        if not shown:
            return []
        largest = max(shown, key=lambda category: shown[category])
        rows = []
        for category, size in shown.items():
            source = ("the rest of what was allocated and asked for" if category is Category.ACTIVATIONS
                      else "your variables' tensors beyond the models' state" if category is Category.OTHER
                      else "read from your models and optimizers")
            rows.append((_words(category), format_bytes(size), source + ("; the largest" if category is largest else "")))
        return rows

    def cleanup_explanation(self, freed_bytes: int | None, deleted: tuple[str, ...] = ()) -> str:
        """Why what the cleanup freed differs from what the holders above listed, or "" when they agree: it
        frees what only IPython, the traceback and the ``deleted`` variables held, and what no name reaches."""
        if freed_bytes is None:
            return ""
        listed = max((h.cuda_bytes for h in self.holders if not h.user_variable), default=0)
        named = sum(h.exclusive_bytes for h in self.holders if h.user_variable and h.name in deleted)
        only = self.ipython_only_bytes + named
        slack = max(MiB, int(0.1 * max(listed, freed_bytes)))
        if listed - self.ipython_only_bytes > slack and freed_bytes <= only + slack:
            shared = listed - self.ipython_only_bytes
            return (
                f"{format_bytes(shared)} of the {format_bytes(listed)} listed under the failed cell's traceback is "
                "also held by your variables, so it stays until they are deleted (%oomfix --del NAME frees one "
                "you no longer need)"
            )
        if freed_bytes > only + slack:
            rest = freed_bytes - only
            return (
                f"{format_bytes(rest)} more than the holders listed: tensors only the failed computation reached "
                "(its intermediate results and autograd's saved activations), which no name holds"
            )
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
            rows = "".join(
                f"<tr><td style='text-align:left'>{e(label)}</td><td style='text-align:right'>{e(value)}</td></tr>"
                for label, value in self.figures
            )
            parts.append(f"<table>{rows}</table>")
        categories = self.category_rows()
        if categories:
            rows = "".join(
                f"<tr><td style='text-align:left'>{e(words)}</td><td style='text-align:right'>{e(size)}</td>"
                f"<td style='text-align:left'>{e(note)}</td></tr>"
                for words, size, note in categories
            )
            parts.append("<table><thead><tr><th style='text-align:left'>at the failure</th><th>size</th>"
                         f"<th style='text-align:left'>from</th></tr></thead><tbody>{rows}</tbody></table>")
        if self.holders:
            rows = "".join(
                "<tr>"
                f"<td style='text-align:left'><code>{e(h.label)}</code></td>"
                f"<td style='text-align:left'>{'variable' if h.user_variable else 'IPython'}, {e(h.kind)}</td>"
                f"<td style='text-align:right'>{e(format_bytes(h.cuda_bytes))}</td>"
                f"<td style='text-align:right'>{e(format_bytes(h.exclusive_bytes))}</td>"
                f"<td style='text-align:left'>{e(h.detail)}{_internals_html(h)}</td>"
                "</tr>"
                for h in self.holders
            )
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


def _internals_html(holder: Holder) -> str:
    """Python's and IPython's own names for a holder, one click away (collapsed)."""
    if not holder.internals:
        return ""
    return (
        "<details style='display:inline'><summary>Python's names</summary>"
        f"<code>{html.escape(holder.internals)}</code></details>"
    )


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
    rows: list[tuple[str, str]] = []

    def add(label: str, value: int | None) -> None:
        if value is not None:
            rows.append((label, format_bytes(value)))

    add("asked for", oom.requested_bytes)
    add("card capacity", oom.total_bytes)
    add("per-process cap", oom.allowed_bytes)
    add("free on the card", oom.free_bytes)
    add("held by this process", oom.process_bytes)
    add("allocated by PyTorch", oom.allocated_bytes)
    add("in private pools (CUDA graphs)", oom.private_pool_bytes)
    add("reserved by PyTorch, unallocated", oom.reserved_unallocated_bytes)
    for pid, used in oom.other_processes:
        add(f"process {pid}", used)
    if readings:
        add("allocated now", sum(r.allocated_bytes for r in readings.values()))
        add("reserved now", sum(r.reserved_bytes for r in readings.values()))
    return tuple(rows)


def _ipython_only(holders: list[Holder], attribute: str, kinds: tuple[HolderKind, ...]) -> int:
    total = getattr(holders, attribute, None)
    if isinstance(total, int):
        return total
    # A plain list: per-holder figures overlap, so the largest is what can be claimed for sure.
    return max((h.exclusive_bytes for h in holders if not h.user_variable and h.kind in kinds), default=0)


def _namespace(holders: list[Holder]) -> int:
    total = getattr(holders, "namespace_bytes", None)
    if isinstance(total, int):
        return total
    return max((h.cuda_bytes for h in holders if h.user_variable), default=0)


def is_internal_name(name: str) -> bool:
    """Whether a name is Python's, IPython's or a library's own rather than the user's: a private part
    (``Module._call_impl()``, ``Conv2d._conv_forward()``) or IPython's and Python's keepers of the last
    error (``sys.last_exc``, ``InteractiveTB.tb``, ``last_execution_result.error_in_exec``)."""
    if name.startswith(("sys.", "last_execution_result", "InteractiveTB", "SyntaxTB")):
        return True
    return any(part.startswith("_") for part in name.rstrip("()").split("."))


def _user_frames(names: list[str]) -> list[str]:
    """The frames a user can recognise (their functions, a model's ``forward()``), internals left out."""
    return [name for name in dict.fromkeys(names) if not is_internal_name(name)]


def _graph_kept(holders: list[Holder]) -> bool | None:
    """Whether the failed run kept an autograd graph, as its traceback shows: its frames hold the
    run's tensors, and a graph's saved tensors are reached through them (``Holder.graph_bytes``).
    ``None`` where the traceback held no device memory (nothing to tell by)."""
    held = [h for h in holders if h.kind is HolderKind.TRACEBACK and h.cuda_bytes > 0]
    if not held:
        return None
    return any(h.graph_bytes > 0 for h in held)


def _traceback_as_one(holders: list[Holder]) -> list[Holder]:
    """The failed cell's exception, traceback and every frame on it, shown as one holder in the user's words.

    They keep the same tensors alive through each other (a frame of ``Module._call_impl()`` per layer,
    ``sys.last_value``, ``InteractiveTB.tb``...), so listing each repeats one figure many times; the
    names Python and IPython give them go to ``Holder.internals`` (``-o``, the HTML's details).
    """
    parts = [h for h in holders if h.kind is HolderKind.TRACEBACK]
    if not parts:
        return list(holders)
    frames: list[str] = []
    others: list[str] = []
    for holder in sorted(parts, key=lambda h: -h.cuda_bytes):
        if holder.origin is Origin.FRAME:
            if holder.name not in frames:
                frames.append(holder.name)
        elif holder.name not in others:
            others.append(holder.name)
    shown = _user_frames(frames)
    where = f" (in {', '.join(shown[:3])}{', ...' if len(shown) > 3 else ''})" if shown else ""
    internals = [f"frame of {name}" for name in frames] + others
    merged = Holder(
        name=f"the failed cell's traceback{where}",
        kind=HolderKind.TRACEBACK,
        cuda_bytes=max(h.cuda_bytes for h in parts),
        user_variable=False,
        exclusive_bytes=max(h.exclusive_bytes for h in parts),
        tensor_count=max(h.tensor_count for h in parts),
        origin=Origin.EXCEPTION,
        internals="; ".join(internals),
    )
    result: list[Holder] = []
    for holder in holders:
        if holder.kind is not HolderKind.TRACEBACK:
            result.append(holder)
        elif merged not in result:
            result.append(merged)
    return sorted(result, key=lambda h: -h.cuda_bytes)


def failure_categories(oom: OomInfo, model_state: dict[Category, int] | None,
                       namespace_bytes: int = 0) -> dict[Category, int] | None:
    """The failure's memory by category: the model state as read from the objects; what the user's
    variables hold beyond it (``namespace_bytes`` less the model state; ``Category.OTHER``, where any); and
    as activations the rest of what the allocator held plus the failed request. ``None`` without the
    figures to do it."""
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
        return (
            f"the per-process cap allows ({format_bytes(oom.allowed_bytes)}, "
            "set by torch.cuda.set_per_process_memory_fraction)"
        )
    if oom.free_bytes is not None:
        return f"was left ({format_bytes(oom.free_bytes)} was free)"
    return "was left"


def _what_cleanup_frees(oom: OomInfo, holders: list[Holder], own: int, cached_now: int, verdict: Verdict) -> str:
    """What the explanation adds: the failed cell's traceback's own tensors (``own`` bytes), and a cache
    that a non-allocator failure could not use, both of which the cleanup frees."""
    text = ""
    if own >= MiB:
        frames = _user_frames([h.name for h in holders if h.origin is Origin.FRAME])
        where = f" (in {', '.join(frames[:3])})" if frames else ""
        text += (
            f" The failed cell's traceback still holds {format_bytes(own)} of its own tensors{where}; "
            "the cleanup frees it."
        )
    if oom.kind is not OomKind.ALLOCATOR and cached_now and verdict is not Verdict.FRAGMENTATION:
        text += (
            f" PyTorch's cache holds {format_bytes(cached_now)} unused, which {KIND_WORDS[oom.kind]} cannot use "
            "until the cleanup returns it (empty_cache)."
        )
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
    ipython_only = _ipython_only(holders, "ipython_only_bytes", (HolderKind.IPYTHON, HolderKind.TRACEBACK))
    cache_only = _ipython_only(holders, "cache_only_bytes", (HolderKind.IPYTHON,))
    namespace = _namespace(holders)
    cached_now = sum(r.reserved_unallocated_bytes for r in readings.values()) if readings else 0
    capped = oom.allowed_bytes is not None and oom.total_bytes is not None and oom.allowed_bytes < oom.total_bytes
    categories = failure_categories(oom, model_state, namespace)

    def significant(size: int) -> bool:
        if size <= 0 or (asked is not None and size < asked):
            return False
        return capacity is None or size >= _SIGNIFICANT_SHARE * capacity

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
    elif significant(cache_only):
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
    if (
        verdict is not Verdict.FRAGMENTATION
        and oom.fits_unfragmented  # a request larger than all the room there is: no allocator setting helps
        and oom.reserved_unallocated_bytes
        and capacity
        and (oom.reserved_unallocated_bytes >= _SIGNIFICANT_SHARE * capacity)
    ):
        suggestions.append(advice.cached_unusable_advice(oom.reserved_unallocated_bytes))
    return Diagnosis(
        oom=oom,
        holders=_traceback_as_one(holders),
        verdict=verdict,
        explanation=explanation,
        suggestions=tuple(suggestions),
        readings=readings,
        ipython_only_bytes=ipython_only,
        cache_only_bytes=cache_only,
        namespace_bytes=namespace,
        figures=_figures(oom, readings),
        categories=categories,
    )
