"""Finding where a failed cell's batch size lives (jupyter_cudamem/batch/finder.py).

Numbers written in the cell, and values it reads from the namespace, with the input history that
set them; the corpus in tests/oomfix/cells covers whole notebooks, these cases one rule each.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from jupyter_cudamem.batch import BatchChange, KnobKind, batch_like, find_batch
from jupyter_cudamem.batch.knobs import Loader, ObjectPath, TrainerArgs, Value


def chosen(source, namespace=None, history=None, cell_number=None):
    finding = find_batch(source, namespace, history=history, cell_number=cell_number)
    assert finding.chosen is not None, finding.summary()
    return finding.chosen


def changed_lines(before: str, after: str) -> list[tuple[str, str]]:
    old, new = before.splitlines(), after.splitlines()
    assert len(old) == len(new)
    return [(a, b) for a, b in zip(old, new) if a != b]


def apply(source, value, namespace=None):
    finding = find_batch(source, namespace)
    return BatchChange(finding, namespace=namespace).apply(value)


# -- numbers written in the cell -------------------------------------------------------------------
TRAINING_LOOP = """import torch
from torch import nn

batch_size = 512  # what fitted on the A100
model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 64 * 64, 10)).cuda()
optimizer = torch.optim.Adam(model.parameters())
for step in range(100):
    x = torch.randn(batch_size, 3, 64, 64, device="cuda")
    y = torch.randint(0, 10, (batch_size,), device="cuda")
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def test_plain_training_loop_changes_only_the_assignment():
    knob = chosen(TRAINING_LOOP)
    assert (knob.label, knob.kind, knob.line) == ("batch_size", KnobKind.CELL, 4)
    assert knob.evidence == ("a tensor's batch dimension",)
    assert changed_lines(TRAINING_LOOP, apply(TRAINING_LOOP, 200)) == [
        ("batch_size = 512  # what fitted on the A100", "batch_size = 200  # what fitted on the A100")
    ]


def test_dataloader_keyword_and_hf_arguments_prefer_training():
    source = "train_loader = torch.utils.data.DataLoader(train_set, batch_size=256, shuffle=True)\n"
    knob = chosen(source)
    assert (knob.form, knob.value) == ("keyword", 256)
    hf = (
        'args = TrainingArguments(\n    output_dir="out",\n    per_device_train_batch_size=64,\n'
        "    per_device_eval_batch_size=128,\n)\ntrainer = Trainer(model=model, args=args)\ntrainer.train()\n"
    )
    finding = find_batch(hf)
    assert finding.chosen.label == "per_device_train_batch_size"
    assert [k.label for k in finding.others] == ["per_device_eval_batch_size"]
    assert "also seen: per_device_eval_batch_size=128 (line 4)" in finding.summary()


def test_nested_function_default_and_literal_dimensions():
    nested = (
        "def make_loader(dataset, bs=128):\n    return DataLoader(dataset, bs)\n\n"
        "for xb in make_loader(ds):\n    model(xb)\n"
    )
    knob = chosen(nested)
    assert (knob.label, knob.form, knob.line) == ("bs", "default", 1)
    tensors = (
        'x = torch.randn(512, 3, 224, 224, device="cuda")\nlabels = torch.randint(0, 1000, (512,), device="cuda")\n'
        'weights = torch.randn(256, 256, device="cuda")\nout = model(x)\n'
    )
    knob = chosen(tensors)
    assert (knob.form, knob.value, len(knob.written)) == ("tensor", 512, 2)
    after = apply(tensors, 96)
    assert "torch.randn(96, 3, 224, 224" in after and "(96,)" in after and "torch.randn(256, 256" in after


def test_unpacked_names_and_ipython_syntax():
    knob = chosen("B, T, C = 32, 1024, 768\nx = torch.zeros(B, T, C, device='cuda')\ny = model(x)\n")
    assert (knob.label, knob.value) == ("B", 32)  # T and C are not batch dimensions
    cell = "%%time\n!nvidia-smi\nBATCH = 1024\nfiles = !ls data\ndata = torch.randn(BATCH, 784)\nmodel(data)\n"
    assert chosen(cell).line == 3
    assert changed_lines(cell, apply(cell, 300)) == [("BATCH = 1024", "BATCH = 300")]


