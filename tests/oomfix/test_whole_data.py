"""When the batch is the data itself (inference or a metric over a whole tensor), a smaller batch is not a
fix: ``batch.whole`` detects it, ``oomfix.whole_data`` processes the data in chunks that cover all of it
or refuses in one line, and the driver never passes off a partial result as the cell's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jupyter_cudamem.batch import find_batch
from jupyter_cudamem.batch.whole import covers_whole_data
from jupyter_cudamem.oomfix.driver import Driver
from jupyter_cudamem.oomfix.whole_data import CHUNK_LABEL, chunked_source, whole_data_decision
from tests.fakes import GiB, MiB
from tests.oomfix.simulated import SimulatedCell, capped_machine, fake_hardware

NAMESPACE = {
    "torch": torch,
    "nn": nn,
    "classifier": nn.Linear(8, 2),
    "encoder": nn.Linear(8, 8),
    "images": torch.zeros(100, 8),
    "x_all": torch.zeros(50, 8),
    "optimizer": object(),
}

WHOLE = {
    # the tutorial's cell: synthetic data sized by the batch, predictions kept
    'batch_size = 32768\nfeatures = torch.randn(batch_size, 8, device="cuda")\npredictions = classifier(features).argmax(dim=1)\n':
        ("predictions", 32768),
    "preds = classifier(images[:100])\n": ("preds", 100),
    "n = 100\nsub = images[:n].cuda()\npreds = classifier(sub)\n": ("preds", 100),
    "preds = classifier(x_all)\n": ("preds", 50),
    "x = torch.randn(4096, 8)\nwith torch.no_grad():\n    y = classifier(x)\n": ("y", 4096),
    "x = torch.randn(4096, 8)\nclassifier(x)\n": ("Out", 4096),
    "x = torch.randn(4096, 8)\nz = x @ x.T\n": ("z", 4096),  # a metric over a whole tensor: no model to chunk
    "x = torch.randn(4096, 8)\nouts = [classifier(x) for _ in range(3)]\n": ("outs", 4096),
}
NOT_WHOLE = [
    # training: a smaller batch is another step of the same training
    "batch_size = 1024\nfor step in range(3):\n    images = torch.randn(batch_size, 8)\n    loss = classifier(images).sum()\n"
    "    loss.backward()\n",
    "x = torch.randn(512, 8)\nloss = classifier(x).sum()\nloss.backward()\noptimizer.step()\noptimizer.zero_grad()\n",
    # the batch is a step over all of the data already: smaller chunks keep every row
    "bs = 256\nouts = []\nfor i in range(0, len(images), bs):\n    outs.append(classifier(images[i:i + bs]))\n",
    "outs = [classifier(part) for part in images.split(25)]\n",
    # nothing computed from the data is kept
    "x = torch.randn(4096, 8)\nprint(x.sum())\n",
    "x = torch.randn(4096, 8)\nclassifier(x)\nprint('done')\n",
    # each pass of a loop makes its own batch (a benchmark)
    "for _ in range(10):\n    x = torch.randn(4096, 8)\n    y = classifier(x)\n",
]


@pytest.mark.parametrize("source", list(WHOLE))
def test_the_batch_is_the_data(source):
    result, rows = WHOLE[source]
    finding = find_batch(source, NAMESPACE)
    whole = finding.whole_data
    assert finding.covers_whole_data and whole is not None, finding.summary()
    assert result in whole.results and whole.rows == rows
    assert "does not train" in whole.reason and result in whole.reason


@pytest.mark.parametrize("source", NOT_WHOLE)
def test_a_smaller_batch_is_a_fix(source):
    finding = find_batch(source, NAMESPACE)
    assert not finding.covers_whole_data, finding.whole_data


def test_chunks_cover_every_row_and_the_knob_is_the_chunk():
    source = next(iter(WHOLE))
    decision = whole_data_decision(find_batch(source, NAMESPACE), NAMESPACE)
    assert decision is not None and not decision.refused and decision.chunked is not None
    knob = decision.chunked.chosen
    assert knob is not None and knob.label == CHUNK_LABEL and knob.value == 32768
    rewritten = decision.chunked.source
    assert "predictions = torch.cat([classifier(_chunk).detach() for _chunk in features.split(32768)]).argmax(dim=1)" in rewritten
    # The written chunk size is where the knob says: the search's rewrite changes that number only.
    from jupyter_cudamem.batch import BatchChange

    smaller = BatchChange(decision.chunked, knob, {}, []).source_for(1000)
    assert "features.split(1000)" in smaller and "batch_size = 32768" in smaller
    # Run on the CPU: the chunked cell computes every row, and the same rows as the original.
    namespace = dict(NAMESPACE)
    torch.manual_seed(0)
    exec(smaller.replace('device="cuda"', 'device="cpu"').replace("32768", "3000"), namespace)
    chunked = namespace["predictions"]
    torch.manual_seed(0)
    exec(source.replace('device="cuda"', 'device="cpu"').replace("32768", "3000"), namespace)
    assert chunked.shape[0] == namespace["features"].shape[0] == 3000
    assert torch.equal(chunked, namespace["predictions"])


def test_refusals_are_one_line_that_says_why():
    for source in ("x = torch.randn(4096, 8)\nz = x @ x.T\n", "x = torch.randn(4096, 8)\nouts = [classifier(x) for _ in range(3)]\n"):
        decision = whole_data_decision(find_batch(source, NAMESPACE), NAMESPACE)
        assert decision is not None and decision.refused
        assert "\n" not in decision.note and "does not shrink the batch" in decision.note and "fewer rows" in decision.note
    no_torch = {k: v for k, v in NAMESPACE.items() if k != "torch"}
    decision = whole_data_decision(find_batch("preds = classifier(x_all)\n", no_torch), no_torch)
    assert decision is not None and decision.refused and "torch is not imported" in decision.note


def test_several_calls_on_one_line_are_all_chunked():
    source = "x = torch.randn(4096, 8)\nboth = classifier(x) + classifier(x + 1)\n"
    whole = covers_whole_data(find_batch(source, NAMESPACE), NAMESPACE)
    assert whole is not None and len(whole.calls) == 2
    text, written = chunked_source(source, whole, 4096)
    assert text.count(".split(4096)") == 2 and "(x + 1).split(4096)" in text
    lines = text.splitlines()
    assert all(lines[w.span.line - 1][w.span.col:w.span.end_col] == "4096" for w in written)


def test_an_output_object_is_joined_by_the_tensor_the_cell_takes_from_it():
    # transformers' models return a ModelOutput: chunks join its .logits, not the object (seen on an H100:
    # "'CausalLMOutputWithCrossAttentions' object has no attribute 'detach'"); a method call stays outside.
    source = "x = torch.randn(4096, 8)\nlast = classifier(x).logits[:, -1].argmax(dim=-1)\nfirst = classifier(x)[0]\n"
    whole = covers_whole_data(find_batch(source, NAMESPACE), NAMESPACE)
    assert whole is not None and len(whole.calls) == 2
    text, written = chunked_source(source, whole, 512)
    assert "torch.cat([classifier(_chunk).logits.detach() for _chunk in x.split(512)])[:, -1].argmax(dim=-1)" in text
    assert "torch.cat([classifier(_chunk)[0].detach() for _chunk in x.split(512)])\n" in text
    lines = text.splitlines()
    assert all(lines[w.span.line - 1][w.span.col:w.span.end_col] == "512" for w in written)


# -- the driver over a simulated inference cell ---------------------------------------------------
class _Rows:
    """A tensor of rows as far as the cell and the chunk rewrite use it."""

    def __init__(self, rows):
        self.rows = list(rows)

    @property
    def shape(self):
        return (len(self.rows),)

    def split(self, size):
        return [_Rows(self.rows[i:i + size]) for i in range(0, len(self.rows), size)]

    def detach(self):
        return self

    def argmax(self, dim=1):
        return self


class _FakeTorch:
    def __init__(self):
        self.autocast = None

    @staticmethod
    def randn(rows, *shape, device=None):
        return _Rows(range(rows))

    @staticmethod
    def cat(parts):
        return _Rows(row for part in parts for row in part.rows)


class _Classifier:
    """A model whose forward pass needs memory in proportion to the rows it is given."""

    def __init__(self, cell):
        self.cell = cell

    def modules(self):
        return [self]

    def forward(self, x):
        self.cell.train_step(len(x.rows))
        return _Rows(x.rows)

    __call__ = forward


INFERENCE_CELL = """batch_size = 32768
features = torch.randn(batch_size, 2048, device="cuda")
predictions = classifier(features).argmax(dim=1)
"""


def _driver(strategies=("cleanup", "batch")):
    machine = capped_machine(4 * GiB, held_bytes=256 * MiB)
    cell = SimulatedCell(machine, lambda rows: 0.25 * MiB * rows)  # 32768 rows need 8 GiB
    namespace = {"torch": _FakeTorch(), "classifier": _Classifier(cell)}
    run = cell.run_source(namespace)
    driver = Driver(run, fake_hardware(machine), lambda error: machine.empty_cache(), strategies=strategies)
    return namespace, run, driver


def test_driver_fixes_inference_with_chunks_and_every_row_computed():
    namespace, run, driver = _driver()
    error = run(INFERENCE_CELL)
    assert error is not None and "out of memory" in str(error)
    outcome = driver.fix(INFERENCE_CELL, error, namespace, freed_bytes=0)
    assert outcome.fitted and outcome.strategy == "batch", repr(outcome)
    assert outcome.headline().startswith(f"%oomfix: fits in chunks of {outcome.batch_after} rows (all 32768 computed)")
    assert len(namespace["predictions"].rows) == len(namespace["features"].rows) == 32768
    assert "batch_size = 32768" in outcome.fixed_source and ".split(" in outcome.fixed_source
    assert "torch.cat([classifier(_chunk).detach() for _chunk in features.split(" in outcome.diff
    assert any("the batch is the data" in note for note in outcome.notes)
    assert all("batch_size = 32768" in t.source for t in outcome.tries)  # the data never shrank


def test_driver_refuses_rather_than_shrinking_a_metric_over_the_data():
    namespace, run, driver = _driver()
    namespace["score"] = lambda x: x
    source = "batch_size = 32768\nfeatures = torch.randn(batch_size, 2048)\nresult = classifier.forward(features)\n"
    error = run(source)
    assert error is not None
    outcome = driver.fix(source, error, namespace, freed_bytes=0)
    assert not outcome.fitted and "predictions" not in namespace and "result" not in namespace
    assert not any(t.strategy == "batch" for t in outcome.tries)
    [note] = [n for n in outcome.notes if "does not shrink the batch" in n]
    assert "fewer rows" in note


def test_dry_run_plan_chunks_or_refuses():
    from jupyter_cudamem.oomfix.plan import plan_batch

    source = next(iter(WHOLE))
    plan = plan_batch(find_batch(source, NAMESPACE), NAMESPACE, None, 4 * GiB, ("cleanup", "batch"))
    assert plan.knob is not None and plan.knob.label == CHUNK_LABEL and plan.first_batch is not None
    [diff] = plan.diffs
    assert diff.before == source and f"features.split({plan.first_batch})" in diff.after
    assert any("the batch is the data" in note for note in plan.notes)
    refused = plan_batch(find_batch("x = torch.randn(4096, 8)\nz = x @ x.T\n", NAMESPACE), NAMESPACE, None, 4 * GiB,
                         ("cleanup", "batch"))
    assert refused.first_batch is None and any("does not shrink the batch" in note for note in refused.notes)
