"""Batch-size discovery and rewriting across realistic cell shapes (jupyter_cudamem/oomfix/rewrite.py)."""

from __future__ import annotations

import ast

import pytest
from IPython.core.inputtransformer2 import TransformerManager

from jupyter_cudamem.oomfix.rewrite import (
    batch_like,
    find_batch,
    rewrite_batch,
    unified_diff,
    wrap_in_autocast,
)

TRAINING_LOOP = '''import torch
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
'''

DATALOADER = '''train_loader = torch.utils.data.DataLoader(train_set, batch_size=256, shuffle=True, num_workers=4)
for images, labels in train_loader:
    images, labels = images.cuda(), labels.cuda()
    loss = criterion(model(images), labels)
    loss.backward()
'''

HF_TRAINER = '''args = TrainingArguments(
    output_dir="out",
    per_device_train_batch_size=64,
    per_device_eval_batch_size=128,
    learning_rate=5e-5,
)
trainer = Trainer(model=model, args=args, train_dataset=ds)
trainer.train()
'''

NESTED = '''def make_loader(dataset, bs=128):
    return DataLoader(dataset, bs)

def train(model, epochs=3):
    def step(xb):
        return model(xb).sum().backward()
    for _ in range(epochs):
        for xb in make_loader(ds):
            step(xb)

train(model)
'''

TENSOR_LITERALS = '''x = torch.randn(512, 3, 224, 224, device="cuda")
labels = torch.randint(0, 1000, (512,), device="cuda")
weights = torch.randn(256, 256, device="cuda")
out = model(x)
'''

NAME_FROM_SHAPE = '''B, T, C = 32, 1024, 768
x = torch.zeros(B, T, C, device="cuda")
y = model(x)
'''

IPYTHON_SYNTAX = '''%%time
!nvidia-smi --query-gpu=memory.used --format=csv
%load_ext jupyter_cudamem
BATCH = 1024
files = !ls data
data = torch.randn(BATCH, 784, device="cuda")
model(data).sum().backward()
'''

NO_BATCH = '''a = torch.randn(8192, 8192, device="cuda")
outs = [a @ a for _ in range(16)]
total = sum(o.sum() for o in outs)
'''

CONFIG_DICT = '''config = {"lr": 3e-4, "batch_size": 96, "epochs": 10}
loader = DataLoader(ds, batch_size=config["batch_size"])
'''

MICRO_BATCH = '''micro_batch_size = 8
global_batch = 256
grad_accum = global_batch // micro_batch_size
for chunk in data.split(micro_batch_size):
    model(chunk).mean().backward()
'''

UNICODE = '''titre = "données d'entraînement"; bs = 48  # é à ü
loader = DataLoader(ds, batch_size=bs)
'''

EVAL_AND_TRAIN = '''eval_batch_size = 1024
train_batch_size = 64
'''


def change(source: str, new_value: int, namespace=None) -> tuple[str, str]:
    discovery = find_batch(source, namespace)
    assert discovery.chosen is not None, discovery.summary()
    return discovery.chosen.name, rewrite_batch(discovery, new_value)


def changed_lines(before: str, after: str) -> list[tuple[str, str]]:
    old, new = before.splitlines(), after.splitlines()
    assert len(old) == len(new)
    return [(a, b) for a, b in zip(old, new) if a != b]


def test_plain_training_loop_changes_only_the_assignment():
    name, after = change(TRAINING_LOOP, 200)
    assert name == "batch_size"
    assert changed_lines(TRAINING_LOOP, after) == [
        ("batch_size = 512  # what fitted on the A100", "batch_size = 200  # what fitted on the A100")
    ]


def test_dataloader_keyword():
    discovery = find_batch(DATALOADER)
    assert (discovery.chosen.kind, discovery.chosen.value) == ("keyword", 256)
    after = rewrite_batch(discovery, 100)
    assert changed_lines(DATALOADER, after) == [
        (DATALOADER.splitlines()[0], DATALOADER.splitlines()[0].replace("batch_size=256", "batch_size=100"))
    ]