@pytest.mark.parametrize(
    "source",
    [
        "a = torch.randn(8192, 8192, device='cuda')\nouts = [a @ a for _ in range(16)]\n",  # square matrix
        "A = torch.randn(4096, 1024)\nB = torch.randn(1024, 2048)\nC = A @ B\n",  # matmul-only
        "class_correct = [0.] * 10\nclass_total = list(0. for i in range(10))\nout = net(images)\n",  # accumulators
        "for batch, (X, y) in enumerate(loader_list):\n    print(batch)\n",  # a loop counter
    ],
)
def test_what_is_not_a_batch(source):
    finding = find_batch(source, {"loader_list": [], "net": None, "images": None})
    assert finding.chosen is None and "no batch size" in finding.summary() and "\n" not in finding.summary()


def test_printed_only_and_loop_counters_from_the_namespace_are_not_batches():
    namespace = {"batch_size": 256, "batch": 7, "model": None, "x": None}
    source = "print(f'batch size {batch_size}')\nfor batch in range(3):\n    out = model(x)\n"
    assert find_batch(source, namespace).chosen is None


def test_slices_steps_splits_replication_and_generation_counts():
    assert chosen("out = model(**tok(texts[:64], return_tensors='pt'))\n", {"texts": ["a"] * 100}).label == "texts[:64]"
    stepped = chosen("for i in range(0, len(texts), 32):\n    out = model(tok(texts[i:i + 32]))\n", {"texts": []})
    assert (stepped.form, len(stepped.written)) == ("range step", 2)
    assert chosen("outs = [model(c) for c in x.split(512)]\n", {"x": torch.zeros(1000, 2)}).value == 512
    chunks = chosen("outs = [model(c) for c in torch.chunk(x, 4)]\n", {"x": torch.zeros(1000, 2), "torch": torch})
    assert (chunks.form, chunks.value) == ("chunks", 250)
    assert chosen("images = pipe([prompt] * 16).images\n").value == 16
    assert chosen("out = model.generate(ids, num_return_sequences=8)\n").label == "num_return_sequences"
    # A window at random offsets is not a batch: nanoGPT's data[i:i + block_size].
    assert find_batch("x = torch.stack([data[i:i + block_size] for i in ix])\n", {"block_size": 256}).chosen is None


def test_sequence_first_model_puts_the_batch_in_dimension_one():
    namespace = {"rnn": torch.nn.LSTM(10, 20, 2), "torch": torch}
    knob = chosen("x = torch.randn(5, 256, 10)\nh0 = torch.randn(2, 256, 20)\nout = rnn(x, (h0, h0))\n", namespace)
    assert (knob.value, len(knob.written)) == (256, 2)
    batch_first = {"rnn": torch.nn.LSTM(10, 20, 2, batch_first=True), "torch": torch}
    assert chosen("x = torch.randn(256, 5, 10)\nout = rnn(x)\n", batch_first).value == 256


def test_unparseable_cell_is_one_line():
    finding = find_batch("for x in :\n    pass\n")
    assert finding.chosen is None and "does not parse" in finding.summary() and "line 1" in finding.summary()


@pytest.mark.parametrize(
    "name",
    [
        "batch_size",
        "bs",
        "BATCH",
        "per_device_train_batch_size",
        "train_batch_size",
        "micro_batch_size",
        "eval_batch_size",
        "BATCH_SIZE",
        "bsz",
        "trainBatchSize",
        "num_images_per_prompt",
    ],
)
def test_batch_like_names(name):
    assert batch_like(name)


@pytest.mark.parametrize("name", ["num_batches", "batch_idx", "size", "steps", "abs", "lbs", "n", "num_samples"])
def test_names_that_are_not_batch_sizes(name):
    assert not batch_like(name)


# -- values from earlier cells -----------------------------------------------------------------------
def test_variable_from_an_earlier_cell_with_its_line():
    history = ["", "import torch", "lr = 1e-3\nbatch_size = 4096\n"]
    knob = chosen(
        "x = torch.randn(batch_size, 784)\nmodel(x)\n", {"batch_size": 4096, "torch": torch, "model": None}, history, 3
    )
    assert (knob.kind, knob.origin, knob.live) == (KnobKind.VARIABLE, "In[2] line 2", (Value(knob.live[0].path),))
    assert knob.describe() == "batch_size = 4096 (a variable, In[2] line 2)"


