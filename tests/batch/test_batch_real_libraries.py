"""The finder and the change room on the real libraries, where they are installed (the GPU machine has
them; CI does not, and skips). Everything runs on the CPU: tiny models built from configs, random data."""

from __future__ import annotations

import pytest
import torch

from jupyter_cudamem.batch import BatchChange, KnobKind, find_batch
from jupyter_cudamem.batch.libraries import is_hf_trainer, is_lightning_holder, lightning_batch_paths
from jupyter_cudamem.batch.knobs import ObjectPath
from tests.oomfix.shells import shell_without_failures


def run(shell, cells):
    for cell in cells:
        result = shell.run_cell(cell, store_history=True)
        assert result.success, result.error_in_exec or result.error_before_exec


def test_hugging_face_trainer_is_found_changed_trained_and_put_back(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    shell = shell_without_failures()
    shell.history_manager.reset(new_session=True)
    shell.execution_count = 1
    run(shell, [
        "import torch\nfrom transformers import BertConfig, BertForSequenceClassification, TrainingArguments, Trainer\n",
        f"""config = BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=32, num_labels=2)
bert = BertForSequenceClassification(config)
class RandomTokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return {{"input_ids": torch.randint(0, 100, (8,)), "attention_mask": torch.ones(8, dtype=torch.long),
                "labels": torch.tensor(i % 2)}}
args = TrainingArguments(output_dir={str(tmp_path)!r}, per_device_train_batch_size=32, max_steps=1, use_cpu=True,
                         report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True)
trainer = Trainer(model=bert, args=args, train_dataset=RandomTokens())
""",
    ])
    history = list(shell.history_manager.input_hist_raw)
    trainer = shell.user_ns["trainer"]
    assert is_hf_trainer(trainer)
    finding = find_batch("trainer.train()\n", shell.user_ns, shell.transform_cell, history=history, cell_number=3)
    knob = finding.chosen
    assert (knob.kind, knob.label, knob.value, knob.origin) == (
        KnobKind.TRAINER, "trainer.args.per_device_train_batch_size", 32, "In[2] line 10")
    change = BatchChange(finding, namespace=shell.user_ns, history=history)
    change.apply(8)
    assert trainer._train_batch_size == 8
    run(shell, ["result = trainer.train()\n"])
    assert shell.user_ns["result"].metrics["epoch"] == pytest.approx(8 / 64)  # one step of 8 items of 64
    assert "per_device_train_batch_size=8, max_steps=1" in change.diffs(8)[0].after
    change.restore()
    assert trainer.args.per_device_train_batch_size == 32 and trainer._train_batch_size == 32


def test_lightning_datamodule_hparams_are_found_where_lightning_keeps_them():
    lightning = pytest.importorskip("lightning")

    class DataModule(lightning.LightningDataModule):
        def __init__(self, batch_size=64):
            super().__init__()
            self.save_hyperparameters()
            self.batch_size = batch_size

    dm = DataModule(batch_size=256)
    assert is_lightning_holder(dm)
    assert [(p.text, v) for p, v in lightning_batch_paths(dm, ObjectPath("dm"))] == [
        ("dm.batch_size", 256), ('dm.hparams["batch_size"]', 256)]
    finding = find_batch("trainer.fit(model, datamodule=dm)\n", {"dm": dm, "model": torch.nn.Linear(1, 1)})
    change = BatchChange(finding, namespace={"dm": dm})
    change.apply(32)
    assert dm.batch_size == 32 and dm.hparams["batch_size"] == 32
    change.restore()
    assert dm.batch_size == 256 and dm.hparams["batch_size"] == 256
