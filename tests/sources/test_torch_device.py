"""``sources.torch_device``: bfloat16 support as torch reports it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from jupyter_cudamem.sources.torch_device import bf16_supported, default_autocast_dtype  # noqa: E402


def test_a_card_that_cannot_say_gets_float16(monkeypatch):
    def no_cuda():
        raise RuntimeError("Found no NVIDIA driver on your system")

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", no_cuda)
    assert bf16_supported() is False
    assert default_autocast_dtype() == "float16"


def test_a_card_with_bfloat16_gets_bfloat16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert bf16_supported() is True
    assert default_autocast_dtype() == "bfloat16"
