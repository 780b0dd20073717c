"""A failed try of ``%oomfix`` leaves nothing: the first try starts at the level the failed cell started at,
and each later one with at most what the last fitted try left, grown to its batch.

In a real kernel, PyTorch capped with ``set_per_process_memory_fraction`` to emulate a small card: a
setup cell builds the model and warms it up (so cuBLAS/cuDNN workspaces are already allocated), a
cell records ``torch.cuda.memory_allocated()``, the next cell binds a batch-sized input and fails with
a CUDA OOM, and ``%oomfix --yes -o`` fixes it. The first try's ``allocated_at_start_bytes`` must be within
2 MiB of the recorded level (the failed cell's own input set aside, no failed try's graph or frames
alive); a later try holds what the last fitted try left (its bound values, grown to the try's batch,
gradients, optimizer state: the next run of the cell holds them too, so the tries are judged as it will
run) and nothing of a failed one. For a GRU whose tries fail in forward, an MLP whose tries fail in
backward, a training loop that binds its logits, and a cell that builds its own model and Adam.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_oomfix_tries_gpu.py -v`` (about 2 minutes: four
kernels, each a few small reruns).
"""

from __future__ import annotations

from tests.notebook_runner import REPO, gpu_notebook_module, json_line, run_cells, text_of

torch, pytestmark = gpu_notebook_module()


TOLERANCE = 2 * 2**20

SETUP = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
import json
import torch
from torch import nn
%load_ext jupyter_cudamem
torch.cuda.set_per_process_memory_fraction(2 * 2**30 / torch.cuda.get_device_properties(0).total_memory)
"""

GRU = """gru = nn.GRU(64, 256, num_layers=2, batch_first=True).cuda()
out, hidden = gru(torch.randn(4, 256, 64, device="cuda"))
out.square().mean().backward()
del out, hidden
gru.zero_grad(set_to_none=True)
"""

# The forward is cheap; the backward of ``Heavy`` allocates 256 KiB per sample: tries fail in backward.
MLP = """class Heavy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        scratch = torch.ones(grad.shape[0], 65536, device=grad.device)
        return grad * 2 + scratch[:, : grad.shape[1]] * 0

