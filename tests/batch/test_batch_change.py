"""Changing a batch size where it lives, and putting it back (jupyter_cudamem/batch/change.py)."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, TensorDataset

from jupyter_cudamem.batch import BatchChange, find_batch, rebuilt_loader
from jupyter_cudamem.batch.change import live_batch, text_change
from jupyter_cudamem.batch.knobs import (
    BatchFinding,
    Default,
    Knob,
    KnobKind,
    Loader,
    ObjectPath,
    Step,
    TrainerArgs,
    Value,
    Written,
)
from jupyter_cudamem.cell.source import Span
from jupyter_cudamem.errors import CudaMemError


def collate(rows):
    return torch.stack([r[0] for r in rows])


def test_a_rebuilt_loader_keeps_everything_but_the_batch():
    generator = torch.Generator().manual_seed(3)
    dataset = TensorDataset(torch.arange(100.0).unsqueeze(1))
    loader = DataLoader(
        dataset,
        batch_size=32,
        shuffle=True,
        generator=generator,
        collate_fn=collate,
        drop_last=True,
        num_workers=2,
        prefetch_factor=4,
        persistent_workers=True,
        pin_memory=False,
        timeout=5,
    )
    new = rebuilt_loader(loader, 8)
    assert new.batch_size == 8 and new.dataset is dataset and new.sampler is loader.sampler
    assert isinstance(new.sampler, RandomSampler) and new.generator is generator
    assert (
        new.collate_fn,
        new.drop_last,
        new.num_workers,
        new.prefetch_factor,
        new.persistent_workers,
        new.timeout,
    ) == (collate, True, 2, 4, True, 5)
    plain = rebuilt_loader(DataLoader(dataset, batch_size=10), 4)
    assert [len(b[0]) for b in plain][:2] == [4, 4] and plain.prefetch_factor is None
    sampled = DataLoader(dataset, batch_sampler=BatchSampler(RandomSampler(dataset), 50, drop_last=True))
    assert rebuilt_loader(sampled, 20).batch_sampler.batch_size == 20

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(torch.zeros(10, 1))

    assert len(next(iter(rebuilt_loader(DataLoader(Stream(), batch_size=5), 2)))) == 2


def test_a_loader_that_cannot_be_rebuilt_says_why():
    class Buckets(torch.utils.data.Sampler):
        def __iter__(self):
            yield [0]

    with pytest.raises(CudaMemError, match="custom batch_sampler"):
        rebuilt_loader(DataLoader(TensorDataset(torch.zeros(2)), batch_sampler=Buckets()), 2)

    class Odd(DataLoader):
        def __init__(self, data):
            super().__init__(data)

    with pytest.raises(CudaMemError, match="takes other arguments"):
        rebuilt_loader(Odd(TensorDataset(torch.zeros(2))), 2)


class LegacyShard(DataLoader):
    """Shaped like accelerate's ``DataLoaderShard`` before its adapter (0.30): a DataLoader subclass built
    from a device and ``**kwargs``, batching with the prepared loader's stock BatchSampler."""

    def __init__(self, dataset, device=None, **kwargs):
        super().__init__(dataset, **kwargs)
        self.device = device


def test_a_loader_subclass_that_cannot_be_rebuilt_gets_the_batch_in_its_sampler():
    dataset = TensorDataset(torch.randn(256, 4))
    plain = DataLoader(dataset, batch_size=64, shuffle=True)
    namespace = {"loader": LegacyShard(dataset, device="cpu", batch_sampler=plain.batch_sampler)}
    finding = find_batch("for (x,) in loader:\n    model(x).sum().backward()\n", namespace)
    assert finding.chosen.label == "loader.batch_size" and finding.chosen.value == 64
    change = BatchChange(finding, namespace=namespace)
    change.apply(16)
    shard = namespace["loader"]
    assert type(shard) is LegacyShard and [len(x) for (x,) in shard] == [16] * 16  # the same prepared loader
    change.restore()
    assert namespace["loader"] is shard and [len(x) for (x,) in shard] == [64] * 4


def knob(*live, written=(), value=64):
    return Knob("k", value, KnobKind.FIELD, "value", 10, written, live, "In[1] line 1")


def test_values_keys_attributes_and_frozen_dataclasses_are_set_and_put_back():
    @dataclasses.dataclass(frozen=True)
    class Hparams:
        batch_size: int = 64

    namespace = {
        "bs": 64,
        "cfg": {"train": {"batch_size": 64}},
        "args": types.SimpleNamespace(batch_size=64),
        "hp": Hparams(),
    }
    paths = [
        ObjectPath("bs"),
        ObjectPath("cfg", (Step("train", True), Step("batch_size", True))),
        ObjectPath("args", (Step("batch_size"),)),
        ObjectPath("hp", (Step("batch_size"),)),
    ]
    change = BatchChange(BatchFinding("run()\n", ()), knob(*(Value(p) for p in paths)), namespace)
    assert change.apply(16) == "run()\n"
    assert [live_batch(namespace, Value(p)) for p in paths] == [16, 16, 16, 16]
    change.apply(8)  # a second try; the originals are still the ones before the first
    change.restore()
    assert [live_batch(namespace, Value(p)) for p in paths] == [64, 64, 64, 64]


