"""``%oomfix --yes`` on a real GPU where the batch lives in an earlier cell: a config dict, a DataLoader,
and a Hugging Face ``Trainer`` built from a small ``BertConfig`` (no download, random tokens).

Each notebook caps PyTorch with ``set_per_process_memory_fraction``, runs the earlier cells, runs a
cell that fails with a CUDA OOM, ``%oomfix --yes``, then a cell that prints what the fixed run left:
the batch must be smaller, in place where it lives (the dict's value, the rebuilt loader, the
Trainer's arguments and its copy), equal to what the rerun trained with, and the report must show the
diff of the earlier cell that sets it.

Run them on the GPU machine with ``pytest -m gpu tests/gpu/test_oomfix_knobs_gpu.py`` (about 3-4 minutes: the Trainer
notebook imports transformers).
"""

from __future__ import annotations

from tests.notebook_runner import REPO, gpu_notebook_module, json_line, run_cells, text_of

torch, pytestmark = gpu_notebook_module()


SETUP = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
import json
import torch
from torch import nn
%load_ext jupyter_cudamem
torch.cuda.set_per_process_memory_fraction(3 * 2**30 / torch.cuda.get_device_properties(0).total_memory)
"""

CNN = """model = nn.Sequential(
    nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
    nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
).cuda()
optimizer = torch.optim.Adam(model.parameters())
"""


def fixed(cells: list[str], failing: int) -> tuple[str, dict]:
    """Run the notebook; return what ``%oomfix --yes`` printed and the JSON the last cell printed."""
    notebook = run_cells(cells, timeout=600, allow_errors_in={failing})
    outputs = notebook.cells
    assert "OutOfMemoryError" in text_of(outputs[failing]), text_of(outputs[failing])
    report = text_of(outputs[failing + 1])
    assert "Fixed with batch" in report, report  # the lead's second line
    return report, json_line(outputs[-1])


def test_batch_in_a_config_dict_from_an_earlier_cell():
    config = 'config = {"lr": 1e-3,\n          "batch_size": 8192}  # written for a bigger card\n'
    failing = """x = torch.randn(config["batch_size"], 3, 64, 64, device="cuda")
y = torch.randint(0, 10, (config["batch_size"],), device="cuda")
loss = nn.functional.cross_entropy(model(x), y)
loss.backward()
optimizer.step()
optimizer.zero_grad()
trained_batch = x.shape[0]
"""
    check = 'print("RESULT " + json.dumps({"batch": config["batch_size"], "trained": trained_batch}))'
    report, result = fixed([SETUP, config, CNN, failing, "%oomfix --yes --verbose", check], failing=3)
    assert 0 < result["batch"] < 8192 and result["trained"] == result["batch"], report
    assert "--- In[2]" in report and f'+          "batch_size": {result["batch"]}}}' in report, report


def test_batch_in_a_dataloader_from_an_earlier_cell():
    data = """from torch.utils.data import DataLoader, TensorDataset
train_ds = TensorDataset(torch.randn(16384, 3, 64, 64), torch.randint(0, 10, (16384,)))
train_loader = DataLoader(train_ds, batch_size=4096, shuffle=True, drop_last=True)
"""
    failing = """for step, (x, y) in enumerate(train_loader):
    x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if step == 1:
        break
trained_batch = x.shape[0]
"""
    check = (
        'print("RESULT " + json.dumps({"batch": train_loader.batch_size, "trained": trained_batch, '
        '"shuffles": type(train_loader.sampler).__name__, "drop_last": train_loader.drop_last}))'
    )
    report, result = fixed([SETUP, data, CNN, failing, "%oomfix --yes --verbose", check], failing=3)
    assert 0 < result["batch"] < 4096 and result["trained"] == result["batch"], report
    assert result["shuffles"] == "RandomSampler" and result["drop_last"] is True  # rebuilt with everything else kept
    assert "--- In[2]" in report and f"batch_size={result['batch']}, shuffle=True" in report, report


def test_hugging_face_trainer_train_with_a_model_built_from_its_config(tmp_path):
    model = f"""from transformers import BertConfig, BertForSequenceClassification, TrainingArguments, Trainer
config = BertConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                    intermediate_size=1024, max_position_embeddings=512, num_labels=2)
bert = BertForSequenceClassification(config)

class RandomTokens(torch.utils.data.Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(index)
        return {{"input_ids": torch.randint(0, 1000, (512,), generator=g), "attention_mask": torch.ones(512, dtype=torch.long),
                "labels": torch.tensor(index % 2)}}

args = TrainingArguments(output_dir={str(tmp_path / "bert")!r}, per_device_train_batch_size=1024, max_steps=2,
                         report_to=[], use_cpu=False, save_strategy="no", logging_strategy="no", disable_tqdm=True)
trainer = Trainer(model=bert, args=args, train_dataset=RandomTokens())
"""
    failing = "result = trainer.train()\n"
    check = (
        'print("RESULT " + json.dumps({"batch": trainer.args.per_device_train_batch_size, '
        '"copied": trainer._train_batch_size, "steps": trainer.state.global_step}))'
    )
    report, result = fixed([SETUP, model, failing, "%oomfix --yes --verbose", check], failing=2)
    assert 0 < result["batch"] < 1024 and result["copied"] == result["batch"], report
    assert result["steps"] == 2, report
    assert "--- In[2]" in report and f"per_device_train_batch_size={result['batch']}" in report, report
