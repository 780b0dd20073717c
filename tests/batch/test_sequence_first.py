"""Recognising a sequence-first layer the failed cell builds, from its text and from what it bound."""

from __future__ import annotations

import ast

import torch
from torch import nn

from jupyter_cudamem.batch.sequence_first import builds_sequence_first, calls_sequence_first, recurrent_states

NAMESPACE = {"nn": nn, "torch": torch}


def builds(source: str, namespace=NAMESPACE) -> bool:
    return builds_sequence_first(ast.parse(source), namespace)


def test_pytorch_recurrent_and_transformer_layers_are_sequence_first_unless_built_batch_first():
    assert builds("rnn = nn.LSTM(10, 20, 2)")
    assert builds("gru = torch.nn.GRU(16, 32, batch_first=False)")
    assert builds("enc = nn.TransformerEncoderLayer(d_model=64, nhead=4)")
    assert not builds("rnn = nn.LSTM(10, 20, 2, batch_first=True)")
    assert not builds("cell = nn.LSTMCell(10, 20)")  # a cell takes (batch, features)
    assert not builds("rnn = nn.LSTM(10, 20, batch_first=flag)")  # not written: dimension 0, as before


def test_a_layer_inside_a_class_the_cell_defines_counts():
    assert builds("class Tagger(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                  "        self.lstm = nn.LSTM(8, 8)\n")


def test_a_notebook_class_named_like_a_pytorch_layer_is_not_one():
    class RNN(nn.Module):  # the char-RNN tutorials' own class, batch-first
        def forward(self, x):
            return x

    assert not builds("model = RNN(10, 20)", {**NAMESPACE, "RNN": RNN})
    assert builds("model = nn.RNN(10, 20)", {**NAMESPACE, "RNN": RNN})


def test_a_model_the_cell_binds_and_calls_is_inspected_as_the_cell_left_it():
    tree = ast.parse("model = make()\nout = model(x)\n")
    assert calls_sequence_first(tree, {"model"}, {"model": nn.Sequential(nn.GRU(4, 4))})
    assert not calls_sequence_first(tree, {"model"}, {"model": nn.Sequential(nn.GRU(4, 4, batch_first=True))})
    assert not calls_sequence_first(tree, set(), {"model": nn.Sequential(nn.GRU(4, 4))})  # not bound by the cell


def test_the_hidden_state_passed_to_a_recurrent_module_whatever_its_batch_first():
    source = (
        "lstm = nn.LSTM(10, 20, 2, batch_first=True)\n"
        "out, (hn, cn) = lstm(x, (h0, c0))\n"
        "y, h = model(x, h)\n"
        "z = head(x, w)\n"  # a module without an RNN: its second argument is no state
        "o, s = gru(seq, hx=s0)\n"
    )
    namespace = {
        **NAMESPACE,
        "model": nn.Sequential(nn.GRU(4, 4, batch_first=True)),
        "head": nn.Bilinear(2, 2, 2),
        "gru": nn.GRU(4, 4),
    }
    assert recurrent_states(ast.parse(source), namespace) == {"h0", "c0", "h", "s0"}
