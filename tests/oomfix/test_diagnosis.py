"""Verdicts from OOM figures and holders, and their text and HTML renderings."""

from __future__ import annotations

from dataclasses import replace

import pytest

from jupyter_cudamem.oomfix.diagnosis import EXPANDABLE, Verdict, diagnose
from jupyter_cudamem.attribution.holders import Holder, HolderKind, Holders, Origin
from jupyter_cudamem.oom import OomInfo, OomKind, parse_oom
from jupyter_cudamem.sources.base import AllocatorReading

GiB, MiB = 1024**3, 1024**2


def oom_text(
    asked: str,
    total: str = "79.18 GiB",
    allocated: str = "1.00 GiB",
    unallocated: str = "0 bytes",
    allowed: str | None = None,
) -> str:
    cap = f"{allowed} allowed; " if allowed else ""
    return (
        f"CUDA out of memory. Tried to allocate {asked}. GPU 0 has a total capacity of {total} of which 1.00 GiB "
        f"is free. Including non-PyTorch memory, this process has 2.00 GiB memory in use. {cap}Of the allocated "
        f"memory {allocated} is allocated by PyTorch, and {unallocated} is reserved by PyTorch but unallocated."
    )


def holders(*items: Holder, namespace: int = 0, ipython_only: int = 0, cache_only: int = 0) -> Holders:
    result = Holders(items)
    result.namespace_bytes = namespace
    result.ipython_only_bytes = ipython_only
    result.cache_only_bytes = cache_only
    return result


def test_allocation_larger_than_the_card() -> None:
    d = diagnose(parse_oom(oom_text("200.00 GiB")), [], None)
    assert d.verdict == "too big for the card" and d.verdict is Verdict.TOO_BIG
    assert "200.00 GiB" in d.explanation and "the card" in d.explanation


def test_allocation_larger_than_the_cap_suggests_raising_it() -> None:
    d = diagnose(parse_oom(oom_text("8.00 GiB", allowed="4.00 GiB")), [], None)
    assert d.verdict == "too big for the card"
    assert "per-process cap" in d.explanation
    assert any("set_per_process_memory_fraction" in s for s in d.suggestions)


def test_fragmentation() -> None:
    d = diagnose(
        parse_oom(oom_text("2.00 GiB", total="40.00 GiB", allocated="30.00 GiB", unallocated="8.00 GiB")), [], None
    )
    assert d.verdict == "fragmentation" and d.verdict is Verdict.FRAGMENTATION
    assert any(EXPANDABLE in s for s in d.suggestions)


def test_held_by_ipython_after_the_error() -> None:
    out = Holder("Out[3] / _3 / _", HolderKind.IPYTHON, 3 * GiB, False, 3 * GiB, 1)
    model = Holder("model", HolderKind.MODULE, 1 * GiB, True, 1 * GiB, 10, "parameters 1.00 GiB")
    d = diagnose(
        parse_oom(oom_text("2.00 GiB", total="8.00 GiB", allocated="5.00 GiB")),
        holders(out, model, namespace=1 * GiB, ipython_only=3 * GiB, cache_only=3 * GiB),
        {0: AllocatorReading(5 * GiB, 6 * GiB, 5 * GiB, 6 * GiB)},
    )
    assert d.verdict == "held by IPython after the error" and d.verdict is Verdict.HELD_BY_IPYTHON
    assert "3.00 GiB" in d.explanation and "Out[3]" in d.explanation
    assert "traceback" not in d.explanation
    assert ("allocated now", "5.00 GiB") in d.figures and ("reserved now", "6.00 GiB") in d.figures


def test_the_first_line_counts_the_traceback_the_cleanup_frees_beside_the_output_cache() -> None:
    # Notebook 4's similarity search: Out[15] holds 1.12 GiB and the failed call's frame 1.13 GiB of its own;
    # the cleanup frees both, so the first line says both, not the output cache's alone.
    out = Holder("Out[15] / _15 / _", HolderKind.IPYTHON, 1152 * MiB, False, 1152 * MiB, 1)
    frame = Holder("nearest_centroid()", HolderKind.TRACEBACK, 1157 * MiB, False, 1157 * MiB, 1, origin=Origin.FRAME)
    d = diagnose(parse_oom(oom_text("990.00 MiB", total="8.00 GiB", allocated="3.66 GiB")),
                 holders(out, frame, ipython_only=2309 * MiB, cache_only=1152 * MiB), None)
    assert d.verdict is Verdict.HELD_BY_IPYTHON
    assert d.cause() == ("2.25 GiB was held only by IPython: its output cache 1.12 GiB, the failed cell's "
                         "traceback 1.13 GiB")
    alone = diagnose(parse_oom(oom_text("990.00 MiB", total="8.00 GiB", allocated="3.66 GiB")),
                     holders(out, ipython_only=1152 * MiB, cache_only=1152 * MiB), None)
    assert alone.cause() == "1.12 GiB was held only by IPython's output cache"


