"""Reading IPython input with raw positions and changing it in place (jupyter_cudamem/cell/source.py, edit.py)."""

from __future__ import annotations

import ast

import pytest
from IPython.core.inputtransformer2 import TransformerManager

from jupyter_cudamem.cell.edit import CellDiff, Edit, apply_edits, insert_line, unified_diff, wrap_in_autocast
from jupyter_cudamem.cell.source import Span, parse_cell


def test_spans_are_raw_characters_past_ipython_syntax_and_unicode():
    source = "%%time\n!echo hi\ntitre = 'é'; bs = 48\n"
    parsed = parse_cell(source)
    assign = parsed.tree.body[-1]
    span = parsed.span(assign.value)
    assert parsed.text(span) == "48" and span.line == 3
    assert parsed.body_line == 2
    assert parsed.raw_line(parsed.tree.body[0]) is None  # !echo was rewritten by IPython: not editable


def test_edits_on_one_line_keep_each_other_valid_and_line_endings_survive():
    source = "x = f(64, 64)\r\ny = 2\r\n"
    edited = apply_edits(source, [Edit(Span(1, 6, 8), "16"), Edit(Span(1, 10, 12), "8")])
    assert edited == "x = f(16, 8)\r\ny = 2\r\n"
    assert insert_line(source, 2, "z = 3") == "x = f(64, 64)\r\nz = 3\r\ny = 2\r\n"
    with pytest.raises(ValueError, match="line 9"):
        apply_edits(source, [Edit(Span(9, 0, 1), "")])


def test_cell_diff_names_the_cell():
    diff = CellDiff("In[3]", "batch_size = 64\n", "batch_size = 16\n", 3)
    assert diff.changed and "--- In[3] (as run)" in diff.diff and "+batch_size = 16" in diff.diff
    assert CellDiff("In[3]", "a\n", "a\n", 3).diff == ""
    assert "-a\n+b\n" in unified_diff("a\n", "b\n")


def test_a_diff_shows_only_the_lines_that_changed_not_a_final_newline():
    # A notebook cell's source has no final newline; the autocast form does. The last line is the same in
    # both, so neither its removal and re-adding nor a newline's is shown.
    source = "loss = model(x).sum()\nloss.backward()\nopt.zero_grad(set_to_none=True)"
    wrapped = wrap_in_autocast(source, import_torch=False)
    assert wrapped.endswith("opt.zero_grad(set_to_none=True)\n")
    diff = unified_diff(source, wrapped)
    changed = [line for line in diff.splitlines()[2:] if line[:1] in "+-"]
    assert changed == ["-loss = model(x).sum()", "+with torch.autocast(\"cuda\", dtype=torch.bfloat16):",
                       "+    loss = model(x).sum()"]
    assert unified_diff("a\nb", "a\nb\n") == "" and not CellDiff("the failed cell", "a\nb", "a\nb\n").changed


def test_autocast_wraps_the_body_and_keeps_ipython_syntax_and_strings():
    source = '%%time\ndoc = """first\nsecond"""\n!echo hi\nfor i in range(2):\n    y = model(x)\n'
    wrapped = wrap_in_autocast(source, "float16")
    assert wrapped == (
        '%%time\nimport torch\nwith torch.autocast("cuda", dtype=torch.float16):\n'
        '    doc = """first\nsecond"""\n    !echo hi\n    for i in range(2):\n        y = model(x)\n'
    )
    body = wrapped.split("\n", 1)[1]
    python = TransformerManager().transform_cell(body)
    ast.parse(python)
    namespace: dict = {}
    runnable = python.replace("import torch\n", "").replace("get_ipython().system('echo hi')", "pass")
    namespace["torch"] = _FakeTorch(namespace)
    exec(compile(runnable.replace("model(x)", "1"), "<cell>", "exec"), namespace)
    assert namespace["autocast"] == ("cuda", "float16")
    assert namespace["doc"] == "first\nsecond"  # the string's second line was not indented


