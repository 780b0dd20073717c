"""``%oomfix --yes`` on a real GPU where a library runs the training loop: a Lightning ``Trainer.fit`` whose
batch lives in a ``LightningDataModule`` of an earlier cell (its module appends each step's loss to a list
of its own, Lightning's pattern for epoch-end hooks), and an ``accelerate`` loop over a loader its
``Accelerator`` prepared under bf16.

In a real kernel, PyTorch capped at 3 GiB with ``set_per_process_memory_fraction``: the cell fails with a
CUDA OOM, ``%oomfix --yes`` fixes it, and the last cell prints what the fixed run left. It must fit at a
smaller batch set where the batch lives, and leave one run's trace: Lightning's step count and the module's
list of losses those of one run of the fitted cell, not of every rerun.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_oomfix_libraries_gpu.py`` (about 2 minutes).
"""

from __future__ import annotations

import textwrap

import pytest

from tests.notebook_runner import gpu_notebook_module

torch, pytestmark = gpu_notebook_module()

from tests.gpu.test_oomfix_knobs_gpu import SETUP as CAPPED_SETUP, fixed  # noqa: E402


# The knobs tests' kernel (PyTorch capped at 3 GiB), with no experiment tracker and no library warnings.
SETUP = CAPPED_SETUP + """import os, warnings
os.environ["WANDB_MODE"] = "disabled"
warnings.filterwarnings("ignore")
"""

# A transformer encoder over 256 tokens of width 256: about 10 MiB of activations per sample in training.
ENCODER = """def encoder():
    layer = nn.TransformerEncoderLayer(256, 8, 1024, batch_first=True)
    return nn.Sequential(nn.Embedding(1000, 256), nn.TransformerEncoder(layer, 4))

class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 4096
    def __getitem__(self, i):
        return torch.randint(0, 1000, (256,)), torch.tensor(i % 2)
"""

# The last cell: ``result`` (what the fixed run left, read first), then for the record one step a sample
# above, and 11% above, what was found (printed, not asserted: the sweep is where quality is measured).
REPORT = """{result}
import gc
def fits(b):
    try:
{step}
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        gc.collect(); torch.cuda.empty_cache()
found = outcome.batch_after
result["above"] = {{b: fits(b) for b in (found + 1, int(found / 0.9) + 1)}} if outcome.fitted else {{}}
result["tries"] = [[t.batch, t.fitted] for t in outcome.tries]
print("RESULT " + json.dumps(result))
"""


def report(result: str, step: str) -> str:
    """The last cell: ``result`` binds the dict to print; ``step`` is one step at batch ``b``."""
    return REPORT.format(result=result, step=textwrap.indent(step, " " * 8))


def test_lightning_trainer_fit_with_the_batch_in_a_datamodule():
    pl = pytest.importorskip("pytorch_lightning")
    module = f"""import {pl.__name__} as pl

class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = encoder()
        self.head = nn.Linear(256, 2)
        self.step_losses = []
    def training_step(self, batch, index):
        tokens, labels = batch
        loss = nn.functional.cross_entropy(self.head(self.body(tokens).mean(1)), labels)
        self.step_losses.append(loss.item())
        return loss
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

class Data(pl.LightningDataModule):
    def __init__(self, batch_size):
        super().__init__()
        self.batch_size = batch_size
    def train_dataloader(self):
        return torch.utils.data.DataLoader(Tokens(), batch_size=self.batch_size, shuffle=True)

model = Classifier()
data = Data(batch_size=1024)  # written for a bigger card
"""
    failing = """trainer = pl.Trainer(max_steps=3, accelerator="gpu", devices=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, data)
"""
    last = report(
        'result = {"batch": data.batch_size, "steps": trainer.global_step, "losses": len(model.step_losses),\n'
        '          "fitted": outcome.fitted, "after": outcome.batch_after}',
        "data.batch_size = b\n"
        "pl.Trainer(max_steps=1, accelerator='gpu', devices=1, logger=False, enable_checkpointing=False,\n"
        "           enable_progress_bar=False, enable_model_summary=False).fit(model, data)")
    text, result = fixed([SETUP, ENCODER, module, failing, "outcome = %oomfix --yes -o", last], failing=3)
    assert result["fitted"] and result["batch"] == result["after"] < 1024, (result, text)
    # One run of the fitted cell: three steps, three losses in the module's own list, whatever the reruns did.
    assert result["steps"] == 3 and result["losses"] == 3, (result, text)
    print(result["tries"], "one fit above what was found fits:", result["above"])


def test_accelerate_loop_over_a_prepared_loader_under_bf16():
    pytest.importorskip("accelerate")
    prepared = """from accelerate import Accelerator
accelerator = Accelerator(mixed_precision="bf16")
class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = encoder(), nn.Linear(256, 2)
    def forward(self, tokens):
        return self.head(self.body(tokens).mean(1))

model = Classifier()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
loader = torch.utils.data.DataLoader(Tokens(), batch_size=1024, shuffle=True)  # written for a bigger card
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
losses = []
"""
    failing = """for step, (tokens, labels) in enumerate(loader):
    loss = nn.functional.cross_entropy(model(tokens), labels)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
    if step == 2:
        break
"""
    last = report(
        'result = {"batch": tokens.shape[0], "losses": len(losses), "fitted": outcome.fitted,\n'
        '          "after": outcome.batch_after}',
        "tokens = torch.randint(0, 1000, (b, 256), device=accelerator.device)\n"
        "labels = torch.randint(0, 2, (b,), device=accelerator.device)\n"
        "accelerator.backward(nn.functional.cross_entropy(model(tokens), labels))\n"
        "optimizer.step()\n"
        "optimizer.zero_grad()")
    text, result = fixed([SETUP, ENCODER, prepared, failing, "outcome = %oomfix --yes -o", last], failing=3)
    assert result["fitted"] and result["batch"] == result["after"] < 1024, (result, text)
    assert result["losses"] == 3, (result, text)  # one run's three steps, not every rerun's
    print(result["tries"], "one step above what was found fits:", result["above"])