def test_the_failed_cells_own_frames_are_reported_but_do_not_make_the_verdict() -> None:
    frame = Holder("f()", HolderKind.TRACEBACK, 4 * GiB, False, 4 * GiB, 1, origin=Origin.FRAME)
    d = diagnose(
        parse_oom(oom_text("2.00 GiB", total="8.00 GiB", allocated="5.00 GiB")),
        holders(frame, ipython_only=4 * GiB, cache_only=0),
        None,
    )
    assert d.verdict == "too big for the card"
    assert "traceback still holds 4.00 GiB of its own tensors (in f())" in d.explanation


def test_ipython_share_below_the_request_is_not_the_verdict() -> None:
    out = Holder("Out[3]", HolderKind.IPYTHON, 100 * MiB, False, 100 * MiB, 1)
    d = diagnose(
        parse_oom(oom_text("2.00 GiB", total="8.00 GiB")),
        holders(out, ipython_only=100 * MiB, cache_only=100 * MiB),
        None,
    )
    assert d.verdict == "too big for the card"
    assert "more GPU memory than was left" in d.explanation


def test_held_by_namespace_suggests_deleting_the_largest() -> None:
    old = Holder("old_model", HolderKind.MODULE, 5 * GiB, True, 5 * GiB, 100)
    opt = Holder("opt (Adam state)", HolderKind.OPTIMIZER, 2 * GiB, True, 2 * GiB, 200)
    d = diagnose(
        parse_oom(oom_text("1.00 GiB", total="10.00 GiB", allocated="8.00 GiB")),
        holders(old, opt, namespace=7 * GiB),
        None,
    )
    assert d.verdict == "held by namespace" and d.verdict is Verdict.HELD_BY_NAMESPACE
    assert "%oomfix --del old_model if you no longer need it (frees up to 5.00 GiB)" in d.suggestions
    assert any(s.startswith("%oomfix --del opt ") for s in d.suggestions)


def test_plain_list_of_holders_uses_the_safe_estimate() -> None:
    a = Holder("Out[4]", HolderKind.IPYTHON, 3 * GiB, False, 3 * GiB, 1)
    b = Holder("last_execution_result.result", HolderKind.IPYTHON, 3 * GiB, False, 3 * GiB, 1)
    c = Holder("sys.last_value", HolderKind.TRACEBACK, 5 * GiB, False, 5 * GiB, 1)
    d = diagnose(parse_oom(oom_text("1.00 GiB", total="8.00 GiB")), [a, b, c], None)
    assert d.cache_only_bytes == 3 * GiB  # overlapping holders are not summed
    assert d.ipython_only_bytes == 5 * GiB
    assert d.verdict == "held by IPython after the error"


