"""Whether a failed cell feeds a sequence-first model, whose batch is dimension 1, not 0.

PyTorch's ``nn.LSTM``, ``nn.GRU``, ``nn.RNN``, ``nn.Transformer`` and its layers and
``nn.MultiheadAttention`` take ``(sequence, batch, features)`` unless built with ``batch_first=True``,
and an RNN's ``h0``/``c0`` are ``(layers, batch, hidden)`` either way. Taking dimension 0 of those
tensors for the batch changes the sequence length or the number of layers, and the rerun fails with a
shape error. A model read from an earlier cell is inspected (``libraries.sequence_first``); one the
failed cell builds or builds again is recognised here: from its text (``nn.LSTM(10, 20, 2)``), or,
for a notebook class the cell instantiates, from the instance the cell had bound when it failed.
An RNN's hidden state is ``(layers, batch, hidden)`` even with ``batch_first=True``: the tensors the
cell passes as one (``recurrent_states``) have their batch in dimension 1 whatever the input's is.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping

from ..cell.source import callable_name, dotted_name
from .earlier_cells import path_of
from .knobs import ObjectPath
from .libraries import SEQUENCE_FIRST_CLASSES, class_names, found, is_module, resolve, sequence_first


def builds_sequence_first(tree: ast.AST, namespace: Mapping[str, object]) -> bool:
    """Whether the code builds one of PyTorch's sequence-first layers: ``nn.LSTM(...)`` without
    ``batch_first=True`` (also inside a class or function the cell defines). A notebook's own
    ``class RNN(nn.Module)`` is not PyTorch's."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and callable_name(node) in SEQUENCE_FIRST_CLASSES
            and _from_torch(node.func, namespace)
            and not _batch_first(node)
        ):
            return True
    return False


def calls_sequence_first(tree: ast.AST, bound: set[str], namespace: Mapping[str, object]) -> bool:
    """Whether the cell calls a name it binds itself (``model = Tagger(...)`` then ``model(x)``) whose
    value, as the cell left it when it failed, is a sequence-first model."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in bound:
            value = resolve(namespace, ObjectPath(node.func.id))
            if found(value) and is_module(value) and sequence_first(value):
                return True
    return False


def recurrent_states(tree: ast.AST, namespace: Mapping[str, object]) -> set[str]:
    """Names the code passes as the hidden state of a recurrent module: ``rnn(x, (h0, c0))``,
    ``gru(seq, h0)``, ``model(x, h)`` for a model holding an RNN, ``lstm(x, hx=(h0, c0))``. Their batch
    is dimension 1 (``(layers, batch, hidden)``), with or without ``batch_first``."""
    built = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and callable_name(node.value) in _RECURRENT_CLASSES
        and _from_torch(node.value.func, namespace)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    states: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        state = node.args[1] if len(node.args) >= 2 else next((k.value for k in node.keywords if k.arg == "hx"), None)
        if state is None or not _recurrent(node.func, built, namespace):
            continue
        elements = state.elts if isinstance(state, (ast.Tuple, ast.List)) else [state]
        states.update(element.id for element in elements if isinstance(element, ast.Name))
    return states


_RECURRENT_CLASSES = frozenset({"RNN", "LSTM", "GRU"})


def _recurrent(function: ast.expr, built: set[str], namespace: Mapping[str, object]) -> bool:
    if isinstance(function, ast.Name) and function.id in built:
        return True
    path = path_of(function)
    if path is None:
        return False
    value = resolve(namespace, path)
    if not found(value) or not is_module(value):
        return False
    try:
        return any("RNNBase" in class_names(module) for module in list(value.modules())[:2000])
    except Exception:  # noqa: BLE001  a model whose modules() raises holds no state we can read
        return False


def _from_torch(function: ast.expr, namespace: Mapping[str, object]) -> bool:
    path = path_of(function)
    value = resolve(namespace, path) if path is not None else None
    if path is not None and found(value):
        return isinstance(value, type) and value.__module__.startswith("torch.")
    return (dotted_name(function) or "").startswith(("nn.", "torch.nn."))


def _batch_first(call: ast.Call) -> bool:
    for keyword in call.keywords:
        if keyword.arg == "batch_first":
            value = keyword.value
            # ``batch_first=flag``: not written in the call; taken as batch-first, the default reading.
            return not (isinstance(value, ast.Constant) and not value.value)
    return False
