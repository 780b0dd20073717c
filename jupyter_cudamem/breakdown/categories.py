"""The breakdown's vocabulary: what a block of memory is for (``Category``), where the cell was at its peak
(``Phase``), and the module row that takes what no model's module holds."""

from __future__ import annotations

from enum import Enum


class Category(Enum):
    """What a block of memory is for. The value is how reports and result files name it."""

    PARAMETERS = "parameters"  # a model's parameters and buffers
    GRADIENTS = "gradients"  # the parameters' .grad
    OPTIMIZER_STATE = "optimizer_state"  # what optimizer.state holds (Adam's moments, momentum)
    ACTIVATIONS = "activations"  # made in a forward pass with autograd on: what backward reads
    TEMPORARIES = "temporaries"  # made in backward, in the optimizer's step, or in a forward pass without autograd
    OTHER = "other"  # made outside any model (inputs, data, losses), or not seen as a tensor at all

    @property
    def words(self) -> str:
        return self.value.replace("_", " ")


CATEGORIES: tuple[Category, ...] = tuple(Category)

# The categories that do not grow with the batch: what a model and its optimizer hold between steps.
MODEL_STATE: tuple[Category, ...] = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE)


class Phase(Enum):
    """Where the cell was when the peak happened."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER_STEP = "optimizer step"
    OUTSIDE = "outside any model"  # the cell's own code between models' calls


OTHER_MODULE = "other"
"""The module row that takes memory no model's module made or owns, and what the tracker did not see."""

MAX_MODULES = 12
"""Module rows shown; smaller ones are added to ``OTHER_MODULE``."""