mlp = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024)).cuda()
Heavy.apply(mlp(torch.randn(4, 1024, device="cuda"))).sum().backward()
mlp.zero_grad(set_to_none=True)
"""

# ``stages`` is a queue the failing cell puts to: no rerun puts a queue back (plain lists are put back before
# each rerun, ``reruns/plain_state.py``), so it keeps the stages of every run, reruns included.
LEVEL = "import queue\nstages = queue.SimpleQueue()\nstart_level = torch.cuda.memory_allocated()\n"

REPORT = """print("RESULT " + json.dumps({
    "start": start_level,
    "tries": [[t.batch, t.fitted, t.allocated_at_start_bytes, t.left_bytes] for t in outcome.tries],
    "fitted": outcome.fitted,
    "stages": [stages.get() for _ in range(stages.qsize())],
}))
"""


def tries_of(model: str, failing: str) -> tuple[str, dict]:
    cells = [SETUP, model, LEVEL, failing, "outcome = %oomfix --yes --verbose -o", REPORT]
    notebook = run_cells(cells, timeout=600, allow_errors_in={3})
    outputs = notebook.cells
    assert "OutOfMemoryError" in text_of(outputs[3]), text_of(outputs[3])
    report = text_of(outputs[4])
    return report, json_line(outputs[5])


def runs(stages: list[str]) -> list[str]:
    """Where each run (the failed cell, then every try) ended: the last stage it reached."""
    ended, current = [], None
    for stage in stages:
        if stage == "start" and current is not None:
            ended.append(current)
        current = stage
    return ended + ([current] if current is not None else [])


def check(report: str, result: dict, stage: str | None) -> None:
    """The first try started at the failed cell's level; a later one with at most what the last fitted try
    left bound, grown by the ratio of the batches where it is larger (``FixTries._grown``: the cell's next
    run at that batch holds its last run's values at that batch); a failed try left nothing."""
    ended = runs(result["stages"])
    if stage is not None:
        assert ended[0] == stage, (ended, report)  # the failed cell failed where this test says
    assert len(ended) == 1 + len(result["tries"]) and result["fitted"], (ended, report)
    level = result["start"]
    held, held_batch = 0, 1  # what the last fitted try left above the level, and its batch
    for number, ((batch, fitted, at_start, left), where) in enumerate(zip(result["tries"], ended[1:])):
        allowed = held * max(batch / held_batch, 1.0)
        assert level - TOLERANCE <= at_start <= level + allowed + TOLERANCE, (
            number, batch, where, at_start, level, held, held_batch, result["tries"], report)
        if not fitted:
            # Nothing more than it started with (less is fine: a failed try's ``opt.zero_grad()`` freed gradients).
            assert left is not None and left <= TOLERANCE, (batch, where, left, report)
        else:
            held, held_batch = at_start + left - level, batch


def test_tries_failing_in_forward_start_where_the_failed_cell_started():
    failing = """batch_size = 8192
stages.put("start")
x = torch.randn(batch_size, 256, 64, device="cuda")
stages.put("forward")
out, hidden = gru(x)
stages.put("backward")
out.square().mean().backward()
gru.zero_grad(set_to_none=True)
stages.put("done")
"""
    report, result = tries_of(GRU, failing)
    check(report, result, "forward")
    assert "set aside on the host" in report and "x" in report, report


def test_tries_failing_in_backward_start_where_the_failed_cell_started():
    failing = """batch_size = 16384
stages.put("start")
x = torch.randn(batch_size, 1024, device="cuda")
stages.put("forward")
loss = Heavy.apply(mlp(x)).sum()
stages.put("backward")
loss.backward()
mlp.zero_grad(set_to_none=True)
stages.put("done")
"""
    report, result = tries_of(MLP, failing)
    check(report, result, "backward")


LSTM = """class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8000, 128)
        self.lstm = nn.LSTM(128, 256, batch_first=True)
        self.out = nn.Linear(256, 8000)

    def forward(self, tokens):
        return self.out(self.lstm(self.embed(tokens))[0])

lm = LM().cuda()
opt = torch.optim.SGD(lm.parameters(), lr=0.1)
lm(torch.randint(0, 8000, (2, 65), device="cuda")).sum().backward()
lm.zero_grad(set_to_none=True)
"""


def test_a_training_loop_leaves_nothing_of_one_try_to_the_next():
    failing = """bs = 4096
for step in range(2):
    stages.put("start" if step == 0 else "step")
    tokens = torch.randint(0, 8000, (bs, 65), device="cuda")
    logits = lm(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, 8000), tokens[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
stages.put("done")
"""
    cells = [SETUP, LSTM, LEVEL, failing, "outcome = %oomfix --yes -o", REPORT]
    notebook = run_cells(cells, timeout=600, allow_errors_in={3})
    assert "OutOfMemoryError" in text_of(notebook.cells[3]), text_of(notebook.cells[3])
    result = json_line(notebook.cells[5])
    result["stages"] = [s for s in result["stages"] if s != "step"]
    # The gradients and logits a fitted try leaves (``opt.zero_grad()`` comes before ``backward()``) are the
    # next try's start, as they are the next run's.
    check(text_of(notebook.cells[4]), result, None)


def test_a_cell_that_builds_its_own_model_and_adam_leaves_nothing_of_one_try_to_the_next():
    failing = """batch_size = 131072
stages.put("start")
net = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10)).cuda()
adam = torch.optim.Adam(net.parameters(), lr=1e-3)
x = torch.randn(batch_size, 512, device="cuda")
stages.put("forward")
loss = nn.functional.cross_entropy(net(x), torch.randint(0, 10, (batch_size,), device="cuda"))
stages.put("backward")
loss.backward()
adam.step()
stages.put("done")
"""
    # cuBLAS's workspace is made by the first matmul and kept by the library: made here, before the level.
    warm = "nn.Linear(8, 8).cuda()(torch.randn(2, 8, device='cuda')).sum().backward()\n"
    cells = [SETUP, warm, LEVEL, failing, "outcome = %oomfix --yes -o", REPORT]
    notebook = run_cells(cells, timeout=600, allow_errors_in={3})
    assert "OutOfMemoryError" in text_of(notebook.cells[3]), text_of(notebook.cells[3])
    check(text_of(notebook.cells[4]), json_line(notebook.cells[5]), None)
