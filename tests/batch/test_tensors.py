"""Tensors whose rows are the batch: cutting or repeating them for a try, and where their rows are written."""

from __future__ import annotations

import torch

from jupyter_cudamem.batch.change import resized_rows
from jupyter_cudamem.batch.knobs import ObjectPath
from jupyter_cudamem.batch.provenance import History
from jupyter_cudamem.batch.tensors import tensor_shape, trace_rows


def test_fewer_rows_are_a_view_of_the_same_memory():
    tensor = torch.arange(12.0).view(6, 2)
    cut = resized_rows(tensor, 0, 4)
    assert cut.shape == (4, 2) and cut.data_ptr() == tensor.data_ptr()
    assert cut.tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]


def test_more_rows_repeat_the_tensor_and_are_exactly_that_many():
    tensor = torch.tensor([[1, 2], [3, 4], [5, 6]])
    grown = resized_rows(tensor, 0, 7)
    assert grown.tolist() == [[1, 2], [3, 4], [5, 6], [1, 2], [3, 4], [5, 6], [1, 2]]
    assert grown.untyped_storage().nbytes() == 7 * 2 * 8  # 7 rows of 2 int64: nothing over-allocated


def test_the_batch_dimension_of_a_sequence_first_tensor_is_cut_in_place():
    tensor = torch.zeros(5, 8, 3)
    assert resized_rows(tensor, 1, 2).shape == (5, 2, 3)


def test_a_leaf_that_needs_gradients_stays_a_leaf_that_needs_them():
    tensor = torch.zeros(4, 2, requires_grad=True)
    cut = resized_rows(tensor, 0, 2)
    assert cut.is_leaf and cut.requires_grad


def test_only_tensors_have_a_tensor_shape():
    assert tensor_shape(torch.zeros(3, 4)) == (3, 4)
    assert tensor_shape(torch.nn.Parameter(torch.zeros(3))) is None  # a module's weight is no batch
    assert tensor_shape([1, 2, 3]) is None


def history(*cells: str, namespace=None) -> History:
    return History(["", *cells], len(cells) + 1, namespace or {})


def test_rows_written_in_the_constructor_of_an_earlier_cell():
    trace = trace_rows(history("import torch\n", "x = torch.randn(64, 3).to('cuda')\n"), ObjectPath("x"), 0, 64)
    assert [(w.cell, w.span.line, w.span.col, w.span.end_col) for w in trace.written] == [(2, 1, 16, 18)]


def test_rows_written_with_a_variable_are_traced_to_it():
    cells = ("bs = 16\n", "h = torch.zeros(2, bs, 8)\n")
    trace = trace_rows(history(*cells, namespace={"bs": 16}), ObjectPath("h"), 1, 16)
    assert [(w.cell, w.span.line, w.span.col) for w in trace.written] == [(1, 1, 5)]
    assert trace.via == (ObjectPath("bs"),)


def test_rows_that_are_not_written_anywhere_are_not_traced():
    assert trace_rows(history("x, y = next(it)\n"), ObjectPath("x"), 0, 8).written == ()
    rebound = history("x = torch.randn(8, 2)\n", "for x in xs:\n    pass\n")  # x is a loop's now
    assert trace_rows(rebound, ObjectPath("x"), 0, 8).written == ()
    assert trace_rows(history("x = torch.randn(8, 2)\n"), ObjectPath("x"), 0, 4).written == ()  # it has 8 now


def test_rows_of_a_moved_copy_are_traced_through_the_tensor_it_was_moved_from():
    cells = ("x = torch.randn(40, 12)\ny = x.to(device).float()\nm = torch.zeros(40, 5).bernoulli_(0.3)\n",)
    assert [(w.cell, w.span.line, w.span.col) for w in trace_rows(history(*cells), ObjectPath("y"), 0, 40).written] == [
        (1, 1, 16)
    ]
    assert [(w.cell, w.span.line) for w in trace_rows(history(*cells), ObjectPath("m"), 0, 40).written] == [(1, 3)]