def test_hf_training_arguments_prefers_the_training_batch_and_reports_eval():
    discovery = find_batch(HF_TRAINER)
    assert discovery.chosen.name == "per_device_train_batch_size"
    assert [c.name for c in discovery.others] == ["per_device_eval_batch_size"]
    assert "also seen: per_device_eval_batch_size=128" in discovery.summary()
    after = rewrite_batch(discovery, 16)
    assert "per_device_train_batch_size=16," in after and "per_device_eval_batch_size=128," in after


def test_nested_function_default():
    discovery = find_batch(NESTED)
    assert (discovery.chosen.name, discovery.chosen.kind, discovery.chosen.line) == ("bs", "default", 1)
    after = rewrite_batch(discovery, 40)
    assert after.splitlines()[0] == "def make_loader(dataset, bs=40):"
    assert after.splitlines()[1:] == NESTED.splitlines()[1:]


def test_literal_leading_dimensions_move_together_and_square_matrices_stay():
    discovery = find_batch(TENSOR_LITERALS)
    chosen = discovery.chosen
    assert (chosen.kind, chosen.value, len(chosen.sites)) == ("tensor", 512, 2)
    after = rewrite_batch(discovery, 96)
    assert 'torch.randn(96, 3, 224, 224, device="cuda")' in after
    assert "torch.randint(0, 1000, (96,)" in after
    assert 'torch.randn(256, 256, device="cuda")' in after


def test_a_short_name_counts_when_it_is_a_leading_dimension():
    discovery = find_batch(NAME_FROM_SHAPE)
    assert (discovery.chosen.name, discovery.chosen.value) == ("B", 32)
    assert "leading dimension of a tensor" in discovery.chosen.evidence
    assert rewrite_batch(discovery, 8).splitlines()[0] == "B, T, C = 8, 1024, 768"


def test_ipython_syntax_survives_and_is_not_mistaken_for_code():
    discovery = find_batch(IPYTHON_SYNTAX)
    assert (discovery.chosen.name, discovery.chosen.line) == ("BATCH", 4)
    after = rewrite_batch(discovery, 300)
    assert changed_lines(IPYTHON_SYNTAX, after) == [("BATCH = 1024", "BATCH = 300")]
    # What IPython would run still parses.
    ast.parse(TransformerManager().transform_cell(after.split("\n", 1)[1]))


def test_no_batch_is_one_line():
    discovery = find_batch(NO_BATCH)
    assert discovery.chosen is None
    assert "\n" not in discovery.summary() and "no batch size" in discovery.summary()
    with pytest.raises(ValueError, match="nothing to rewrite"):
        rewrite_batch(discovery, 10)


def test_unparseable_cell_is_one_line_not_an_exception():
    discovery = find_batch("for x in :\n    pass\n")
    assert discovery.chosen is None
    assert "does not parse" in discovery.summary() and "line 1" in discovery.summary()


def test_config_dict_value():
    discovery = find_batch(CONFIG_DICT)
    assert (discovery.chosen.kind, discovery.chosen.value) == ("dict", 96)
    assert '"batch_size": 48,' in rewrite_batch(discovery, 48)


def test_micro_batch_with_evidence_of_use():
    discovery = find_batch(MICRO_BATCH)
    assert discovery.chosen.name == "micro_batch_size"
    after = rewrite_batch(discovery, 2)
    assert changed_lines(MICRO_BATCH, after) == [("micro_batch_size = 8", "micro_batch_size = 2")]


def test_positions_are_characters_not_utf8_bytes():
    name, after = change(UNICODE, 12)
    assert name == "bs"
    assert after.splitlines()[0] == '''titre = "données d'entraînement"; bs = 12  # é à ü'''


def test_training_batch_beats_evaluation_batch():
    assert find_batch(EVAL_AND_TRAIN).chosen.name == "train_batch_size"


