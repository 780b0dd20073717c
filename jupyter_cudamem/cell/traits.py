"""What a cell does, as far as its code shows: trains, calls a model, already saves memory.

The advice ``%oomfix`` gives depends on it (gradient accumulation only for a training cell,
``no_grad`` only for inference that calls a model).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from .source import Transform, parse_cell


@dataclass(frozen=True)
class CellTraits:
    """What a cell does, as far as its code shows."""

    trains: bool  # calls .backward() or an optimizer/trainer step
    hf_trainer: bool  # builds TrainingArguments (advice goes through its arguments)
    no_grad: bool  # already under no_grad / inference_mode
    autocast: bool  # already under autocast
    calls_model: bool  # calls what looks like a model (inference cells do)


def cell_traits(source: str, transform: Transform | None = None) -> CellTraits:
    """What ``source`` does, read from its tree as IPython runs it (``parse_cell``)."""
    try:
        tree = parse_cell(source, transform).tree
    except Exception:  # unparseable: the text is all we have
        return traits_of(source, None)
    return traits_of(source, tree)


def traits_of(source: str, tree: ast.Module | None) -> CellTraits:
    """What ``source`` does, read from ``tree`` (what IPython runs of it); from the text where it does not
    parse (``None``)."""
    if tree is None:
        return CellTraits(
            ".backward(" in source,
            "TrainingArguments" in source,
            "no_grad" in source,
            "autocast" in source,
            "(" in source,
        )
    attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    return CellTraits(
        trains=bool({"backward", "train"} & attributes) or ("step" in attributes and "zero_grad" in attributes),
        hf_trainer="TrainingArguments" in names or "TrainingArguments" in attributes,
        no_grad=bool({"no_grad", "inference_mode"} & (attributes | names)),
        autocast=bool({"autocast", "autocast_mode"} & (attributes | names)),
        calls_model=any(looks_like_model_call(call) for call in calls),
    )


_MODEL_WORDS = (
    "model",
    "net",
    "encoder",
    "decoder",
    "classifier",
    "backbone",
    "transformer",
    "module",
    "layer",
    "block",
    "head",
    "policy",
    "generator",
    "unet",
    "vae",
    "pipe",
)


def looks_like_model_call(call: ast.Call) -> bool:
    """``model(x)``, ``self.encoder(x)``, ``net.forward(x)``, ``model[:3](x)``: not ``torch.randn(...)``."""
    func = call.func
    if isinstance(func, ast.Subscript):
        return True
    if isinstance(func, ast.Attribute) and func.attr == "forward":
        return True
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    if (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Name)
        and func.value.id in ("torch", "nn", "F", "np")
    ):
        return False
    lowered = name.lower()
    return any(word in lowered for word in _MODEL_WORDS) and not lowered.startswith(
        ("make_", "build_", "create_", "load_")
    )
