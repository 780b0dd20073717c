"""``%oomfix`` on a contrastive loss, whose memory grows with the square of the batch, on a real GPU.

An InfoNCE step (SimCLR, CLIP): every sample's embedding against every other's, a batch x batch matrix of
logits, its softmax and their gradients. The search's memory model is a line in the batch: from a small
probe, the logits are a sliver of the peak, and the replay of one run puts the next try far above what
fits. That try's own requests, recorded up to the one that raised, show how large the logits grew
(``Tries.paired_failure``), and the next try is placed by them. PyTorch capped at 2 GiB, the encoder built
in an earlier cell; the largest batch that fits is found by running each batch in a fresh kernel.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_oomfix_contrastive_gpu.py -v -s``.
"""

from __future__ import annotations

import pytest

from tests.notebook_runner import gpu_notebook_module

torch, pytestmark = gpu_notebook_module()

from tests.gpu.test_oomfix_gpu import SETUP, cap, errors_of, execute, last_json, text_of  # noqa: E402

BUILD = """encoder = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 256)).cuda()
optimizer = torch.optim.SGD(encoder.parameters(), lr=0.1)
"""

STEP = """x = torch.randn(batch_size, 512, device="cuda")
z = nn.functional.normalize(encoder(x + 0.1 * torch.randn_like(x)), dim=1)
w = nn.functional.normalize(encoder(x), dim=1)
logits = z @ w.T / 0.07
loss = nn.functional.cross_entropy(logits, torch.arange(batch_size, device="cuda"))
loss.backward()
optimizer.step()
optimizer.zero_grad(set_to_none=True)
"""


def fits(batch: int) -> bool:
    return not errors_of(execute([SETUP + cap(2), BUILD, f"batch_size = {batch}\n" + STEP], timeout=300)[-1])


def largest() -> int:
    low, high = 1024, 65536
    assert fits(low) and not fits(high)
    while high - low > 16:  # within 16 samples of 10,000: a tenth of a percent
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def test_oomfix_follows_a_peak_that_grows_with_the_square_of_the_batch():
    true = largest()
    start = 3 * true
    check = """import json
print(json.dumps({"batch": batch_size, "tries": [[t.batch, t.fitted, t.strategy, t.reason] for t in _fix.tries],
                  "strategy": _fix.strategy}))
"""
    outputs = execute([SETUP + cap(2), BUILD, f"batch_size = {start}\n" + STEP, "_fix = %oomfix --yes -o", check],
                      timeout=600)
    assert "OutOfMemoryError" in errors_of(outputs[-3])
    result = last_json(outputs[-1])
    print("largest", true, "start", start, result)
    assert result["strategy"] == "batch", text_of(outputs[-2])
    assert len(result["tries"]) <= 3
    halving = start // 2 // 2  # halving's: 1.5x the largest fails, 0.75x fits
    assert result["batch"] >= max(0.9 * true, halving), (true, result)