def test_cublas_with_a_full_cache_says_cleanup_returns_it() -> None:
    d = diagnose(
        parse_oom("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        [],
        {0: AllocatorReading(1 * GiB, 3 * GiB, 1 * GiB, 3 * GiB)},
    )
    assert d.verdict == "too big for the card"
    assert "2.00 GiB unused" in d.explanation and "cuBLAS" in d.explanation


def test_renderings_show_verdict_figures_holders_and_escape_html() -> None:
    weird = Holder("x<script>", HolderKind.TENSOR, 1 * GiB, True, 1 * GiB, 1, "(1024,), torch.float32")
    d = diagnose(parse_oom(oom_text("200.00 GiB")), holders(weird, namespace=1 * GiB), None)
    # First the cause in a few words and the first advice; the rest behind --verbose (HTML: <details>).
    short = repr(d).splitlines()
    assert short[0] == ("CUDA out of memory on GPU 0 (PyTorch's allocator): one allocation of 200.00 GiB is more "
                        "than the 79.18 GiB card allows")
    assert short[1].startswith("  try: ") and "--verbose" in short[2] and len(short) == 3
    text = repr(replace(d, verbose=True))
    assert text == d.full_text()
    assert text.startswith("CUDA out of memory on GPU 0 (PyTorch's allocator): too big for the card")
    assert "asked for" in text and "200.00 GiB" in text and "x<script>" in text
    page = d._repr_html_()
    assert "<b>too big for the card</b>" in page and "<details><summary>" in page
    assert "x&lt;script&gt;" in page and "<script>" not in page
    text = repr(d)

    class Printer:
        def __init__(self) -> None:
            self.out = ""

        def text(self, value: str) -> None:
            self.out += value

    printer = Printer()
    d._repr_pretty_(printer, False)
    assert printer.out == text


def test_the_failed_traceback_is_one_line_and_a_cap_is_named():
    oom = OomInfo(
        kind=OomKind.ALLOCATOR, message="CUDA out of memory.", device_index=0, requested_bytes=512 * MiB,
        total_bytes=80 * GiB, free_bytes=74 * GiB, allowed_bytes=4 * GiB, allocated_bytes=3 * GiB,
    )
    holders = [
        Holder(
            "sys.last_exc / sys.last_value", HolderKind.TRACEBACK, 900 * MiB, False, 768 * MiB, origin=Origin.EXCEPTION
        ),
        Holder("relu()", HolderKind.TRACEBACK, 512 * MiB, False, origin=Origin.FRAME),
        Holder("Module._call_impl()", HolderKind.TRACEBACK, 140 * MiB, False, origin=Origin.FRAME),
        Holder("Module._call_impl()", HolderKind.TRACEBACK, 140 * MiB, False, origin=Origin.FRAME, occurrence=2),
        Holder("model", HolderKind.MODULE, 600 * MiB, True, 600 * MiB),
    ]
    d = diagnose(oom, holders, None)
    assert [h.name for h in d.holders] == [
        "the failed cell's traceback (in relu())",
        "model",
    ]
    # Python's own names are one click (HTML details) or -o (Holder.internals) away, never in the text.
    assert d.holders[0].internals == "frame of relu(); frame of Module._call_impl(); sys.last_exc / sys.last_value"
    assert "_call_impl" not in d.text() and "sys.last" not in d.text()
    assert "<details" in d._repr_html_() and "Module._call_impl()" in d._repr_html_()
    assert d.holders[0].cuda_bytes == 900 * MiB
    assert "per-process cap allows (4.00 GiB" in d.explanation
    assert "74.00 GiB was free" not in d.explanation


# -- the split by category, from the models' state read after the failure ------------------------------
from jupyter_cudamem.breakdown import Category  # noqa: E402

# Nothing here runs a library whose version `make test-min` changes (tests/versioned.py).
pytestmark = pytest.mark.dependency_free


def test_activations_dominate_and_get_the_batch_autocast_and_checkpointing_advice() -> None:
    # 10 GiB allocated and 2 GiB asked: 12 GiB needed; the models' state is 1 + 1 + 2 = 4 GiB, so the
    # activations and temporaries are the other 8 GiB
    oom = parse_oom(oom_text("2.00 GiB", allocated="10.00 GiB"))
    state = {Category.PARAMETERS: GiB, Category.GRADIENTS: GiB, Category.OPTIMIZER_STATE: 2 * GiB}
    d = diagnose(oom, [], None, state)
    assert d.categories == {**state, Category.ACTIVATIONS: 8 * GiB}
    # A table, not a sentence: one row a category, the largest marked, and named in the first line.
    rows = d.category_rows()
    assert [(words, size) for words, size, _ in rows] == [
        ("parameters", "1.00 GiB"), ("gradients", "1.00 GiB"), ("optimizer state", "2.00 GiB"), ("activations", "8.00 GiB")]
    assert rows[-1][2].endswith("the largest") and not any(note.endswith("the largest") for _, _, note in rows[:-1])
    assert "At the failure" not in d.explanation and d.cause().endswith("the largest part: activations, 8.00 GiB")
    assert "    activations         8.00 GiB  the rest of what was allocated and asked for; the largest" in d.full_text()
    assert any(s.startswith("half the batch") and "saves about 4.00 GiB of what the cell needed" in s for s in d.suggestions)
    assert any(s.startswith("torch.autocast") and "saves about 4.00 GiB of what the cell needed" in s for s in d.suggestions)
    assert any("checkpointing" in s and "saves up to 8.00 GiB" in s for s in d.suggestions)
    # said once, with this cell's bytes: the general lines on batch, autocast and checkpointing are left out
    assert sum("autocast" in s for s in d.suggestions) == 1 and sum("checkpoint" in s for s in d.suggestions) == 1
    # gradients exist (1 GiB): the cell trains, so no_grad is not offered
    assert not any("no_grad" in s for s in d.suggestions)


def test_activations_of_a_cell_without_gradients_get_no_grad_too() -> None:
    oom = parse_oom(oom_text("2.00 GiB", allocated="10.00 GiB"))
    state = {Category.PARAMETERS: GiB, Category.GRADIENTS: 0, Category.OPTIMIZER_STATE: 0}
    d = diagnose(oom, [], None, state)
    assert any(s.startswith("torch.no_grad()") and "saves up to 11.00 GiB" in s for s in d.suggestions)


@pytest.mark.parametrize("graph_bytes", [0, 3 * GiB])
def test_no_grad_and_checkpointing_are_offered_only_where_the_traceback_shows_a_graph(graph_bytes) -> None:
    # A cell that trains nothing ran out in a model's call. Where its traceback's tensors keep no autograd
    # graph (generate(), which runs under no_grad itself), neither no_grad nor checkpointing would save
    # any of it; where they keep one (a forward pass with autograd on), both are offered.
    oom = parse_oom(oom_text("2.00 GiB", allocated="10.00 GiB"))
    state = {Category.PARAMETERS: GiB, Category.GRADIENTS: 0, Category.OPTIMIZER_STATE: 0}
    frames = [Holder("forward()", HolderKind.TRACEBACK, 6 * GiB, False, origin=Origin.FRAME, graph_bytes=graph_bytes),
              Holder("sys.last_exc", HolderKind.TRACEBACK, 6 * GiB, False, origin=Origin.EXCEPTION,
                     graph_bytes=graph_bytes)]
    d = diagnose(oom, frames, None, state)
    offered = {name: any(name in s for s in d.suggestions) for name in ("no_grad", "checkpointing")}
    assert offered == {"no_grad": bool(graph_bytes), "checkpointing": bool(graph_bytes)}
    assert any(s.startswith("half the batch") for s in d.suggestions)
    assert any(s.startswith("torch.autocast") for s in d.suggestions)


def test_optimizer_state_dominates_and_gets_a_lower_precision_or_fused_optimizer() -> None:
    # 9 GiB allocated, 512 MiB asked: 9.5 GiB needed, 2 + 2 + 4 = 8 GiB of it the model state
    oom = parse_oom(oom_text("512.00 MiB", allocated="9.00 GiB"))
    state = {Category.PARAMETERS: 2 * GiB, Category.GRADIENTS: 2 * GiB, Category.OPTIMIZER_STATE: 4 * GiB}
    d = diagnose(oom, [], None, state)
    assert d.categories[Category.ACTIVATIONS] == 1536 * MiB
    assert any(s.startswith("a lower-precision optimizer") and "saves about 2.00 GiB" in s for s in d.suggestions)
    # not in the step (unknown after a failure): the foreach step's copies are bounded by the parameters
    assert any(s.startswith("fused=True") and "saves up to 2.00 GiB" in s for s in d.suggestions)


def test_parameters_dominate_and_get_a_smaller_dtype() -> None:
    # inference: 6 GiB of weights, no gradients or state; 7 GiB allocated + 1 GiB asked: 2 GiB of activations
    oom = parse_oom(oom_text("1.00 GiB", allocated="7.00 GiB"))
    state = {Category.PARAMETERS: 6 * GiB, Category.GRADIENTS: 0, Category.OPTIMIZER_STATE: 0}
    d = diagnose(oom, [], None, state)
    assert any(s.startswith("a smaller dtype") and "saves about 3.00 GiB" in s for s in d.suggestions)


def test_no_model_state_no_split() -> None:
    oom = parse_oom(oom_text("1.00 GiB", allocated="7.00 GiB"))
    assert diagnose(oom, [], None, None).categories is None
    zero = {Category.PARAMETERS: 0, Category.GRADIENTS: 0, Category.OPTIMIZER_STATE: 0}
    d = diagnose(oom, [], None, zero)
    assert d.categories is None and d.category_rows() == [] and "by category" not in d.full_text()


def test_expandable_segments_is_not_advised_for_a_request_larger_than_the_room() -> None:
    # Notebook 01's failure: 4 GiB asked under a 2 GiB cap, with 274.71 MiB cached (13% of the cap).
    text = oom_text("4.00 GiB", allocated="261.29 MiB", unallocated="274.71 MiB", allowed="2.00 GiB")
    d = diagnose(parse_oom(text), [], None)
    assert d.verdict == "too big for the card"
    assert not any(EXPANDABLE in s for s in d.suggestions)
    # 1.5 GiB asked under the same cap: 2 GiB less 261.29 MiB allocated leaves 1.74 GiB, and 1 GiB free
    # on the card plus 274.71 MiB cached is 1.27 GiB: it could not have fit either.
    assert not parse_oom(oom_text("1.50 GiB", allocated="261.29 MiB", unallocated="274.71 MiB",
                                  allowed="2.00 GiB")).fits_unfragmented
    # 1.2 GiB would have fit in one piece (under 1.27 GiB): the cached 274.71 MiB counts, the hint is given.
    fits = parse_oom(oom_text("1.20 GiB", allocated="261.29 MiB", unallocated="274.71 MiB", allowed="2.00 GiB"))
    assert fits.fits_unfragmented
    assert any(EXPANDABLE in s for s in diagnose(fits, [], None).suggestions)


def test_variables_beyond_the_models_state_are_theirs_not_activations_and_not_too_big() -> None:
    # The similarity cell of the tutorial: a 4 GiB cap, 2.75 GiB allocated and 2.00 GiB asked (4.75 GiB
    # needed). The namespace holds 1.75 GiB: a 256 MiB model and old_embeddings' 1.50 GiB. Without
    # old_embeddings the cell needs 3.25 GiB, which fits the cap: its variables are the cause, not its size.
    oom = parse_oom(oom_text("2.00 GiB", total="79.18 GiB", allocated="2.75 GiB", allowed="4.00 GiB"))
    old = Holder("old_embeddings", HolderKind.TENSOR, 1536 * MiB, True, 1536 * MiB, 1)
    model = Holder("model", HolderKind.MODULE, 256 * MiB, True, 256 * MiB, 4)
    state = {Category.PARAMETERS: 256 * MiB, Category.GRADIENTS: 0, Category.OPTIMIZER_STATE: 0}
    d = diagnose(oom, holders(old, model, namespace=1792 * MiB), None, state)
    # 4.75 GiB needed = 256 MiB of parameters + 1.50 GiB of variables + 3.00 GiB of activations
    assert d.categories == {**state, Category.OTHER: 1536 * MiB, Category.ACTIVATIONS: 3 * GiB}
    assert d.verdict is Verdict.HELD_BY_NAMESPACE
    assert d.cause() == ("your variables hold 1.75 GiB of the 4.00 GiB per-process cap; "
                         "the largest part: activations, 3.00 GiB")
    assert ("your variables", "1.50 GiB", "your variables' tensors beyond the models' state") in d.category_rows()
    assert "%oomfix --del old_embeddings if you no longer need it (frees up to 1.50 GiB)" in d.suggestions
    # The cleanup freed what --del old_embeddings named: nothing to explain. Without --del, 1.50 GiB is
    # more than the holders listed, and that is said.
    assert d.cleanup_explanation(1536 * MiB, ("old_embeddings",)) == ""
    assert d.cleanup_explanation(1536 * MiB).startswith("1.50 GiB more than the holders listed")


def test_a_cell_too_big_without_its_variables_is_still_too_big() -> None:
    # The same cap and variables, 3.00 GiB asked: 5.75 GiB needed, 4.25 GiB without old_embeddings, over
    # the 4 GiB cap; its activations are the 4.00 GiB left after the parameters and the variables.
    oom = parse_oom(oom_text("3.00 GiB", total="79.18 GiB", allocated="2.75 GiB", allowed="4.00 GiB"))
    old = Holder("old_embeddings", HolderKind.TENSOR, 1536 * MiB, True, 1536 * MiB, 1)
    state = {Category.PARAMETERS: 256 * MiB, Category.GRADIENTS: 0, Category.OPTIMIZER_STATE: 0}
    d = diagnose(oom, holders(old, namespace=1792 * MiB), None, state)
    assert d.verdict is Verdict.TOO_BIG
    assert d.cause() == "it needs more than the 4.00 GiB per-process cap allows; the largest part: activations, 4.00 GiB"
