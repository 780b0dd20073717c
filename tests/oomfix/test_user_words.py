"""%oomfix speaks the user's words: Python's and IPython's own names (a frame of
``Module._call_impl()``, ``sys.last_exc``, ``InteractiveTB.tb``) and the search's method ("line through
origin") never reach its text, and are one click (HTML details) or ``-o`` away; what the cleanup freed
agrees with the holders listed or says why not."""

from __future__ import annotations

import re

from tests.oomfix.test_oomfix_magic import env, run  # noqa: F401  (the fixture)

from jupyter_cudamem.attribution.holders import Holder, HolderKind, Origin
from jupyter_cudamem.oomfix.outcome import user_reason

FORBIDDEN = re.compile(
    r"frame of|sys\.last|InteractiveTB|SyntaxTB|last_execution_result|line through|per item|"
    r"\b[A-Za-z]\w*\._\w+\("  # a private function or method: Module._call_impl(
)

# A model-like call chain whose private wrapper frame holds a tensor, as torch's Module._call_impl does.
MODEL_CELL = """class Net:
    def __call__(self, n):
        return self._call_impl(n)

    def _call_impl(self, n):
        activations = FakeTensor(2 * GiB, machine=machine)
        return self.forward(n)

    def forward(self, n):
        hidden = FakeTensor(64 * MiB, machine=machine)
        train_step(n)

net = Net()
"""


def _visible_html(html: str) -> str:
    return re.sub(r"<details.*?</details>", "", html, flags=re.S)


def _assert_user_words(text: str) -> None:
    found = FORBIDDEN.findall(text)
    assert not found, f"internal names reached the user: {found}\n{text}"


def test_no_internal_names_in_the_diagnosis_and_outcome(env, capsys):  # noqa: F811
    shell, machine, cell, _ = env
    run(shell, MODEL_CELL)
    failed = run(shell, "batch_size = 6000\npredictions = net(batch_size)\n")
    assert type(failed.error_in_exec).__name__ == "OutOfMemoryError"
    capsys.readouterr()
    outcome = shell.run_line_magic("oomfix", "--yes --verbose -o")
    printed = capsys.readouterr().out
    assert "the failed cell's traceback" in printed and "Net.forward()" in printed
    _assert_user_words(printed)
    _assert_user_words(repr(outcome))
    _assert_user_words(_visible_html(outcome._repr_html_()))
    # The diagnosis as a notebook shows it: Python's names one click away (HTML details).
    shell.run_cell("net(6000)\n", store_history=True)
    diagnosis = shell.run_line_magic("oomfix", "--dry-run -o").diagnosis
    _assert_user_words(diagnosis.text())
    html = diagnosis._repr_html_()
    _assert_user_words(_visible_html(html))
    assert "<details" in html and "Net._call_impl()" in html
    traceback_holder = next(h for h in diagnosis.holders if h.kind is HolderKind.TRACEBACK)
    assert "frame of Net._call_impl()" in traceback_holder.internals


def test_cleanup_that_frees_less_than_listed_says_who_still_holds_it(env, capsys):  # noqa: F811
    shell, machine, cell, _ = env
    run(shell, "images = FakeTensor(1 * GiB, machine=machine)\n"
               "def step(n, data):\n    train_step(n)\n")
    run(shell, "step(6000, images)\n")  # the traceback's frame holds `data`, which is `images`
    capsys.readouterr()
    outcome = shell.run_line_magic("oomfix", "--yes --strategy cleanup --verbose -o")
    assert outcome.freed_bytes == 0
    printed = capsys.readouterr().out
    facts = next(line for line in printed.splitlines() if line.startswith("cleanup freed"))
    assert "also held by your variables" in facts and "--del" in facts, printed
    _assert_user_words(printed)


def test_cleanup_that_frees_more_than_listed_says_what_the_rest_was():
    from jupyter_cudamem.oomfix.diagnosis import diagnose
    from jupyter_cudamem.oom import OomInfo, OomKind

    GiB, MiB = 1024**3, 1024**2
    oom = OomInfo(kind=OomKind.ALLOCATOR, message="CUDA out of memory.", device_index=0, requested_bytes=256 * MiB,
                  total_bytes=80 * GiB, allowed_bytes=4 * GiB, allocated_bytes=int(3.86 * GiB))
    holders = [Holder("GELU.forward()", HolderKind.TRACEBACK, 768 * MiB, False, 256 * MiB, origin=Origin.FRAME),
               Holder("features", HolderKind.TENSOR, 256 * MiB, True, 256 * MiB)]
    diagnosis = diagnose(oom, holders, None)
    why = diagnosis.cleanup_explanation(int(3.25 * GiB))
    assert why.startswith("3.00 GiB more than the holders listed") and "intermediate results" in why
    shared = diagnosis.cleanup_explanation(256 * MiB)  # freed only what nothing else held
    assert shared.startswith("512.00 MiB of the 768.00 MiB listed") and "also held by your variables" in shared
    alone = diagnose(oom, [Holder("f()", HolderKind.TRACEBACK, 768 * MiB, False, 768 * MiB, origin=Origin.FRAME)], None)
    assert alone.cleanup_explanation(768 * MiB) == ""  # freed what was listed: nothing to explain


def test_search_reasons_in_the_users_words():
    # Reasons as ``batchsearch`` writes them.
    for reason in ("surest from 76's peak (line through it and zero)",
                   "line through measured peaks: 812 MiB fixed + 10.039 MiB per sample",
                   "bisection (no peak measured)", "probe", "rerun of the largest batch that fitted"):
        words = user_reason(reason)
        _assert_user_words(words)
    assert user_reason("surest from 76's peak (line through it and zero)") == (
        "surest from 76's peak (all of it taken as growing with the batch)"
    )
    assert "line through" not in user_reason("surest from 3's peak (line through it and its parameters)")
    assert user_reason("line through measured peaks: 812 MiB fixed + 10.039 MiB per sample") == (
        "predicted from the measured peaks: 812 MiB fixed + 10.039 MiB per sample"
    )
