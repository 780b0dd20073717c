"""When the batch is the data itself (inference or a metric over a whole tensor), a smaller batch is not a
fix: ``batch.whole`` detects it, ``oomfix.whole_data`` processes the data in chunks that cover all of it
or refuses in one line, and the driver never passes off a partial result as the cell's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jupyter_cudamem.cell.read import read_cell
from jupyter_cudamem.batch import find_batch
from jupyter_cudamem.batch.whole import covers_whole_data
from jupyter_cudamem.oomfix.driver import Driver
from jupyter_cudamem.oomfix.whole_data import CHUNK_LABEL, Join, chunked_source, join_of, whole_data_decision
from tests.fakes import FakeOutOfMemoryError, GiB, MiB
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
    assert decision is not None and decision.chunked is not None
    knob = decision.chunked.chosen
    assert knob is not None and knob.label == CHUNK_LABEL and knob.value == 32768
    rewritten = decision.chunked.source
    # Each chunk's result goes to the host as it comes, and the joined result back to the data's device.
    assert ("predictions = torch.cat([classifier(_chunk).detach().cpu() for _chunk in features.split(32768)])"
            ".to(features.device).argmax(dim=1)") in rewritten
    assert decision.on_host is not None and decision.on_host.chosen is not None
    assert ("predictions = torch.cat([classifier(_chunk).detach().cpu() for _chunk in features.split(32768)])"
            ".argmax(dim=1)") in decision.on_host.source
    # The written chunk size is where the knob says: the search's rewrite changes that number only.
    from jupyter_cudamem.batch import BatchChange

    for chunked_finding in (decision.chunked, decision.on_host):
        smaller = BatchChange(chunked_finding, chunked_finding.chosen, {}, []).source_for(1000)
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


@pytest.mark.parametrize(("data", "join"), [
    ("features", Join.THROUGH_HOST), ("batch.images", Join.THROUGH_HOST), ("images[:100]", Join.THROUGH_HOST),
    ("images[-100:, 0]", Join.THROUGH_HOST),
    # written twice (``.split`` and ``.device``), these would make the data twice or move it twice
    ("images[:n].cuda()", Join.ON_DEVICE), ("x + 1", Join.ON_DEVICE), ("torch.randn(4096, 8)", Join.ON_DEVICE),
    ("images[torch.arange(10)]", Join.ON_DEVICE),
])
def test_the_join_goes_through_the_host_where_the_data_can_be_named_twice(data, join):
    source = f"preds = classifier({data})\n"
    whole = covers_whole_data(find_batch("preds = classifier(x_all)\n", NAMESPACE), NAMESPACE)
    assert whole is not None and len(whole.calls) == 1
    call = whole.calls[0]
    from dataclasses import replace as replaced

    whole = replaced(whole, calls=(replaced(call, data=data, span=replaced(call.span, end_col=len(source) - 1)),))
    assert join_of(whole) is join and join_of(whole, keep_on_host=True) is Join.ON_HOST
    text, written = chunked_source(source, whole, 7, join)
    assert (f".to({data}.device)" in text) is (join is Join.THROUGH_HOST) and ".split(7)" in text
    assert all(text.splitlines()[w.span.line - 1][w.span.col:w.span.end_col] == "7" for w in written)


def test_refusals_are_one_line_that_says_why():
    for source in ("x = torch.randn(4096, 8)\nz = x @ x.T\n", "x = torch.randn(4096, 8)\nouts = [classifier(x) for _ in range(3)]\n"):
        decision = whole_data_decision(find_batch(source, NAMESPACE), NAMESPACE)
        assert decision is not None and decision.chunked is None
        assert "\n" not in decision.note and "does not shrink the batch" in decision.note and "fewer rows" in decision.note
    no_torch = {k: v for k, v in NAMESPACE.items() if k != "torch"}
    decision = whole_data_decision(find_batch("preds = classifier(x_all)\n", no_torch), no_torch)
    assert decision is not None and decision.chunked is None and "torch is not imported" in decision.note


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

    device = "cuda"

    def detach(self):
        return self

    def argmax(self, dim=1):
        return self

    def cpu(self):
        return _Rows(self.rows)

    def to(self, device):
        """Moving the joined result back to the GPU holds it there: it may not fit."""
        if _Rows.machine is not None:
            _Rows.machine.hold(len(self.rows) * _Rows.row_bytes)
        return _Rows(self.rows)

    machine = None  # the ``_JoinedRows`` the driver tests move results onto
    row_bytes = 0


class _JoinedRows:
    """The GPU memory a joined result takes for a moment (a result held between cells is not simulated)."""

    def __init__(self, cell):
        self.cell = cell

    def hold(self, size):
        machine = self.cell.machine
        try:
            machine.allocate(0, size)
        except FakeOutOfMemoryError:
            self.cell._raise(size)
        machine.free(0, size)


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


@pytest.fixture(autouse=True)
def _no_joined_rows():
    yield
    _Rows.machine, _Rows.row_bytes = None, 0


def _driver(strategies=("cleanup", "batch"), result_row_bytes=0):
    machine = capped_machine(4 * GiB, held_bytes=256 * MiB)
    cell = SimulatedCell(machine, lambda rows: 0.25 * MiB * rows)  # 32768 rows need 8 GiB
    _Rows.machine, _Rows.row_bytes = _JoinedRows(cell), result_row_bytes
    namespace = {"torch": _FakeTorch(), "classifier": _Classifier(cell)}
    run = cell.run_source(namespace)
    driver = Driver(run, fake_hardware(machine), lambda error: machine.empty_cache(), strategies=strategies)
    return namespace, run, driver


@pytest.mark.parametrize("result_mib_per_row", [0, 0.05])
def test_driver_fixes_inference_with_chunks_and_every_row_computed(result_mib_per_row):
    # Results of 0 or 1.6 GiB for 32768 rows: moved back to the GPU beside the 256 MiB held, under 4 GiB.
    namespace, run, driver = _driver(result_row_bytes=int(result_mib_per_row * MiB))
    error = run(INFERENCE_CELL)
    assert error is not None and "out of memory" in str(error)
    outcome = driver.fix(read_cell(INFERENCE_CELL), error, namespace, freed_bytes=0)
    assert outcome.fitted and outcome.strategy == "batch", repr(outcome)
    assert outcome.headline().startswith(f"%oomfix: fits in chunks of {outcome.batch_after} rows (all 32768 computed)")
    assert len(namespace["predictions"].rows) == len(namespace["features"].rows) == 32768
    assert "batch_size = 32768" in outcome.fixed_source and ".split(" in outcome.fixed_source
    assert ("torch.cat([classifier(_chunk).detach().cpu() for _chunk in features.split("
            in outcome.diff) and ".to(features.device)" in outcome.fixed_source
    assert any("the batch is the data" in note for note in outcome.notes)
    assert not any("stay on the host" in note for note in outcome.notes)
    assert all("batch_size = 32768" in t.source for t in outcome.tries)  # the data never shrank
    # Every batch try starts with cuBLAS's workspaces made anew, so none pins a fragment of an earlier run.
    assert driver.hardware.allocator.calls.count("renew_workspaces:0") == len(outcome.tries)


def test_a_joined_result_too_large_for_the_gpu_stays_on_the_host():
    # 32768 rows of 0.15 MiB results: 4.8 GiB, more than the 4 GiB cap holds whatever the chunk.
    namespace, run, driver = _driver(result_row_bytes=int(0.15 * MiB))
    error = run(INFERENCE_CELL)
    assert error is not None
    outcome = driver.fix(read_cell(INFERENCE_CELL), error, namespace, freed_bytes=0)
    assert outcome.fitted and outcome.strategy == "batch", [(t.batch, t.verdict, t.reason) for t in outcome.tries]
    first = outcome.tries[0]
    assert first.out_of_memory and first.failed_at is not None and not first.failed_at.in_module
    assert ".to(features.device)" in first.source
    # The chunks that fitted before the move back failed are what the search goes on from: the next try is
    # larger, with the result left on the host, and the cell's names hold every row.
    assert all(".to(" not in t.source and ".cpu()" in t.source for t in outcome.tries[1:])
    assert outcome.tries[1].batch > first.batch
    assert ".to(" not in outcome.fixed_source and ".cpu()" in outcome.fixed_source
    assert len(namespace["predictions"].rows) == 32768
    [note] = [n for n in outcome.notes if "stay on the host" in n]
    assert "all 32,768 rows" in note and "\n" not in note
    # The chunks' own failures are inside the model's forward pass: never mistaken for the move back.
    assert all(t.failed_at is None or t.failed_at.in_module for t in outcome.tries[1:] if t.out_of_memory)


def test_driver_refuses_rather_than_shrinking_a_metric_over_the_data():
    namespace, run, driver = _driver()
    namespace["score"] = lambda x: x
    source = "batch_size = 32768\nfeatures = torch.randn(batch_size, 2048)\nresult = classifier.forward(features)\n"
    error = run(source)
    assert error is not None
    outcome = driver.fix(read_cell(source), error, namespace, freed_bytes=0)
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


def test_where_an_error_arose_in_a_cell_run_by_the_shell(ip):
    # The move back (a tensor method on the cell's own line) against the chunks' work (inside a module's
    # forward pass, even from a comprehension's frame on Python 3.11): the traceback of a real shell's run.
    from jupyter_cudamem.oomfix.tries import failure_site

    class Failing(nn.Module):
        def forward(self, x):
            raise RuntimeError("CUDA out of memory (inside the forward pass)")

    ip.user_ns.update(torch=torch, failing=Failing())
    try:
        inside = ip.run_cell("x = torch.zeros(4, 2)\ny = torch.cat([failing(c) for c in x.split(2)])\n",
                             store_history=False, silent=True).error_in_exec
        site = failure_site(inside)
        assert site is not None and site.line == 2 and site.in_module
        outside = ip.run_cell("x = torch.zeros(4, 2)\n\ny = torch.cat([c for c in x.split(2)]).view(-1, 3)\n",
                              store_history=False, silent=True).error_in_exec
        site = failure_site(outside)
        assert site is not None and site.line == 3 and not site.in_module
        assert failure_site(RuntimeError("never raised")) is None
    finally:
        ip.user_ns.pop("failing", None)
