"""Which names read as a batch size, and how strongly: the vocabulary the finder weighs names by."""

from __future__ import annotations

import re
from typing import Literal

# Names that are nothing but a batch size (lower case, compared whole).
EXACT_NAMES = frozenset(
    {
        "batch_size",
        "batchsize",
        "bs",
        "bsz",
        "batch",
        "train_batch_size",
        "per_device_train_batch_size",
        "per_gpu_train_batch_size",
        "micro_batch_size",
        "train_micro_batch_size_per_gpu",
        "mini_batch_size",
        "minibatch_size",
        "global_batch_size",
    }
)
# Counts that multiply what one call generates, and so its memory, as a batch does.
GENERATION_NAMES = frozenset({"num_return_sequences", "num_images_per_prompt", "num_videos_per_prompt"})
_EVAL_WORDS = frozenset({"eval", "test", "val", "valid", "validation", "inference", "predict", "infer", "dev"})
_TRAIN_WORDS = frozenset({"train", "training", "trn"})

# Scores: an exact batch name is the strongest evidence a name alone can give; a name that merely
# contains the words is a little weaker. A use as a batch (see ``finder``) adds to either.
EXACT_NAME_SCORE = 10
BATCH_NAME_SCORE = 8


def _words(name: str) -> list[str]:
    # ``trainBatchSize`` and ``TRAIN_BS`` both split into words.
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name)
    return [w for w in re.split(r"[_\W]+", spaced.lower()) if w]


def batch_like(name: str) -> bool:
    """Whether ``name`` reads as a batch size (``bs``, ``BATCH``, ``eval_batch_size``, ``micro_bs``)."""
    lower = name.lower()
    if lower in EXACT_NAMES or lower in GENERATION_NAMES:
        return True
    words = _words(name)
    if any(w in {"bs", "bsz", "batchsize"} for w in words):
        return True
    return any(a == "batch" and b == "size" for a, b in zip(words, words[1:]))


def generation_count(name: str) -> bool:
    return name.lower() in GENERATION_NAMES


def name_score(name: str) -> int:
    """How strongly the name alone says "batch size" (0: not at all)."""
    if not batch_like(name):
        return 0
    return EXACT_NAME_SCORE if name.lower() in EXACT_NAMES else BATCH_NAME_SCORE


def phase_of(name: str) -> Literal["train", "eval"] | None:
    """Whether a name is about evaluation (``val_loader``, ``eval_batch_size``) or training, if it says."""
    words = set(_words(name))
    if words & _EVAL_WORDS:
        return "eval"
    if words & _TRAIN_WORDS:
        return "train"
    return None