def test_loader_trainer_and_default_are_changed_and_restored():
    loader = DataLoader(TensorDataset(torch.zeros(64, 1)), batch_size=64, shuffle=True)

    @dataclasses.dataclass
    class TrainingArguments:
        per_device_train_batch_size: int = 64

        @property
        def train_batch_size(self):
            return self.per_device_train_batch_size

    trainer = types.SimpleNamespace(args=TrainingArguments(), _train_batch_size=64)

    def make(n=64, *, m=64):
        return n, m

    namespace = {"loader": loader, "trainer": trainer, "make": make}
    targets = (
        Loader(ObjectPath("loader")),
        TrainerArgs(ObjectPath("trainer"), "per_device_train_batch_size"),
        Default(ObjectPath("make"), "n"),
        Default(ObjectPath("make"), "m"),
    )
    change = BatchChange(BatchFinding("x\n", ()), knob(*targets), namespace)
    change.apply(16)
    assert namespace["loader"].batch_size == 16 and namespace["loader"] is not loader
    assert trainer.args.per_device_train_batch_size == 16 and trainer._train_batch_size == 16  # train() reads the copy
    assert make() == (16, 16)
    change.restore()
    assert namespace["loader"] is loader and trainer._train_batch_size == 64 and make() == (64, 64)


def test_a_failed_apply_leaves_nothing_half_changed():
    namespace = {"bs": 64}
    change = BatchChange(BatchFinding("x\n", ()), knob(Value(ObjectPath("bs")), Value(ObjectPath("gone"))), namespace)
    with pytest.raises(CudaMemError, match="gone is no longer in the namespace"):
        change.apply(16)
    assert namespace == {"bs": 64}


def test_diffs_per_cell_and_paste_code():
    history = ["", "import torch\nbatch_size = 64  # fits on the A100\n"]
    source = "x = torch.randn(batch_size, 8)\nh = torch.zeros(64, 8)\nmodel(x, h)\n"
    namespace = {"batch_size": 64, "torch": torch, "model": None}
    finding = find_batch(source, namespace, history=history, cell_number=2)
    change = BatchChange(finding, namespace=namespace, history=history)
    assert change.apply(16) == source.replace("zeros(64", "zeros(16") and namespace["batch_size"] == 16
    earlier, failed = change.diffs(16)
    assert (earlier.label, earlier.cell_number, failed.label) == ("In[1]", 1, "the failed cell")
    assert "+batch_size = 16  # fits on the A100" in earlier.diff and "+h = torch.zeros(16, 8)" in failed.diff
    paste = change.paste_code(16)
    assert paste.startswith(
        "# In[1] with batch 16 (was 64): run this in its place, then the failed cell\nimport torch\n"
    )
    assert (
        "# the failed cell, with the batch that fits\nx = torch.randn(batch_size, 8)\nh = torch.zeros(16, 8)" in paste
    )
    change.restore()
    assert namespace["batch_size"] == 64


def test_paste_code_is_the_cell_alone_when_only_it_changes_and_statements_when_nothing_is_written():
    finding = find_batch("bs = 64\nmodel(torch.randn(bs, 3))\n")
    assert BatchChange(finding).paste_code(8) == "bs = 8\nmodel(torch.randn(bs, 3))\n"
    unwritten = BatchChange(
        BatchFinding("x\n", ()),
        knob(Value(ObjectPath("cfg", (Step("batch_size", True),)))),
        {"cfg": {"batch_size": 64}},
    )
    assert unwritten.paste_code(8).endswith('keep it with:\ncfg["batch_size"] = 8\n')


def test_text_change_for_the_driver_of_today():
    finding = find_batch("%%time\nx = torch.randn(batch_size, 784, device='cuda')\n", {"batch_size": 4096})
    assert text_change(finding, finding.chosen, 1000).splitlines() == [
        "%%time",
        "batch_size = 1000  # set by %oomfix, was 4096",
        "x = torch.randn(batch_size, 784, device='cuda')",
    ]
    with pytest.raises(ValueError, match="cannot be set by the cell's text"):
        text_change(finding, knob(Loader(ObjectPath("loader"))), 8)


def test_chunks_are_written_as_a_count():
    written = Written(None, Span(1, 0, 1), total=1000)
    assert written.text_for(250) == "4" and written.text_for(300) == "4" and written.text_for(100) == "10"
