"""The families of batch the finder used to miss, each changed where it lives and the cell run again.

The cases are notebooks of the corpus (``tests/oomfix/cells/``); ``test_finder_corpus`` checks what
the finder picks and where a fix rewrites. Here the pick is put to work: the chosen knob is halved
where it lives, the failed cell runs as rewritten (no OOM this time, CPU, small shapes), and the
tensors it made must have the halved batch where a batch belongs. The expected shapes are worked
out from each notebook by hand.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jupyter_cudamem.batch import BatchChange
from tests.oomfix.corpus import CELLS, Case, load_case, rerun_changed, run_case


def rerun(name: str, batch: int):
    result, source, outcome = rerun_changed(load_case(CELLS / f"{name}.ipy"), batch)
    assert not result.errors, result.errors
    assert outcome.success, f"{name}: the rewritten cell failed:\n{source}\n{outcome.error_in_exec!r}"
    from IPython.core.interactiveshell import InteractiveShell

    return result, source, InteractiveShell.instance().user_ns


# -- a batch a notebook class keeps -------------------------------------------------------------------
def test_a_loader_class_built_from_B_in_an_earlier_cell_reads_the_halved_B():
    result, source, namespace = rerun("cls01_loader_lite_view", 8)
    assert result.found == "train_loader.B = 16"
    assert namespace["x"].shape == (8, 128)  # next_batch() viewed 8 * 128 tokens as (B, T)
    assert namespace["train_loader"].B == 16 and namespace["B"] == 16  # put back after the try


def test_a_loader_class_built_in_the_failed_cell_is_rebuilt_with_the_halved_literal():
    result, source, namespace = rerun("cls03_loader_built_in_cell", 8)
    assert "train_loader = DataLoaderLite(B=8, T=128)" in source
    assert namespace["x"].shape == (8, 128)


def test_a_loader_class_the_cell_iterates_is_read_through_its_iter():
    result, source, namespace = rerun("cls04_iterable_class", 25)
    assert result.found == "train_dl.bs = 50"
    assert namespace["xb"].shape == (25, 784)  # 500 rows in steps of 25: the last batch is full too


# -- a sequence-first RNN the failed cell builds, and any RNN's hidden state ----------------------------------
# The finder used to take dimension 0 here: h0's layers (rnn01, rnn03, rnn05, rnn06), the sequence length
# (rnn04). Halving those made the rerun fail with a shape error; the batch is dimension 1 of a sequence-first
# input, and of h0 and c0 with or without batch_first.
@pytest.mark.parametrize(
    ("name", "batch", "result", "shape"),
    [
        ("rnn01_lstm_built_in_cell", 128, "output", (5, 128, 20)),  # (seq 5, batch, hidden 20)
        ("rnn02_gru_reassigned", 64, "out", (50, 64, 32)),  # (seq 50, batch, hidden 32)
        ("rnn03_model_class_in_cell", 32, "scores", (40, 32, 5)),  # (seq 40, batch, 5 tags): token ids moved too
        ("rnn04_named_layers_in_cell", 48, "y", (30, 48, 32)),  # h0 sized from x.size(1) follows x
        ("rnn05_batch_first_states", 32, "out", (32, 35, 20)),  # batch-first input; h0, c0 still (layers, batch, _)
        ("rnn06_batch_first_model_named_layers", 16, "pred", (16, 1)),  # the state passed to a model holding a GRU
    ],
)
def test_a_sequence_first_rnn_built_in_the_cell_reruns_with_the_halved_batch(name, batch, result, shape):
    _, source, namespace = rerun(name, batch)
    assert tuple(namespace[result].shape) == shape, source


# -- the rows of a tensor an earlier cell made ---------------------------------------------------------
def test_inputs_and_labels_from_an_earlier_cell_are_cut_together_for_the_rerun():
    result, source, namespace = rerun("tens01_inputs_earlier_cell", 32)
    assert result.found == "inputs.shape[0] = 64"
    assert namespace["outputs"].shape == (32, 10)  # 32 images of 3x32x32, 10 classes; labels cut to 32 too
    assert namespace["inputs"].shape == (64, 3, 32, 32) and namespace["labels"].shape == (64,)  # put back


def test_a_tensor_made_from_batch_size_changes_with_the_variable():
    result, source, namespace = rerun("tens05_batch_size_variable", 24)
    knob = result.finding.chosen
    assert {t.path.text for t in knob.live} == {"x", "y", "batch_size"}
    assert namespace["loss"].shape == ()  # the loss of 24 images against 24 labels: the shapes agreed


def test_a_model_class_built_in_the_cell_keeps_its_context_length_and_the_batch_is_halved():
    result, source, namespace = rerun("cls05_model_size_is_not_a_batch", 8)
    assert "TinyLM(256, 128, 32)" in source and "(8, 128)" in source  # the context length stays 128
    assert namespace["idx"].shape == (8, 128)


def test_a_moved_copy_is_traced_to_its_constructor_and_2d_targets_are_cut_with_it():
    result, source, namespace = rerun("tens06_moved_copy_and_one_hot", 20)
    assert {t.path.text for t in result.finding.chosen.live} == {"inputs", "targets"}
    assert namespace["logits"].shape == (20, 5)  # 20 rows of 12 features, 5 labels; the (40, 5) targets cut to 20


def test_a_loader_class_rebuilt_in_the_cell_from_an_earlier_B_changes_B():
    result, source, namespace = rerun("cls06_loader_built_from_earlier_B", 8)
    assert result.found == "B = 16" and source == result.case.failing  # B lives in In[1]; the cell is unchanged
    assert namespace["x"].shape == (8, 64)


# -- what the user pastes: every cell the batch passes through, in order -----------------------------------
def paste_and_run(result, batch: int, real: bool = False):
    """Run what ``%oomfix`` tells the user to paste, then the failed cell, as the user would."""
    from IPython.core.interactiveshell import InteractiveShell

    from tests.oomfix.standins import installed

    shell = InteractiveShell.instance()
    change = BatchChange(result.finding, namespace=shell.user_ns, history=list(shell.history_manager.input_hist_raw))
    paste = change.paste_code(batch)
    with installed(real):
        for cell in (paste, result.case.failing):
            outcome = shell.run_cell(cell, store_history=True)
            assert outcome.success, (cell, outcome.error_in_exec)
    return paste, shell.user_ns


def test_a_loader_prepared_in_a_later_cell_is_pasted_with_the_cell_that_prepares_it():
    result, source, namespace = rerun("acc02_prepared_in_later_cell", 32)
    assert namespace["sizes"] == [32] * 8  # the try: 256 rows in batches of 32
    assert result.finding.chosen.reruns == (3,)
    paste, namespace = paste_and_run(result, 32)
    changed, prepared = paste.split("\n\n")
    assert changed.startswith("# In[2] with batch 32 (was 64): run this in its place, then In[3], then the failed cell")
    assert "DataLoader(dataset, batch_size=32, shuffle=True)" in changed
    assert prepared.startswith("# In[3], unchanged: run it again")
    assert "accelerator.prepare(model, optimizer, train_dataloader)" in prepared
    assert namespace["sizes"] == [32] * 8


def test_a_loader_built_from_a_variable_in_an_earlier_cell_is_pasted_with_the_cell_that_builds_it():
    cells = (
        "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\nbatch_size = 64\n",
        "ds = TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))\n"
        "loader = DataLoader(ds, batch_size=batch_size, shuffle=True)\nmodel = torch.nn.Linear(8, 2)\n",
        "sizes = []\nfor x, y in loader:\n    torch.nn.functional.cross_entropy(model(x), y).backward()\n"
        "    sizes.append(len(x))\n",
    )
    result, source, outcome = rerun_changed(Case("loader_from_variable", "", "", (), cells, "first"), 16)
    assert outcome.success and result.found == "loader.batch_size = 64"
    assert result.finding.chosen.reruns == (2,)
    paste, namespace = paste_and_run(result, 16)
    assert "batch_size = 16" in paste and "# In[2], unchanged" in paste
    assert namespace["sizes"] == [16] * 16  # without In[2] run again, the loader kept batches of 64


# -- a loader batched by a BatchSampler: the batch is the sampler's ----------------------------------------
def test_a_batch_sampler_passed_to_a_loader_has_its_batch_size_changed_in_the_paste():
    result, source, namespace = rerun("pt12_batch_sampler", 128)
    assert namespace["sizes"] == [128] * 4  # the try: 512 rows in batches of 128
    paste, namespace = paste_and_run(result, 128)  # a batch_size= beside batch_sampler= raised ValueError here
    assert "BatchSampler(RandomSampler(ds), batch_size=128, drop_last=True))\n" in paste
    assert namespace["sizes"] == [128] * 4


def test_a_batch_sampler_bound_to_a_name_in_another_cell_is_changed_there():
    cells = (
        "import torch\nfrom torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset\n"
        "ds = TensorDataset(torch.randn(300, 8), torch.randint(0, 2, (300,)))\n"
        "batches = BatchSampler(SequentialSampler(ds), 100, False)\n",
        "loader = DataLoader(ds, batch_sampler=batches)\nmodel = torch.nn.Linear(8, 2)\n",
        "sizes = []\nfor x, y in loader:\n    torch.nn.functional.cross_entropy(model(x), y).backward()\n"
        "    sizes.append(len(x))\n",
    )
    result, source, outcome = rerun_changed(Case("named_sampler", "", "", (), cells, "first"), 40)
    assert outcome.success and result.edits == ("In[1] line 4",)
    assert result.finding.chosen.reruns == (2,)  # the loader is built from the sampler in In[2]
    paste, namespace = paste_and_run(result, 40)
    assert "BatchSampler(SequentialSampler(ds), 40, False)" in paste
    assert namespace["sizes"] == [40] * 7 + [20]  # 300 rows, the last batch kept (drop_last=False)


# -- a callable's bound arguments: functools.partial ---------------------------------------------------------
def test_a_partial_loader_from_an_earlier_cell_is_bound_again_with_the_smaller_batch():
    result, source, namespace = rerun("pt13_partial_loader", 64)
    assert source == result.case.failing  # the batch lives in In[1]: the cell runs unchanged
    assert namespace["sizes"] == [64] * 8  # the try: 512 rows in batches of 64
    assert namespace["make_loader"].keywords == {"batch_size": 128, "shuffle": True, "drop_last": False}  # put back
    paste, namespace = paste_and_run(result, 64)
    assert "functools.partial(DataLoader, batch_size=64, shuffle=True, drop_last=False)" in paste
    assert namespace["sizes"] == [64] * 8


def test_a_partial_with_positional_arguments_passed_to_a_notebook_function_is_found_where_it_is_called():
    cells = (
        "import torch\nfrom functools import partial\nfrom torch.utils.data import DataLoader, TensorDataset\n"
        "ds = TensorDataset(torch.randn(300, 8), torch.randint(0, 2, (300,)))\n"
        "loader_for = partial(DataLoader, ds, 100)\n",
        "model = torch.nn.Linear(8, 2)\n"
        "def train(loader_fn):\n    sizes = []\n    for x, y in loader_fn():\n"
        "        torch.nn.functional.cross_entropy(model(x), y).backward()\n        sizes.append(len(x))\n"
        "    return sizes\n",
        "sizes = train(loader_for)\n",
    )
    result, source, outcome = rerun_changed(Case("partial_positional", "", "", (), cells, "first"), 30)
    assert outcome.success and result.found == "batch_size (bound by loader_for) = 100"
    assert result.edits == ("In[1] line 5",)
    from IPython.core.interactiveshell import InteractiveShell

    assert InteractiveShell.instance().user_ns["sizes"] == [30] * 10
    paste, namespace = paste_and_run(result, 30)
    assert "partial(DataLoader, ds, 30)" in paste and namespace["sizes"] == [30] * 10


# -- a matrix's inner size is not a batch ---------------------------------------------------------------------
SKETCHES = {
    "literal": ("import torch\n", "A = torch.randn(4096, 4096)\nsketch = torch.randn(4096, 256)\n"
                "sketch = sketch / sketch.norm(dim=0)\nY = A @ sketch\n"),
    "named": ("import torch\nn, k = 4096, 256\n", "A = torch.randn(n, n)\nsketch = torch.randn(n, k)\n"
              "Y = torch.matmul(A, sketch.to('cpu'))\nU, S, Vh = torch.linalg.svd(Y, full_matrices=False)\n"),
    "method": ("import torch\nrows = 4096\n", "A = torch.randn(rows, rows)\nsketch = torch.randn(rows, 256).float()\n"
               "Y = A.mm(sketch).relu_()\n"),
}


@pytest.mark.parametrize("name", sorted(SKETCHES))
def test_a_dimension_a_matrix_product_sums_over_is_not_reported_as_a_batch(name):
    result = run_case(Case(name, "", "none", (), SKETCHES[name], "first"))
    assert not result.errors and result.failure == ""  # the cells ran whole: no module, no OOM
    assert result.finding.knobs == (), result.finding.summary()


def test_a_batch_beside_a_matrix_product_is_still_a_batch():
    cells = ("import torch\nW = torch.randn(512, 10)\n",
             "x = torch.randn(64, 512)\nloss = (x @ W).relu().sum() + x.pow(2).sum()\n")
    result = run_case(Case("beside", "", "none", (), cells, "first"))
    assert (result.found, result.edits) == ("leading dimension = 64", ("line 1",))  # x's 512 is the inner size


# -- tensors of the same rows are cut together, however the cell reads them --------------------------------
def test_targets_read_in_arithmetic_are_cut_with_the_inputs():
    result, source, namespace = rerun("tens07_targets_in_arithmetic", 1024)
    assert {t.path.text for t in result.finding.chosen.live} == {"inputs", "targets"}
    assert namespace["predictions"].shape == (1024, 2) and namespace["loss"].shape == ()
    assert namespace["targets"].shape == (4096, 2)  # put back
    paste, namespace = paste_and_run(result, 1024)
    assert "torch.randn(1024, 16)" in paste and "torch.randn(1024, 2)" in paste
    assert namespace["predictions"].shape == (1024, 2)


ROWS = (
    "import torch\nfrom torch import nn\nmodel = nn.Linear(16, 2)\ninputs = torch.randn(256, 16)\n"
    "targets = torch.randn(256, 2)\nlabels = torch.randint(0, 2, (256,))\nweights = torch.rand(256)\n"
    "adjacency = torch.rand(256, 256)\n"
)


@pytest.mark.parametrize(
    ("cell", "cut"),
    [
        ("loss = nn.functional.mse_loss(model(inputs), targets.float())\n", {"inputs", "targets"}),
        ("out = model(inputs.to('cpu'))\nloss = nn.functional.cross_entropy(out, labels.to('cpu'))\n",
         {"inputs", "labels"}),
        ("loss = (nn.functional.cross_entropy(model(inputs), labels, reduction='none') * weights).mean()\n",
         {"inputs", "labels", "weights"}),
        ("def mse(out):\n    return ((out - targets) ** 2).mean()\nloss = mse(model(inputs))\n", {"inputs", "targets"}),
    ],
)
def test_every_tensor_the_cell_reads_with_the_batch_rows_is_cut_with_the_batch(cell, cut):
    result, source, outcome = rerun_changed(Case("rows", "", "", (), (ROWS, cell + "loss.backward()\n"), "first"), 64)
    assert outcome.success, outcome.error_in_exec  # cut alone, inputs' 64 rows met 256 targets
    assert {t.path.text for t in result.finding.chosen.live} == cut


def test_a_square_matrix_of_the_batch_side_leaves_the_rows_uncut():
    cell = "h = adjacency @ model(inputs)\nloss = ((h - targets) ** 2).mean()\nloss.backward()\n"
    result = run_case(Case("graph", "", "none", (), (ROWS, cell), "first"))
    assert result.found == "none"  # an adjacency cut by its rows alone would not multiply the cut inputs