def test_name_set_in_an_earlier_cell_gets_a_new_first_line_after_the_magic_header():
    source = "%%time\nx = torch.randn(batch_size, 784, device='cuda')\n"
    discovery = find_batch(source, namespace={"batch_size": 4096, "unrelated": 7})
    assert (discovery.chosen.kind, discovery.chosen.value) == ("namespace", 4096)
    after = rewrite_batch(discovery, 1000)
    assert after.splitlines() == [
        "%%time",
        "batch_size = 1000  # set by %oomfix, was 4096",
        "x = torch.randn(batch_size, 784, device='cuda')",
    ]
    assert find_batch(source).chosen is None  # without the namespace nothing is known


def test_literal_equal_to_the_batch_variable_moves_with_it():
    source = "batch_size = 64\nloader = DataLoader(ds, batch_size=batch_size)\nh0 = torch.zeros(64, 128)\n"
    discovery = find_batch(source)
    assert discovery.chosen.name == "batch_size"
    after = rewrite_batch(discovery, 16)
    assert after == "batch_size = 16\nloader = DataLoader(ds, batch_size=batch_size)\nh0 = torch.zeros(16, 128)\n"


def test_crlf_line_endings_are_kept():
    source = "bs = 64\r\nx = torch.randn(bs, 10)\r\n"
    assert rewrite_batch(find_batch(source), 8) == "bs = 8\r\nx = torch.randn(bs, 10)\r\n"


@pytest.mark.parametrize("name", ["batch_size", "bs", "BATCH", "per_device_train_batch_size", "train_batch_size",
                                  "micro_batch_size", "eval_batch_size", "BATCH_SIZE", "bsz", "batchSize".lower()])
def test_batch_like_names(name):
    assert batch_like(name)


@pytest.mark.parametrize("name", ["num_batches", "batch_idx", "size", "steps", "abs", "lbs", "n"])
def test_names_that_are_not_batch_sizes(name):
    assert not batch_like(name)


def test_diff_shows_the_one_change():
    _, after = change(TRAINING_LOOP, 200)
    diff = unified_diff(TRAINING_LOOP, after)
    assert "-batch_size = 512  # what fitted on the A100\n" in diff
    assert "+batch_size = 200  # what fitted on the A100\n" in diff
    assert sum(1 for line in diff.splitlines() if line.startswith(("+", "-")) and line[:3] not in ("+++", "---")) == 2


def test_autocast_wraps_the_body_and_keeps_ipython_syntax_and_strings():
    source = '%%time\ndoc = """first\nsecond"""\n!echo hi\nfor i in range(2):\n    y = model(x)\n'
    wrapped = wrap_in_autocast(source, "float16")
    assert wrapped == (
        '%%time\nimport torch\nwith torch.autocast("cuda", dtype=torch.float16):\n'
        '    doc = """first\nsecond"""\n    !echo hi\n    for i in range(2):\n        y = model(x)\n'
    )
    body = wrapped.split("\n", 1)[1]
    python = TransformerManager().transform_cell(body)
    ast.parse(python)
    namespace: dict = {}
    runnable = python.replace("import torch\n", "").replace("get_ipython().system('echo hi')", "pass")
    namespace["torch"] = _FakeTorch(namespace)
    exec(compile(runnable.replace("model(x)", "1"), "<cell>", "exec"), namespace)
    assert namespace["autocast"] == ("cuda", "float16")
    assert namespace["doc"] == "first\nsecond"  # the string's second line was not indented


def test_autocast_of_broken_cell_raises_syntax_error_and_rejects_bad_dtype():
    with pytest.raises(SyntaxError):
        wrap_in_autocast("for x in :\n")
    with pytest.raises(ValueError):
        wrap_in_autocast("x = 1\n", "float8")


def test_autocast_without_import_and_of_an_empty_body():
    assert wrap_in_autocast("", import_torch=False) == 'with torch.autocast("cuda", dtype=torch.bfloat16):\n    pass\n'


class _FakeTorch:
    """Just enough of ``torch`` to execute a wrapped cell without CUDA."""

    float16 = "float16"

    def __init__(self, record: dict):
        self.record = record

    def autocast(self, device: str, dtype: str):
        record = self.record

        class _Context:
            def __enter__(self):
                record["autocast"] = (device, dtype)

            def __exit__(self, *exc):
                return False

        return _Context()
