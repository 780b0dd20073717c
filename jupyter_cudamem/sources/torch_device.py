"""What the current CUDA device supports, as torch says: the only code that asks torch for it."""

from __future__ import annotations


def bf16_supported() -> bool:
    """Whether the current card computes in bfloat16 (Ampere and later); ``False`` where torch cannot say
    (no CUDA)."""
    import torch

    try:
        return bool(torch.cuda.is_bf16_supported())
    except Exception:  # no CUDA: whoever asks will not get to run on it anyway
        return False


def default_autocast_dtype() -> str:
    """bfloat16 where the current card supports it (Ampere and later), else float16 (also without CUDA:
    the driver will not get to run anyway)."""
    return "bfloat16" if bf16_supported() else "float16"