def test_functions_the_cell_calls_are_read_with_their_parameters_bound():
    history = [
        "",
        "bs = 128\ncfg = {'batch_size': 64}\n",
        "def step():\n    return model(torch.randn(bs, 10))\n",
        "def run(c):\n    return model(torch.randn(c['batch_size'], 10))\n",
    ]
    namespace = {"bs": 128, "cfg": {"batch_size": 64}, "model": None, "torch": torch}
    exec(history[2] + history[3], namespace)
    for function in ("step", "run"):
        namespace[function].__module__ = "__main__"  # as IPython defines them
    assert chosen("loss = step()\n", namespace, history, 4).label == "bs"
    knob = chosen("loss = run(cfg)\n", namespace, history, 4)
    assert (knob.label, knob.origin) == ('cfg["batch_size"]', "In[1] line 2")
    assert "read by run()" in knob.evidence


def test_loader_trainer_and_config_knobs_with_their_places():
    loader = DataLoader(TensorDataset(torch.zeros(64, 2)), batch_size=16, shuffle=True)
    history = ["", "bs = 16\nloader = DataLoader(ds, batch_size=bs, shuffle=True)\n"]
    knob = chosen("for (x,) in loader:\n    model(x)\n", {"loader": loader, "bs": 16, "model": None}, history, 2)
    assert knob.kind is KnobKind.DATALOADER and knob.live == (Loader(knob.live[0].path), Value(knob.live[1].path))
    assert [t.path.text for t in knob.live] == ["loader", "bs"]  # the variable it was built from moves with it

    @dataclasses.dataclass
    class TrainingArguments:
        per_device_train_batch_size: int = 8
        per_device_eval_batch_size: int = 8

    class Trainer:
        def __init__(self, args):
            self.args = args

        def train(self):
            pass

        def evaluate(self):
            pass

    trainer = Trainer(TrainingArguments(32, 64))
    assert chosen("trainer.train()\n", {"trainer": trainer}).live == (
        TrainerArgs(ObjectPath("trainer"), "per_device_train_batch_size"),
    )
    assert chosen("trainer.evaluate()\n", {"trainer": trainer}).value == 64
    args = argparse.Namespace(batch_size=48, epochs=2)
    assert (
        chosen("train_model(model, args)\n", {"args": args, "model": None, "train_model": print}).label
        == "args.batch_size"
    )


def test_a_custom_batch_sampler_is_reported_not_chosen():
    class Buckets(torch.utils.data.Sampler):
        def __iter__(self):
            yield [0, 1]

    loader = DataLoader(TensorDataset(torch.zeros(4, 2)), batch_sampler=Buckets())
    finding = find_batch("for (x,) in loader:\n    model(x)\n", {"loader": loader, "model": None})
    assert finding.chosen is None
    assert finding.notes == (
        "loader: it batches with a custom batch_sampler (Buckets): the batch size is that sampler's to change",
    )
    assert "custom batch_sampler" in finding.summary()


def test_train_batch_beats_evaluation_batch_in_a_training_cell_and_the_reverse():
    namespace = {"train_bs": 64, "eval_bs": 512, "model": None, "torch": torch}
    training = "x = torch.randn(train_bs, 8)\nmodel(x).sum().backward()\nv = torch.randn(eval_bs, 8)\n"
    assert chosen(training, namespace).label == "train_bs"
    evaluating = "with torch.no_grad():\n    v = model(torch.randn(eval_bs, 8))\n    t = torch.randn(train_bs, 8)\n"
    assert chosen(evaluating, namespace).label == "eval_bs"


def test_objects_whose_attributes_raise_are_passed_over():
    class Haunted:
        def __getattr__(self, name):
            raise RuntimeError("no attributes here")

        def __iter__(self):
            return iter(())

    namespace = {"thing": Haunted(), "bs": 32, "model": None, "torch": torch}
    knob = chosen("for x in thing:\n    model(torch.randn(bs, 4))\n", namespace)
    assert knob.label == "bs"
