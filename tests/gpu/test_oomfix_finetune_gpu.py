"""``%oomfix`` on a transformer fine-tune whose largest batch is under 10, on a real GPU, in a real kernel.

A GPT-style decoder (``torch.nn.TransformerEncoder`` with a causal mask, 8 layers of width 1024, a
32,000-token embedding and head: about 135M parameters, 2.2 GB with AdamW's two state tensors and the
gradients) is fine-tuned at sequence 1024 under bf16 autocast, PyTorch capped at 6 GiB. Built in an
earlier cell, or in the failing cell itself (the case where the cleanup frees the failed cell's own
model, which a plain rerun would build again). The cell fails at a batch far too big; ``%oomfix --yes``
must end within one sample of the largest batch that keeps fitting (the cell run three times in a row in
a fresh kernel), in at most 3 reruns, without a plain rerun, and the fixed cell must run three more times
in the same kernel (the model built in the cell: with the last run's model bound while it builds the next).

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_oomfix_finetune_gpu.py -v`` (about 2 minutes).
"""

from __future__ import annotations

import pytest

from tests.notebook_runner import gpu_notebook_module

torch, pytestmark = gpu_notebook_module()

from tests.gpu.test_oomfix_gpu import SETUP, assert_holds, cap, fix_and_run_again, steady_largest  # noqa: E402


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


def setup(built_in_cell: bool) -> list[str]:
    return [SETUP + cap(6), MODEL] + ([] if built_in_cell else [BUILD])


def step(built_in_cell: bool) -> str:
    return (BUILD if built_in_cell else "") + STEP


FROM_EARLIER = pytest.param(False, id="model-from-earlier-cell")


@pytest.mark.parametrize("built_in_cell", [FROM_EARLIER, pytest.param(True, id="model-built-in-cell")])
def test_oomfix_lands_within_a_sample_of_the_largest_batch_that_keeps_fitting(built_in_cell):
    true = steady_largest(setup(built_in_cell), step(built_in_cell), 2)
    assert 1 <= true < 10, true
    result, text, next_runs = fix_and_run_again(setup(built_in_cell), step(built_in_cell), 60)
    print(f"built in cell {built_in_cell}: keeps fitting up to {true}, found {result['batch']}, tries {result['tries']}")
    assert result["strategy"] == "batch", text
    assert len(result["tries"]) <= 3  # no plain rerun either: every try is the batch's
    assert_holds(result, text, next_runs)
    assert true - 1 <= result["batch"] <= true, (true, result, text)
