"""The finder and the change room on the real libraries, where they are installed (the GPU machine has
them; ``pip install .[real]`` installs them on a CPU, without a CUDA torch). Tiny models built from
configs, random data; nothing is downloaded.

The corpus notebooks that import transformers, accelerate or Lightning run here on the real libraries
(``standins.installed(real=True)``: only the Hub's loaders are replaced, by tiny real models and a real
tokenizer), so the finder meets the real ``Trainer``, ``TrainingArguments``, ``LightningDataModule``,
Lightning ``Trainer`` and accelerate's prepared loaders, not look-alikes; then a few are changed to a
smaller batch and rerun on the real objects, and the steps they took are counted.
"""

from __future__ import annotations

import re

import pytest
import torch
from IPython.core.interactiveshell import InteractiveShell

from jupyter_cudamem.batch import BatchChange, KnobKind, find_batch
from jupyter_cudamem.batch.knobs import ObjectPath
from jupyter_cudamem.batch.libraries import is_hf_trainer, is_lightning_holder, lightning_batch_paths
from tests.oomfix.corpus import CELLS, load_case, load_cases, rerun_changed, run_case
from tests.oomfix.shells import shell_without_failures
from tests.oomfix.standins import REAL_LIBRARIES

pytestmark = pytest.mark.real_libraries


def libraries_of(case) -> set[str]:
    text = "\n".join(case.cells)
    return {name for name in REAL_LIBRARIES if re.search(rf"^\s*(from|import) {name}\b", text, re.MULTILINE)}


REAL_CASES = [case for case in load_cases() if libraries_of(case)]


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No Hub, no experiment trackers; what the libraries write goes to a temporary folder."""
    for name, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("WANDB_MODE", "disabled")):
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)


def need(*names: str) -> None:
    for name in names:
        pytest.importorskip(name)


def test_the_corpus_has_notebooks_for_each_real_library():
    covered = set().union(*(libraries_of(case) for case in REAL_CASES))
    assert covered == {"transformers", "accelerate", "lightning", "pytorch_lightning"}


@pytest.mark.parametrize("case", REAL_CASES, ids=[c.name for c in REAL_CASES])
def test_a_corpus_notebook_on_the_real_libraries(case, offline):
    trains_with_trainer = "transformers" in libraries_of(case) and "Trainer(" in "".join(case.cells)
    need(*libraries_of(case), *(["accelerate"] if trains_with_trainer else []))  # transformers' Trainer needs it
    result = run_case(case, real=True)
    assert not result.errors, f"{case.name}: earlier cells failed on the real libraries: {result.errors}"
    assert result.failure == "OutOfMemoryError", f"{case.name} stopped before any module ran: {result.failure}"
    assert result.verdict == "right", (
        f"{case.name}: found {result.found} at {list(result.edits)}, expected {case.expect} at {list(case.edits)}\n"
        f"{result.finding.summary()}"
    )
    assert not result.change_problems, result.change_problems


def rerun(name: str, batch: int):
    result, source, outcome = rerun_changed(load_case(CELLS / f"{name}.ipy"), batch, real=True)
    assert not result.errors and outcome.success, (result.errors, outcome.error_in_exec)
    return result, InteractiveShell.instance().user_ns


def test_a_real_trainer_trains_with_the_halved_batch(offline):
    need("transformers", "accelerate")
    result, namespace = rerun("hf01_trainer_train", 8)
    trainer = namespace["trainer"]
    assert trainer.state.train_batch_size == 8
    assert trainer.state.global_step == 12  # 3 epochs of 32 sentence pairs in batches of 8
    assert trainer.args.per_device_train_batch_size == 16  # put back after the try


def test_a_loader_accelerate_prepared_batches_the_halved_batch_and_is_put_back(offline):
    need("accelerate")
    result, namespace = rerun("acc01_prepared_loader", 32)
    assert namespace["inputs"].shape == (32, 32)  # 256 rows of 32 features in batches of 32
    loader = namespace["train_dataloader"]
    assert type(loader).__name__ == "DataLoaderShard"  # accelerate's own wrapper, changed in place
    assert loader.batch_sampler.batch_size == 64


def test_a_loader_a_real_accelerator_prepared_in_a_later_cell_is_pasted_with_the_prepare_cell(offline):
    need("accelerate")
    from tests.batch.test_finder_families import paste_and_run

    result, namespace = rerun("acc02_prepared_in_later_cell", 32)
    assert namespace["sizes"] == [32] * 8  # the try, on accelerate's own DataLoaderShard changed in place
    assert namespace["train_dataloader"].batch_sampler.batch_size == 64  # put back
    paste, namespace = paste_and_run(result, 32, real=True)
    assert "In[3], unchanged" in paste
    # The loader and the model the failed cell ran with are prepared again, not the bare ones In[2] builds.
    assert type(namespace["train_dataloader"]).__name__ == "DataLoaderShard"
    assert type(namespace["optimizer"]).__name__ == "AcceleratedOptimizer"
    assert namespace["sizes"] == [32] * 8


def test_a_real_lightning_module_that_builds_its_own_loader_fits_with_the_halved_batch(offline):
    need("lightning")
    result, namespace = rerun("pl03_module_own_loader", 256)
    assert namespace["trainer"].global_step == 20  # 5 epochs of 1024 rows in batches of 256
    assert namespace["model"].batch_size == 512


def test_a_real_lightning_datamodule_fits_with_the_halved_batch(offline):
    need("lightning")
    result, namespace = rerun("pl01_datamodule_keyword", 128)
    assert namespace["trainer"].train_dataloader.batch_size == 128
    assert namespace["dm"].batch_size == 256


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