def test_autocast_of_broken_cell_raises_syntax_error_and_rejects_bad_dtype():
    with pytest.raises(SyntaxError):
        wrap_in_autocast("for x in :\n")
    with pytest.raises(ValueError):
        wrap_in_autocast("x = 1\n", "float8")


def test_autocast_without_import_and_of_an_empty_body():
    assert wrap_in_autocast("", import_torch=False) == 'with torch.autocast("cuda", dtype=torch.bfloat16):\n    pass\n'


def test_autocast_wraps_a_cell_whose_only_computation_is_a_matrix_product():
    # No call but range(): ``@`` is what autocast runs in half precision (a GPU test's cell, once refused).
    wrapped = wrap_in_autocast("outs = [a @ a for _ in range(16)]\n", import_torch=False)
    assert wrapped == 'with torch.autocast("cuda", dtype=torch.bfloat16):\n    outs = [a @ a for _ in range(16)]\n'
    assert "autocast" in wrap_in_autocast("c = a.clone()\nc @= b\n", import_torch=False)


class _FakeTorch:
    """Just enough of ``torch`` to execute a wrapped cell without CUDA."""

    float16 = "float16"

    def __init__(self, record: dict):
        self.record = record

    def autocast(self, device: str, dtype: str):
        record = self.record

        class _Context:
            def __enter__(self):
                record["autocast"] = (device, dtype)

            def __exit__(self, *exc):
                return False

        return _Context()


# -- autocast covers the forward pass and the loss only -----------------------------------------------
AC = 'with torch.autocast("cuda", dtype=torch.bfloat16):'


class _Tracking:
    """A stand-in for torch, a model, a loss and an optimizer that records, for each call, whether it
    ran under autocast: the forward and the loss must, backward and the steps must not."""

    bfloat16 = "bfloat16"

    def __init__(self):
        self.inside = False
        self.calls: list[tuple[str, bool]] = []

    def autocast(self, device, dtype):
        tracker = self

        class _Context:
            def __enter__(self):
                tracker.inside = True

            def __exit__(self, *exc):
                tracker.inside = False
                return False

        return _Context()

    def record(self, name):
        self.calls.append((name, self.inside))
        return self

    def namespace(self) -> dict:
        tracker = self

        class Loss:
            def backward(self):
                tracker.record("backward")

            def item(self):
                return 0.0

        class Optimizer:
            def zero_grad(self):
                tracker.record("zero_grad")

            def step(self):
                tracker.record("step")

        return {
            "torch": self, "model": lambda x: self.record("forward"), "loader": [(1, 2), (3, 4)],
            "criterion": lambda out, y: self.record("loss") and Loss(), "optimizer": Optimizer(),
            "scheduler": Optimizer(), "x": 1, "y": 2, "losses": [],
        }


def _run_wrapped(wrapped: str) -> list[tuple[str, bool]]:
    tracker = _Tracking()
    exec(compile(TransformerManager().transform_cell(wrapped), "<cell>", "exec"), tracker.namespace())
    return tracker.calls


def test_autocast_in_a_training_loop_wraps_forward_and_loss_only():
    source = (
        "for x, y in loader:\n"
        "    optimizer.zero_grad()\n"
        "    out = model(x)\n"
        "    loss = criterion(out, y)\n"
        "    loss.backward()\n"
        "    optimizer.step()\n"
        "    scheduler.step()\n"
        "    losses.append(loss.item())\n"
    )
    wrapped = wrap_in_autocast(source, import_torch=False)
    assert wrapped == (
        "for x, y in loader:\n"
        "    optimizer.zero_grad()\n"
        f"    {AC}\n"
        "        out = model(x)\n"
        "        loss = criterion(out, y)\n"
        "    loss.backward()\n"
        "    optimizer.step()\n"
        "    scheduler.step()\n"
        "    losses.append(loss.item())\n"  # bookkeeping after the step: not wrapped
    )
    assert _run_wrapped(wrapped) == [("zero_grad", False), ("forward", True), ("loss", True), ("backward", False),
                                     ("step", False), ("step", False)] * 2


