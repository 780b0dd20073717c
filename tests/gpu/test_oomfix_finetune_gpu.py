"""``%oomfix`` on a transformer fine-tune whose largest batch is under 10, on a real GPU, in a real kernel.

A GPT-style decoder (``torch.nn.TransformerEncoder`` with a causal mask, 8 layers of width 1024, a
32,000-token embedding and head: about 135M parameters, 2.2 GB with AdamW's two state tensors and the
gradients) is fine-tuned at sequence 1024 under bf16 autocast, PyTorch capped at 6 GiB. Built in an
earlier cell, or in the failing cell itself (the case where the cleanup frees the failed cell's own
model, which a plain rerun would build again). The cell fails at a batch far too big; ``%oomfix --yes``
must end within one sample of the largest batch that fits, found here by running each batch in a fresh
kernel, in at most 3 reruns, without a plain rerun.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_oomfix_finetune_gpu.py -v`` (about 2 minutes).
"""

from __future__ import annotations

import pytest

from tests.notebook_runner import gpu_notebook_module

torch, pytestmark = gpu_notebook_module()

from tests.gpu.test_oomfix_gpu import SETUP, cap, errors_of, execute, last_json, text_of  # noqa: E402


MODEL = """class Decoder(nn.Module):
    def __init__(self, vocab=32000, width=1024, layers=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 16, 4 * width, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
    def forward(self, tokens):
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        return self.head(self.blocks(self.embed(tokens), mask=mask, is_causal=True))
"""

BUILD = """model = Decoder().cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
"""

STEP = """tokens = torch.randint(0, 32000, (batch_size, 1025), device="cuda")
with torch.autocast("cuda", dtype=torch.bfloat16):
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, 32000).float(), tokens[:, 1:].reshape(-1))
loss.backward()
optimizer.step()
optimizer.zero_grad(set_to_none=True)
"""


def fits(batch: int, built_in_cell: bool) -> bool:
    cells = [SETUP + cap(6), MODEL] + ([] if built_in_cell else [BUILD])
    cells.append(f"batch_size = {batch}\n" + (BUILD if built_in_cell else "") + STEP)
    return not errors_of(execute(cells, timeout=300)[-1])


def largest(built_in_cell: bool) -> int:
    low, high = 0, 16  # doubling is not needed: 16 does not fit under 6 GiB at sequence 1024
    assert not fits(high, built_in_cell)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle, built_in_cell) else (low, middle)
    return low


FROM_EARLIER = pytest.param(False, id="model-from-earlier-cell")


@pytest.mark.parametrize("built_in_cell", [FROM_EARLIER, pytest.param(True, id="model-built-in-cell")])
def test_oomfix_lands_within_a_sample_of_the_largest_batch(built_in_cell):
    true = largest(built_in_cell)
    assert 1 <= true < 10, true
    failing = "batch_size = 60\n" + (BUILD if built_in_cell else "") + STEP
    check = """import json
print(json.dumps({"batch": batch_size, "tries": [[t.batch, t.fitted, t.strategy] for t in _fix.tries],
                  "strategy": _fix.strategy}))
"""
    cells = [SETUP + cap(6), MODEL] + ([] if built_in_cell else [BUILD]) + [failing, "_fix = %oomfix --yes -o", check]
    outputs = execute(cells, timeout=600)
    assert "OutOfMemoryError" in errors_of(outputs[-3])
    result = last_json(outputs[-1])
    assert result["strategy"] == "batch", text_of(outputs[-2])
    assert all(strategy == "batch" for _, _, strategy in result["tries"]), result  # no plain rerun
    assert len(result["tries"]) <= 3
    assert true - 1 <= result["batch"] <= true, (true, result)
