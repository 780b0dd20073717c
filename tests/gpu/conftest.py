"""Fixtures the GPU tests share: torch with its CUDA context made before any measured cell, and a shell
with the extension loaded fresh."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def torch():
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")  # the context exists before the measured cells
    return torch


@pytest.fixture
def shell(torch, ip):
    from jupyter_cudamem import magics

    magics.unload(ip)
    ip.run_line_magic("load_ext", "jupyter_cudamem")
    ip.user_ns["torch"] = torch
    yield ip
    ip.run_line_magic("unload_ext", "jupyter_cudamem")
