"""Where a value was written, traced through IPython's input history (jupyter_cudamem/batch/provenance.py)."""

from __future__ import annotations

import argparse
import dataclasses

from jupyter_cudamem.batch.knobs import ObjectPath, Step
from jupyter_cudamem.batch.provenance import History


def trace(cells, path, value, namespace=None):
    history = History([""] + cells, None, namespace or {})
    return history.trace(path, value)


def spot(cells, written):
    """The text a Written points at, as "In[k]:text"."""
    line = cells[written.cell - 1].splitlines()[written.span.line - 1]
    return f"In[{written.cell}]:{line[written.span.col : written.span.end_col]}"


def key(*names):
    return tuple(Step(n, key=True) for n in names)


def test_the_latest_binding_wins_and_updates_count():
    cells = ["config = {'lr': 1e-3, 'batch_size': 64}", "x = 1", "config['batch_size'] = 512"]
    result = trace(cells, ObjectPath("config", key("batch_size")), 512)
    assert result.origin == "In[3] line 1" and [spot(cells, w) for w in result.written] == ["In[3]:512"]
    cells = ["cfg = dict(batch_size=8)", "cfg.update(batch_size=24)"]
    assert [spot(cells, w) for w in trace(cells, ObjectPath("cfg", key("batch_size")), 24).written] == ["In[2]:24"]


def test_names_on_the_way_are_followed_and_recorded():
    cells = ["BATCH = 64", "loader = DataLoader(ds, batch_size=BATCH)"]
    result = trace(cells, ObjectPath("loader", (Step("batch_size"),)), 64, {"BATCH": 64})
    assert [spot(cells, w) for w in result.written] == ["In[1]:64"] and result.via == (ObjectPath("BATCH"),)


def test_computed_and_stale_values_say_so_without_an_edit():
    assert trace(["bs = 32", "bs *= 2"], ObjectPath("bs"), 64).origin == "In[2] line 1 (computed: bs *= 2)"
    assert trace(["bs = len(data) // 10"], ObjectPath("bs"), 64).written == ()
    stale = trace(["bs = 32"], ObjectPath("bs"), 64)
    assert stale.written == () and "wrote 32; it is 64 now" in stale.origin
    arithmetic = trace(["bs = 2 ** 8"], ObjectPath("bs"), 256)
    assert [spot(["bs = 2 ** 8"], w) for w in arithmetic.written] == ["In[1]:2 ** 8"]


def test_argparse_lists_split_strings_equals_and_defaults():
    parser = argparse.ArgumentParser()
    parser.add_argument("-b", "--batch-size", type=int, default=128)
    namespace = {"parser": parser}
    path = ObjectPath("args", (Step("batch_size"),))
    head = "parser.add_argument('-b', '--batch-size', type=int, default=128)\n"
    for call, text in [
        ("parser.parse_args(['--batch-size', '256'])", "256"),
        ("parser.parse_args('-b 256 --lr 1'.split())", "256"),
        ("parser.parse_args(['--batch-size=256'])", "256"),
    ]:
        cells = [head + f"args = {call}"]
        result = trace(cells, path, 256, namespace)
        assert [spot(cells, w) for w in result.written] == [f"In[1]:{text}"], call
    cells = [head + "args = parser.parse_args([])"]
    assert [spot(cells, w) for w in trace(cells, path, 128, namespace).written] == ["In[1]:128"]


def test_text_configs_dataclass_defaults_and_class_attributes():
    yaml = ['cfg = OmegaConf.create("""\ntrain:\n  batch_size: 128\n""")']
    assert [
        spot(yaml, w) for w in trace(yaml, ObjectPath("cfg", (Step("train"), Step("batch_size"))), 128).written
    ] == ["In[1]:128"]
    json_text = ["cfg = json.loads('{\"batch_size\": 96}')"]
    assert [spot(json_text, w) for w in trace(json_text, ObjectPath("cfg", key("batch_size")), 96).written] == [
        "In[1]:96"
    ]

    @dataclasses.dataclass
    class Config:
        lr: float = 1e-3
        batch_size: int = 32

    cells = ["@dataclass\nclass Config:\n    lr: float = 1e-3\n    batch_size: int = 32", "cfg = Config(lr=0.1)"]
    assert [
        spot(cells, w) for w in trace(cells, ObjectPath("cfg", (Step("batch_size"),)), 32, {"Config": Config}).written
    ] == ["In[1]:32"]
    cells = ["@dataclass\nclass Config:\n    lr: float = 1e-3\n    batch_size: int = 32", "cfg = Config(0.1, 48)"]
    assert [
        spot(cells, w) for w in trace(cells, ObjectPath("cfg", (Step("batch_size"),)), 48, {"Config": Config}).written
    ] == ["In[2]:48"]
    cells = ["class CFG:\n    epochs = 3\n    batch_size = 16"]
    assert [spot(cells, w) for w in trace(cells, ObjectPath("CFG", (Step("batch_size"),)), 16).written] == ["In[1]:16"]


def test_a_library_default_gets_a_keyword_inserted_into_the_call():
    def TrainingArguments(output_dir, per_device_train_batch_size=8, eval_strategy="no"):
        pass

    cells = ['args = TrainingArguments("out",\n                         eval_strategy="epoch")']
    result = trace(
        cells, ObjectPath("args", (Step("per_device_train_batch_size"),)), 8, {"TrainingArguments": TrainingArguments}
    )
    (written,) = result.written
    assert (
        written.insert == ", per_device_train_batch_size={}"
        and written.span.line == 2
        and written.text_for(4) == ", per_device_train_batch_size=4"
    )
    assert "the default of TrainingArguments" in result.origin


def test_through_a_notebook_function_that_returns_the_loaders():
    source = (
        "def make_loaders(ds, bs=32):\n    train = DataLoader(ds, batch_size=bs, shuffle=True)\n"
        "    valid = DataLoader(ds, batch_size=bs * 2)\n    return train, valid"
    )
    namespace: dict = {"DataLoader": None}
    exec(source, namespace)
    namespace["make_loaders"].__module__ = "__main__"
    path = ObjectPath("train_loader", (Step("batch_size"),))
    cells = [source, "train_loader, valid_loader = make_loaders(ds, bs=64)"]
    assert [spot(cells, w) for w in trace(cells, path, 64, namespace).written] == ["In[2]:64"]
    cells = [source, "train_loader, valid_loader = make_loaders(ds)"]
    assert [spot(cells, w) for w in trace(cells, path, 32, namespace).written] == ["In[1]:32"]


def test_cells_after_the_failed_one_and_unparseable_cells_are_ignored():
    history = History(["", "for x in :", "bs = 8", "bs = 99"], 3, {})
    assert history.trace(ObjectPath("bs"), 8).origin == "In[2] line 1"
    assert history.trace(ObjectPath("missing"), 8) is None