def test_autocast_of_a_one_line_loss_and_a_while_loop():
    source = "step = 0\nwhile step < 2:\n    loss = criterion(model(x), y)\n    loss.backward()\n" \
             "    optimizer.step(); optimizer.zero_grad()\n    step += 1\n"
    wrapped = wrap_in_autocast(source, import_torch=False)
    assert wrapped == (
        "step = 0\nwhile step < 2:\n"
        f"    {AC}\n        loss = criterion(model(x), y)\n"
        "    loss.backward()\n    optimizer.step(); optimizer.zero_grad()\n    step += 1\n"
    )
    assert _run_wrapped(wrapped) == [("forward", True), ("loss", True), ("backward", False), ("step", False),
                                     ("zero_grad", False)] * 2


def test_autocast_of_a_train_step_the_cell_defines_wraps_inside_the_function():
    source = (
        "def train_step(x, y):\n"
        "    optimizer.zero_grad()\n"
        "    loss = criterion(model(x), y)\n"
        "    loss.backward()\n"
        "    optimizer.step()\n"
        "    return loss\n"
        "\n"
        "for x, y in loader:\n"
        "    loss = train_step(x, y)\n"
    )
    wrapped = wrap_in_autocast(source, import_torch=False)
    assert wrapped == (
        "def train_step(x, y):\n"
        "    optimizer.zero_grad()\n"
        f"    {AC}\n"
        "        loss = criterion(model(x), y)\n"
        "    loss.backward()\n"
        "    optimizer.step()\n"
        "    return loss\n"
        "\n"
        "for x, y in loader:\n"
        "    loss = train_step(x, y)\n"  # the call steps: outside
    )
    assert _run_wrapped(wrapped) == [("zero_grad", False), ("forward", True), ("loss", True), ("backward", False),
                                     ("step", False)] * 2


def test_a_train_step_of_an_earlier_cell_cannot_be_wrapped_here():
    from jupyter_cudamem.cell.edit import AutocastNotApplicable

    with pytest.raises(AutocastNotApplicable, match="inside that function"):
        wrap_in_autocast("for x, y in loader:\n    train_step(x, y)\n", outside_names=frozenset({"train_step"}))


@pytest.mark.parametrize("source", [
    "trainer = Trainer(model=model, args=args, train_dataset=data)\ntrainer.train()\n",
    "trainer.fit(model, datamodule=dm)\n",
    "t = L.Trainer(max_epochs=1)\nt.fit(model, dm)\n",
])
def test_a_trainer_sets_its_precision_through_its_arguments(source):
    from jupyter_cudamem.cell.edit import AutocastNotApplicable

    with pytest.raises(AutocastNotApplicable) as raised:
        wrap_in_autocast(source)
    assert "TrainingArguments(..., bf16=True)" in str(raised.value)
    assert 'precision="bf16-mixed"' in str(raised.value)


def test_autocast_keeps_elif_chains_and_model_train_mode_calls_intact():
    source = (
        "model.train()\n"
        "if mode == 'fast':\n"
        "    out = model(x)\n"
        "elif mode == 'slow':\n"
        "    out = model(x)\n"
        "    out.backward()\n"
        "else:\n"
        "    out = model(y)\n"
    )
    wrapped = wrap_in_autocast(source, import_torch=False)
    assert wrapped == (
        "model.train()\n"
        "if mode == 'fast':\n"
        f"    {AC}\n"
        "        out = model(x)\n"
        "elif mode == 'slow':\n"
        f"    {AC}\n"
        "        out = model(x)\n"
        "    out.backward()\n"
        "else:\n"
        f"    {AC}\n"
        "        out = model(y)\n"
    )
    ast.parse(wrapped)
