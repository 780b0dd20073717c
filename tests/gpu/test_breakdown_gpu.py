"""``%%cudamem --breakdown`` on a real GPU: a transformer fine-tune with AdamW, inference, NVTX ranges.

The model: an embedding of 1,000 tokens by 256, a ``TransformerEncoder`` of 2 layers (d_model 256, 4
heads, feed-forward 1,024) and a ``Linear(256, 10)`` head, float32. Worked out by hand, per layer:
in_proj 3*256*256 + 768 = 197,376; out_proj 256*256 + 256 = 65,792; linear1 256*1024 + 1024 = 263,168;
linear2 1024*256 + 256 = 262,400; two LayerNorms 2 * 512 = 1,024: 789,760 parameters. Two layers
1,579,520, the embedding 256,000 and the head 2,570: 1,838,090 parameters, 7,352,360 bytes. AdamW keeps
two moments per parameter on the GPU (its step counters stay on the CPU): 14,704,720 bytes.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

PARAMETER_BYTES = 1_838_090 * 4
STATE_BYTES = 2 * PARAMETER_BYTES

SETUP = """
import torch
class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(1000, 256)
        layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(256, 10)
    def forward(self, tokens):
        return self.head(self.encoder(self.embedding(tokens)).mean(dim=1))
model = Classifier().cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
tokens = torch.randint(0, 1000, (64, 128), device="cuda")
labels = torch.randint(0, 10, (64,), device="cuda")
"""

# zero_grad(set_to_none=False): every gradient exists from the first backward on, so the gradients at
# the peak are all the parameters' gradients, which the hand count above can check.
FINE_TUNE = """%%cudamem -o -q --breakdown
for step in range(3):
    optimizer.zero_grad(set_to_none=False)
    loss = torch.nn.functional.cross_entropy(model(tokens), labels)
    loss.backward()
    optimizer.step()
"""


def test_fine_tune_breakdown_sums_to_the_peak_and_counts_model_state(shell, torch):
    from jupyter_cudamem.breakdown import Category, Phase

    shell.run_cell(SETUP)
    torch.cuda.synchronize()
    result = shell.run_cell(FINE_TUNE)
    assert result.success, result.error_in_exec
    peak = torch.cuda.max_memory_allocated()  # the cell's peak: %%cudamem reset the counter as it started
    breakdown = result.result.breakdown
    assert breakdown is not None
    categories = breakdown.categories
    assert sum(categories.values()) == pytest.approx(peak, rel=0.01)
    assert sum(breakdown.modules.values()) == breakdown.peak_bytes
    assert categories[Category.PARAMETERS] == pytest.approx(PARAMETER_BYTES, rel=0.02)
    assert categories[Category.GRADIENTS] == pytest.approx(PARAMETER_BYTES, rel=0.02)
    assert categories[Category.OPTIMIZER_STATE] == pytest.approx(STATE_BYTES, rel=0.02)
    assert breakdown.phase in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER_STEP)
    assert {"model.encoder", "model.embedding", "model.head"} <= set(breakdown.modules)
    # the encoder's two layers hold most of the parameters: 1,579,520 of 1,838,090
    encoder = breakdown.module_categories("model.encoder")
    assert encoder[Category.PARAMETERS] == pytest.approx(1_579_520 * 4, rel=0.02)
    # a batch of 64 sequences of 128 tokens: the activations kept for backward are the largest share
    assert breakdown.dominant is Category.ACTIVATIONS


def test_inference_keeps_no_activations(shell, torch):
    from jupyter_cudamem.breakdown import Category, Phase

    shell.run_cell(SETUP + "model.eval(); del optimizer; model.zero_grad(set_to_none=True)")
    result = shell.run_cell("%%cudamem -o -q --breakdown\nwith torch.no_grad():\n    logits = model(tokens)")
    assert result.success, result.error_in_exec
    breakdown = result.result.breakdown
    categories = breakdown.categories
    assert categories[Category.ACTIVATIONS] == 0
    assert categories[Category.GRADIENTS] == 0 and categories[Category.OPTIMIZER_STATE] == 0
    assert categories[Category.PARAMETERS] == pytest.approx(PARAMETER_BYTES, rel=0.02)
    assert categories[Category.TEMPORARIES] > 0
    assert breakdown.phase is Phase.FORWARD


def test_nvtx_ranges_on_a_real_gpu(shell, torch):
    result = shell.run_cell("%%cudamem -o -q --nvtx\nx = torch.ones(1024, device='cuda').sum()")
    assert result.success, result.error_in_exec
    assert result.result.peak_allocated_bytes is not None


def test_a_compiled_fine_tune_runs_and_its_model_state_is_counted(shell, torch):
    from jupyter_cudamem.breakdown import Category

    shell.run_cell(SETUP + "compiled = torch.compile(model)")
    cell = FINE_TUNE.replace("model(tokens)", "compiled(tokens)")
    result = shell.run_cell(cell)
    assert result.success, result.error_in_exec
    breakdown = result.result.breakdown
    categories = breakdown.categories
    assert sum(categories.values()) == breakdown.peak_bytes
    assert categories[Category.PARAMETERS] == pytest.approx(PARAMETER_BYTES, rel=0.02)
    assert categories[Category.OPTIMIZER_STATE] == pytest.approx(STATE_BYTES, rel=0.02)
