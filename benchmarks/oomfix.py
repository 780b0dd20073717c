"""Benchmark: ``%oomfix --yes`` against accelerate's ``find_executable_batch_size`` and plain halving,
on many kinds of workload, started at many multiples of the largest batch that fits.

The workloads (``WORKLOADS``: setup cells, a cell holding the batch knob where notebooks keep it, and
the training or inference cell) span where users run out of memory: convnets, RNNs and an MLP whose
largest fitting batch is in the hundreds or thousands, and transformer and ViT fine-tunes (GPT-2, a
Llama-style LM, BERT-base, ViT-B/16, a cut ViT-L, all AdamW, some under bf16 autocast) and a large
model's inference under ``torch.no_grad`` whose largest batch is 1 to 48 and whose weights, gradients
and optimizer state are up to 0.55 of the cap; and five written after the search was (held out: a
frozen Llama with LoRA adapters of its own, BERT-base accumulating micro-batches, GPT-2 with gradient
checkpointing built in the cell, ConvNeXt under fp16 with a GradScaler, GPT-2 medium's ``generate()``
over prompts a batch at a time); and three where the steady state differs from one run (issue 40): a
4-step AdamW loop over a 217M transformer of plain ``torch.nn`` built in an earlier cell (weights,
gradients and state 0.54 of the cap, the state appearing in the loop's first step), an LSTM built with
Adam in the failing cell (the last run's model and outputs bound while the cell builds them again),
and a T5-base fine-tune from an earlier cell (AdamW state 0.28 of the cap made by its one step). Cells
that build their model again were there already (BERT, ViT-L, GPT-2 with checkpointing, the MLP), and
so was a convnet under fp16 autocast with a GradScaler (ConvNeXt-T, two steps, SGD momentum made in
its first). Models come from configs (``transformers``) or ``pretrained=False`` (``timm``), nothing
downloaded; the large ones are built on the device.

What runs, per workload:

1. **The oracle** is the steady state: the largest batch at which the cell runs ``STEADY_RUNS`` (3) times
   in a row in one namespace without an OOM, as the user runs it again and again (the optimizer state its
   first step made held by the next run, what the last run bound held until the line that binds it
   again, every step of its loop). Each probe in a fresh namespace (``%reset -f``, the setup cells, the
   knob at that batch, then the cell three times; it stops at the first OOM, and records how many runs
   fitted). The steady largest is at most the single-run one (the first run of a probe is a single-run
   probe), so the search starts from a single-run oracle where one is known: on this device, cap and
   cells it is a bound (its next batch up is never run), measured elsewhere a first guess (25% steps from
   it); with none, doubling from 16, then bisection (``steady_largest``). Records keep
   ``single_run_oracle_batch`` (the largest batch for one run, the oracle of the sweeps before issue 40)
   where it is known: from that cache, or from the probes' first runs when they pin it. **The fixed
   bytes** are read after the probe at the answer (``held_by_models``): weights, gradients (a gradient
   the cell set to ``None`` counted at its parameter's size) and optimizer state. None of it depends on
   this project's code: each steady oracle is written to ``results/oomfix_oracles.json`` (its
   ``steady_state`` part; ``--oracles`` names another file) as soon as it is measured, and reused for
   the same cells (a digest), device, cap and runs (``--oracles-only`` measures only them;
   ``--remeasure-oracles`` measures anyway).
2. For each start ratio (``RATIOS``: 1.1x, 1.5x, 3x, 10x, 50x the steady oracle; no powers of two, from
   which halving would land on the oracle by construction), three finders from the same start:

   - ``%oomfix``: fresh namespace, the knob and the cell at the start batch run as plain cells in an
     IPython ``InteractiveShell`` with the extension loaded; the cell run again, up to three times in
     all, until it fails with a CUDA OOM (a start between the steady and the single-run largest fits its
     first run: the user meets the OOM on a later one; ``start_runs_fitted`` says how many fitted); then
     ``%oomfix --yes -o`` (default 3 reruns) exactly as a user types it. Read from its outcome
     (``read_outcome``): the found batch (the batch of the best try that fitted) and the reruns (the
     number of tries). What PyTorch had allocated when each try started is read by a ``pre_run_cell``
     callback of the benchmark's own, so it does not depend on what the outcome exposes.
   - accelerate's ``find_executable_batch_size`` (its default: multiply by 0.9 after each OOM) around
     a function that runs the knob and the cell at its ``batch_size`` in the same shell.
   - halving: the start, then half of it after each OOM, until one fits.

   Then **the next runs**, the same for all three: the fixed cell run ``NEXT_RUNS`` (3) more times in the
   same kernel, as the user runs it after the fix (``%oomfix``: the cell its outcome ran at the batch it
   found, ``fixed_source``, with the knob where ``%oomfix`` left it; a peer: the cell at the batch it
   ended on, the knob set there by its last try). ``next_runs_fit`` is true when none raised an OOM,
   ``next_runs_fitted`` counts those that did not (a failed run's exception is dropped before the next,
   as a peer's failed try is). A peer's found batch may be above the steady oracle (a try that fits once
   ends its search): its ``next_runs_fit`` then says what it cost.

   ``--finders`` picks which run. The peers' results do not depend on this project's code: a part run
   with ``--finders oomfix`` is merged (``--merge``) over an earlier run of the peers on the same cases
   (same workload, ratio and start batch), whose records keep the date they were measured
   (``measured``).

   Where ``%oomfix`` chunked the whole data instead of shrinking it (inference over one tensor: its note
   says so), the batch it found is a chunk of the start's data, which stays allocated whole: the case's
   ``oracle_batch`` is then the largest chunk that keeps fitting over that data (the same steady search
   over the cell the fix wrote) and ``unchunked_oracle_batch`` the workload's own, which the peers (they
   shrink the data itself) are measured against.

   A peer's failed try is forgotten as a function's locals would be: the names the cell bound are
   put back, the exception and IPython's references to its traceback dropped, ``gc.collect()`` and
   ``empty_cache()``. ``tries`` counts every run including the one at the start; ``reruns`` (the
   figure to set against ``%oomfix``'s) is ``tries - 1``, since ``%oomfix`` starts after that failure.
3. Between cases, ``%reset -f``, ``gc.collect()``, ``empty_cache()``, and PyTorch's allocated memory
   must be back within ``BASELINE_TOLERANCE_BYTES`` of what it was before the first case; each record
   says how far it was (``allocated_after_case_above_baseline_bytes``).

Each case records ``oracle_batch`` (steady, ``oracle_runs`` 3), ``single_run_oracle_batch``,
``found_batch``, ``reruns``, ``next_runs_fit``, the peers' records (each with its own next runs),
``fixed_bytes`` and ``cap_bytes``. ``--summary`` gives per finder the min and median of found/oracle, by
regime (steady largest <= 10, 11-64, > 64; fixed bytes at half the cap or more, or less), how often the
next runs ran out of memory, and issue 40's goal per case (``goal_misses``): the next runs fit; found >=
largest - 1 where the largest is 10 or less, else >= 0.90 of it; not below halving's found/oracle in the
same case (where halving's own next runs fit); at most 3 reruns; a median of 0.97 or more. Results of
the sweeps before issue 40 (no ``oracle_runs``: judged by the single-run oracle) are summarized as
before, and the summary says so.

The cap: ``set_per_process_memory_fraction`` at ``CAP_GIB`` (6 GiB, a common consumer card, the
budget the issue's figures were taken under; ``--cap-gib`` to change), so every workload runs out at
small, quick sizes on a big card.

Run on the GPU machine (no network), in parts that may run at the same time (each process has its own
cap), each to its own files, then merged::

    python benchmarks/oomfix.py --estimate --quick                  # the plan and its GPU seconds; runs nothing
    python benchmarks/oomfix.py --quick --part 1/4 --out /tmp/q1.json --oracles /tmp/o1.json   # (x4, at once)
    python benchmarks/oomfix.py --merge /tmp/q*.json --merge-oracles /tmp/o*.json
    python benchmarks/oomfix.py --summary

``--quick`` is ``QUICK_WORKLOADS`` (one per regime, and a cell that builds its model) at x1.5 and x10.
``--merge`` starts from ``--out``'s content (``results/oomfix_sweep.json`` by default; the sweeps before
issue 40 are ``results/oomfix_sweep.json``); a case a part ran replaces the case of the same workload and
ratio there, and a workload's cases judged by another oracle are dropped. ``--merge-oracles`` adds parts'
oracle files to ``results/oomfix_oracles.json``. ``--workloads a,b`` and ``--ratios 1.5,10`` pick,
``--smoke`` runs one workload at one ratio (to a temporary file unless ``--out``), ``--device cpu`` runs
each workload's cells once at batch 2 on CPU, the large models shrunk (``Workload.small``: the same code
at a size two cores run in seconds; no OOM, no search: it checks the cells' code). A workload whose
library is missing (torchvision, timm, transformers) is skipped with the import error.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import gzip
import io
import json
import math
import pickle
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import bisect_batch  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "oomfix_sweep.json"
SINGLE_RUN_RESULTS = REPO / "benchmarks" / "results" / "oomfix_sweep_2026-11-27_one_run.json"
"""The sweeps before issue 40, judged by the single-run oracle."""
ORACLES = REPO / "benchmarks" / "results" / "oomfix_oracles.json"
ORACLES_ABOUT = (
    "Per workload of benchmarks/oomfix.py: the largest batch that fits (the oracle: doubling from 16 then "
    "bisection, each probe in a fresh namespace, the cell run as a plain cell) and what the namespace's models "
    "and optimizers hold after a fresh run at it (fixed_bytes = weights + gradients + optimizer state), under "
    "cap_bytes on device. None of it depends on jupyter_cudamem's code: the sweep reuses an entry measured on "
    "the same device, under the same cap, of the same cells (cells_digest), instead of measuring it again.")
STEADY_SECTION = "steady_state"
"""The oracle file's part holding the steady-state oracles (``workloads`` holds the single-run ones)."""
STEADY_ABOUT = (
    "Per workload: the largest batch at which the cell runs `runs` times in a row in one namespace (after its "
    "setup cells and knob, each probe in a fresh namespace) without an OOM; probes are [batch, runs that "
    "fitted]; fixed_bytes read after the probe at the answer. Reused for the same cells, device, cap and runs.")
STEADY_RUNS = 3
"""The oracle's runs in a row: the first makes the optimizer's state, the second holds it and what the
first bound, the third shows the second left nothing more."""
NEXT_RUNS = 3
"""The fixed cell's runs after a finder is done, as the user runs it again."""
CAP_GIB = 6.0
RATIOS = (1.1, 1.5, 3.0, 10.0, 50.0)
SMOKE_WORKLOAD, SMOKE_RATIO = "mlp_builds_own_model", 4.0
QUICK_RATIOS = (1.5, 10.0)
FINDERS = ("oomfix", "accelerate", "halving")
PEERS = ("accelerate", "halving")
"""The peers' results depend on the workload, the start and the card, not on this project's code: a run
of ``%oomfix`` alone (``--finders oomfix``) keeps the peers of an earlier run of the same case."""
GOAL_FRACTION = 0.90
"""The issue's bar: found batch at 90% of the largest that fits or better (where it is above
``SMALL_LARGEST``)."""
SMALL_LARGEST = 10
"""At a largest fitting batch of 10 or less the bar is a whole sample: found >= largest - 1."""
GOAL_MEDIAN = 0.97
GOAL_RERUNS = 3
REGIMES = ((1, 10, "largest <= 10"), (11, 64, "largest 11-64"), (65, None, "largest > 64"))
FIXED_SHARE = 0.5
"""Weights + gradients + optimizer state at half the cap or more: where the batch-independent part is most."""
BASELINE_TOLERANCE_BYTES = 2 * 2**20
"""Between cases PyTorch's allocated memory must come back to its baseline within 2 MiB (the issue's
figure): enough for cuBLAS's and cuDNN's small handles, far below any workload's smallest tensor."""
ORACLE_FIRST_PROBE = 16
"""The oracle's doubling starts here (and bisects below it if 16 does not fit): every workload here
fits a batch of a few dozen under 6 GiB, so smaller probes would only cost time."""
ORACLE_MAX_BATCH = 2**20
"""A workload that still fits at a million items is broken (the knob does not reach the cell)."""
HINT_STEP = 1.25
"""From a single-run oracle measured elsewhere (another card), the steady search moves by 25%: the
largest batch differs little between cards under one cap, and the steady one is often 0.5-1.0 of it."""


def say(message: str) -> None:
    print(message, flush=True)


# -- the workloads --------------------------------------------------------------------------------
PRELUDE = """import gc, math, torch
from torch import nn
torch.manual_seed(0)
dev = {dev!r}
"""


LLAMA_MODEL = ("from transformers import LlamaConfig, LlamaForCausalLM\n"
               "config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,\n"
               "                     num_key_value_heads=16, vocab_size=32000, max_position_embeddings=2048)\n"
               "with torch.device(dev):\n"
               "    model = LlamaForCausalLM(config)\n")
"""The Llama-style model (hidden 1024, 12 layers, 220M) three workloads build in their setup cell."""
LLAMA_SMALL = (("hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16",
                "hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2"),
               ("num_key_value_heads=16", "num_key_value_heads=2"))
"""What shrinks that model for the CPU check."""


@dataclass(frozen=True)
class Workload:
    """A notebook in small: setup cells (run once, batch-independent), the cell holding the batch knob
    (``{batch}`` in it; empty when the knob is in the training cell itself), and the cell that runs
    out of memory. ``{dev}`` is the device. ``needs`` are the modules whose absence skips it."""

    name: str
    kind: str
    setup: tuple[str, ...]
    knob: str
    cell: str
    needs: tuple[str, ...] = ()
    where: str = "a literal in the cell"
    small: tuple[tuple[str, str], ...] = ()
    """Replacements that shrink a large model or sequence for the CPU check (``--device cpu``): the
    same code at a size two shared cores run in seconds. Never applied on the GPU."""

    def _shrunk(self, source: str, dev: str) -> str:
        if dev == "cpu":
            for large, tiny in self.small:
                source = source.replace(large, tiny)
        return source

    def knob_at(self, batch: int, dev: str) -> str:
        return self._shrunk(self.knob.format(batch=batch, dev=dev), dev) if self.knob else ""

    def cell_at(self, batch: int, dev: str) -> str:
        return self._shrunk(self.cell.format(batch=batch, dev=dev), dev)

    def setup_cells(self, dev: str) -> list[str]:
        return [PRELUDE.format(dev=dev)] + [self._shrunk(cell.replace("{dev}", dev), dev) for cell in self.setup]

    def cells_digest(self) -> str:
        """A digest of the cells as written: a measured oracle is reused only for the same cells."""
        import hashlib

        text = "\0".join((PRELUDE, *self.setup, self.knob, self.cell))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


WORKLOADS: tuple[Workload, ...] = (
    Workload(
        "resnet18_model_from_earlier_cell",
        "torchvision ResNet-18 training, SGD momentum; model and optimizer built in an earlier cell",
        ("import torchvision\nmodel = torchvision.models.resnet18(weights=None, num_classes=10).to(dev)\n"
         "optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)",),
        "",
        "batch_size = {batch}\n"
        "x = torch.randn(batch_size, 3, 64, 64, device=dev)\n"
        "y = torch.randint(0, 10, (batch_size,), device=dev)\n"
        "loss = nn.functional.cross_entropy(model(x), y)\n"
        "loss.backward()\n"
        "optimizer.step()\n"
        "optimizer.zero_grad()\n",
        needs=("torchvision",),
    ),
    Workload(
        "resnet50_autocast_bf16",
        "torchvision ResNet-50 mixed-precision training under torch.autocast(bfloat16), Adam",
        ("import torchvision\nmodel = torchvision.models.resnet50(weights=None, num_classes=100).to(dev)\n"
         "optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)",),
        "",
        "x = torch.randn({batch}, 3, 96, 96, device=dev)\n"
        "y = torch.randint(0, 100, (x.shape[0],), device=dev)\n"
        "with torch.autocast(dev, dtype=torch.bfloat16):\n"
        "    loss = nn.functional.cross_entropy(model(x), y)\n"
        "loss.backward()\n"
        "optimizer.step()\n"
        "optimizer.zero_grad(set_to_none=True)\n",
        needs=("torchvision",),
        where="a literal in a call in the cell",
    ),
    Workload(
        "timm_efficientnet_name_from_earlier_cell",
        "timm EfficientNet-B0 training, AdamW; the batch a name set in an earlier cell",
        ("import timm\nmodel = timm.create_model('efficientnet_b0', pretrained=False, num_classes=10).to(dev)\n"
         "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)",),
        "batch_size = {batch}\n",
        "images = torch.randn(batch_size, 3, 96, 96, device=dev)\n"
        "labels = torch.randint(0, 10, (batch_size,), device=dev)\n"
        "loss = nn.functional.cross_entropy(model(images), labels)\n"
        "loss.backward()\n"
        "optimizer.step()\n"
        "optimizer.zero_grad()\n",
        needs=("timm",),
        where="a name set in an earlier cell",
    ),
    Workload(
        "bert_from_config_adamw_in_cell",
        "transformers BERT (4 layers, d=256) built from BertConfig with AdamW in the same cell, seq 128",
        ("from transformers import BertConfig, BertForSequenceClassification",),
        "",
        "batch_size = {batch}\n"
        "config = BertConfig(vocab_size=8000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,\n"
        "                    intermediate_size=1024, max_position_embeddings=256, num_labels=2)\n"
        "bert = BertForSequenceClassification(config).to(dev)\n"
        "optimizer = torch.optim.AdamW(bert.parameters(), lr=5e-5)\n"
        "input_ids = torch.randint(0, 8000, (batch_size, 128), device=dev)\n"
        "labels = torch.randint(0, 2, (batch_size,), device=dev)\n"
        "out = bert(input_ids=input_ids, labels=labels)\n"
        "out.loss.backward()\n"
        "optimizer.step()\n",
        needs=("transformers",),
    ),
    Workload(
        "gru_config_dict_from_earlier_cell",
        "2-layer GRU over 256 steps (input 128, hidden 256), Adam; the batch in a config dict of an earlier cell",
        ("gru = nn.GRU(128, 256, num_layers=2, batch_first=True).to(dev)\n"
         "head = nn.Linear(256, 1).to(dev)\n"
         "optimizer = torch.optim.Adam([*gru.parameters(), *head.parameters()], lr=1e-3)",),
        'config = {{"lr": 1e-3,\n          "batch_size": {batch},\n          "seq_len": 256}}\n',
        'x = torch.randn(config["batch_size"], config["seq_len"], 128, device=dev)\n'
        "out, _ = gru(x)\n"
        "loss = head(out[:, -1]).pow(2).mean()\n"
        "loss.backward()\n"
        "optimizer.step()\n"
        "optimizer.zero_grad()\n",
        where="a config dict in an earlier cell",
    ),
    Workload(
        "lstm_language_model",
        "LSTM language model (embedding 256, 2 layers of 512, vocab 10000, seq 128), two SGD steps",
        ("class LM(nn.Module):\n"
         "    def __init__(self):\n"
         "        super().__init__()\n"
         "        self.embed = nn.Embedding(10000, 256)\n"
         "        self.lstm = nn.LSTM(256, 512, num_layers=2, batch_first=True)\n"
         "        self.out = nn.Linear(512, 10000)\n"
         "    def forward(self, tokens):\n"
         "        return self.out(self.lstm(self.embed(tokens))[0])\n"
         "lm = LM().to(dev)\n"
         "opt = torch.optim.SGD(lm.parameters(), lr=0.1)",),
        "",
        "bs = {batch}\n"
        "for step in range(2):\n"
        "    tokens = torch.randint(0, 10000, (bs, 129), device=dev)\n"
        "    logits = lm(tokens[:, :-1])\n"
        "    loss = nn.functional.cross_entropy(logits.reshape(-1, 10000), tokens[:, 1:].reshape(-1))\n"
        "    opt.zero_grad()\n"
        "    loss.backward()\n"
        "    opt.step()\n",
    ),
    Workload(
        "mlp_builds_own_model",
        "MLP (1024-4096-4096-10) and Adam built in the same cell as its training step",
        (),
        "",
        "batch_size = {batch}\n"
        "mlp = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),\n"
        "                    nn.Linear(4096, 10)).to(dev)\n"
        "opt = torch.optim.Adam(mlp.parameters(), lr=1e-3)\n"
        "x = torch.randn(batch_size, 1024, device=dev)\n"
        "y = torch.randint(0, 10, (batch_size,), device=dev)\n"
        "loss = nn.functional.cross_entropy(mlp(x), y)\n"
        "loss.backward()\n"
        "opt.step()\n",
    ),
    Workload(
        "resnet50_inference_without_no_grad",
        "torchvision ResNet-50 inference in eval mode, without torch.no_grad (the graph is kept)",
        ("import torchvision\nmodel = torchvision.models.resnet50(weights=None).to(dev).eval()",),
        "",
        "batch = torch.randn({batch}, 3, 128, 128, device=dev)\n"
        "preds = model(batch).argmax(dim=1)\n",
        needs=("torchvision",),
        where="a literal in a call in the cell",
    ),
    Workload(
        "cnn_dataloader_from_earlier_cell",
        "a 4-conv CNN fed by a DataLoader (uint8 96x96 images, batch baked into the loader of an earlier cell), two steps",
        ("class Images(torch.utils.data.Dataset):\n"
         "    # uint8 images from a small pool: a big batch costs a copy, not random numbers\n"
         "    pool = torch.randint(0, 256, (1024, 3, 96, 96), dtype=torch.uint8)\n"
         "    def __len__(self):\n"
         "        return 1 << 20\n"
         "    def __getitem__(self, index):\n"
         "        return self.pool[index % 1024], index % 10\n"
         "train_set = Images()\n",
         "cnn = nn.Sequential(\n"
         "    nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),\n"
         "    nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),\n"
         "    nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(), nn.MaxPool2d(2),\n"
         "    nn.Conv2d(128, 256, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 10),\n"
         ").to(dev)\n"
         "optimizer = torch.optim.Adam(cnn.parameters(), lr=1e-3)\n",),
        "from torch.utils.data import DataLoader\n"
        "train_loader = DataLoader(train_set, batch_size={batch}, shuffle=False, drop_last=True)\n",
        "for step, (images, labels) in enumerate(train_loader):\n"
        "    images = images.to(dev).float().div_(255)\n"
        "    labels = labels.to(dev)\n"
        "    loss = nn.functional.cross_entropy(cnn(images), labels)\n"
        "    loss.backward()\n"
        "    optimizer.step()\n"
        "    optimizer.zero_grad()\n"
        "    if step == 1:\n"
        "        break\n",
        where="a DataLoader built in an earlier cell",
    ),
    # Where users hit OOM: fine-tunes of transformers and ViTs whose weights, gradients and AdamW state
    # are much of the cap, and whose largest fitting batch is a few dozen or a few.
    Workload(
        "gpt2_finetune_bf16_training_args",
        "GPT-2 small (124M) causal-LM fine-tune at sequence 1024 under bf16 autocast, AdamW, two steps; model "
        "and optimizer built in an earlier cell, the batch in a TrainingArguments-like dataclass of an earlier cell",
        ("from transformers import GPT2Config, GPT2LMHeadModel\n"
         "with torch.device(dev):\n"
         "    model = GPT2LMHeadModel(GPT2Config())\n"
         "optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)\n",),
        "from dataclasses import dataclass\n"
        "@dataclass\n"
        "class TrainingArguments:\n"
        "    per_device_train_batch_size: int\n"
        "    learning_rate: float = 3e-4\n"
        "    max_seq_length: int = 1024\n"
        "args = TrainingArguments(per_device_train_batch_size={batch})\n",
        "model.train()\n"
        "for step in range(2):\n"
        "    input_ids = torch.randint(0, 50257, (args.per_device_train_batch_size, args.max_seq_length), device=dev)\n"
        "    with torch.autocast(dev, dtype=torch.bfloat16):\n"
        "        loss = model(input_ids=input_ids, labels=input_ids).loss\n"
        "    loss.backward()\n"
        "    optimizer.step()\n"
        "    optimizer.zero_grad(set_to_none=True)\n",
        needs=("transformers",),
        where="a TrainingArguments-like dataclass built in an earlier cell",
        small=(("GPT2Config()", "GPT2Config(n_layer=1, n_embd=64, n_head=2, n_positions=64)"),
               ("max_seq_length: int = 1024", "max_seq_length: int = 32")),
    ),
    Workload(
        "llama_finetune_bf16_seq2048",
        "Llama-style causal LM (hidden 1024, 12 layers, 220M) from LlamaConfig at sequence 2048 under bf16 "
        "autocast, AdamW; model and optimizer built in an earlier cell, one step",
        (LLAMA_MODEL
         + "optimizer = torch.optim.AdamW(model.parameters(), lr=2e-4)\n",),
        "",
        "batch_size = {batch}\n"
        "input_ids = torch.randint(0, config.vocab_size, (batch_size, 2048), device=dev)\n"
        "with torch.autocast(dev, dtype=torch.bfloat16):\n"
        "    out = model(input_ids=input_ids, labels=input_ids)\n"
        "out.loss.backward()\n"
        "optimizer.step()\n"
        "optimizer.zero_grad()\n",
        needs=("transformers",),
        small=LLAMA_SMALL + (("(batch_size, 2048)", "(batch_size, 32)"),),
    ),
    Workload(
        "llama_finetune_bf16_seq1024",
        "Llama-style causal LM (hidden 1024, 12 layers, 220M) from LlamaConfig at sequence 1024 under bf16 "
        "autocast, AdamW; model and optimizer built in an earlier cell, one step",
        (LLAMA_MODEL
         + "optimizer = torch.optim.AdamW(model.parameters(), lr=2e-4)\n",),
        "",
        "batch_size = {batch}\n"
        "input_ids = torch.randint(0, config.vocab_size, (batch_size, 1024), device=dev)\n"
        "with torch.autocast(dev, dtype=torch.bfloat16):\n"
        "    out = model(input_ids=input_ids, labels=input_ids)\n"
        "out.loss.backward()\n"
        "optimizer.step()\n"
        "optimizer.zero_grad()\n",
        needs=("transformers",),
        small=LLAMA_SMALL + (("(batch_size, 1024)", "(batch_size, 32)"),),
    ),
    Workload(
        "bert_base_seq256_adamw_in_cell",
        "BERT-base (110M) from BertConfig() for sequence classification at sequence 256, fp32, with AdamW built "
        "in the failing cell",
        ("from transformers import BertConfig, BertForSequenceClassification",),
        "",
        "config = BertConfig(num_labels=2)\n"
        "bert = BertForSequenceClassification(config).to(dev)\n"
        "optimizer = torch.optim.AdamW(bert.parameters(), lr=2e-5)\n"
        "input_ids = torch.randint(0, config.vocab_size, ({batch}, 256), device=dev)\n"
        "attention_mask = torch.ones_like(input_ids)\n"
        "labels = torch.randint(0, 2, (input_ids.shape[0],), device=dev)\n"
        "loss = bert(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss\n"
        "loss.backward()\n"
        "optimizer.step()\n"
        "optimizer.zero_grad()\n",
        needs=("transformers",),
        where="a literal in a call in the cell",
        small=(("BertConfig(num_labels=2)", "BertConfig(num_labels=2, hidden_size=64, num_hidden_layers=1, "
                "num_attention_heads=2, intermediate_size=128)"), (", 256)", ", 32)")),
    ),
    Workload(
        "vit_b16_name_from_earlier_cell",
        "timm ViT-B/16 (86M) fine-tune at 224x224, fp32, AdamW; model and optimizer built in an earlier cell, "
        "the batch a name set in an earlier cell",
        ("import timm\n"
         "model = timm.create_model('vit_base_patch16_224', pretrained=False, num_classes=10).to(dev)\n"
         "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)\n",),
        "batch_size = {batch}\n",
        "images = torch.randn(batch_size, 3, 224, 224, device=dev)\n"
        "labels = torch.randint(0, 10, (batch_size,), device=dev)\n"
        "loss = nn.functional.cross_entropy(model(images), labels)\n"
        "loss.backward()\n"
        "optimizer.step()\n"
        "optimizer.zero_grad()\n",
        needs=("timm",),
        where="a name set in an earlier cell",
        small=(("num_classes=10)", "num_classes=10, img_size=32, depth=1)"), ("224, 224", "32, 32")),
    ),
    Workload(
        "vit_large_bf16_built_in_cell",
        "timm ViT-L/16 cut to 17 blocks (216M) at 224x224 under bf16 autocast, built with AdamW in the failing "
        "cell, two steps",
        ("import timm",),
        "",
        "batch_size = {batch}\n"
        "with torch.device(dev):\n"
        "    vit = timm.create_model('vit_large_patch16_224', pretrained=False, num_classes=100, depth=17)\n"
        "optimizer = torch.optim.AdamW(vit.parameters(), lr=1e-4)\n"
        "for step in range(2):\n"
        "    images = torch.randn(batch_size, 3, 224, 224, device=dev)\n"
        "    labels = torch.randint(0, 100, (batch_size,), device=dev)\n"
        "    with torch.autocast(dev, dtype=torch.bfloat16):\n"
        "        loss = nn.functional.cross_entropy(vit(images), labels)\n"
        "    loss.backward()\n"
        "    optimizer.step()\n"
        "    optimizer.zero_grad(set_to_none=True)\n",
        needs=("timm",),
        small=(("depth=17)", "depth=1, img_size=32)"), ("224, 224", "32, 32")),
    ),
    Workload(
        "gpt2_850m_inference_no_grad",
        "a GPT-2-style model of 853M parameters (width 1280, 40 layers) in fp32 computing next-token logits "
        "for a batch of sequences of 1024 under torch.no_grad; model built in an earlier cell",
        ("from transformers import GPT2Config, GPT2LMHeadModel\n"
         "with torch.device(dev):\n"
         "    model = GPT2LMHeadModel(GPT2Config(n_embd=1280, n_layer=40, n_head=20)).eval()\n",),
        "",
        "prompts = torch.randint(0, 50257, ({batch}, 1024), device=dev)\n"
        "with torch.no_grad():\n"
        "    logits = model(prompts).logits\n"
        "next_tokens = logits[:, -1].argmax(dim=-1)\n",
        needs=("transformers",),
        where="a literal in a call in the cell",
        small=(("n_embd=1280, n_layer=40, n_head=20", "n_embd=64, n_layer=1, n_head=2, n_positions=64"),
               (", 1024)", ", 32)")),
    ),
    Workload(
        "llama_lora_bf16_seq1024",
        "Llama-style causal LM (hidden 1024, 12 layers, 220M) frozen, with rank-16 LoRA adapters of its own on "
        "q and v, at sequence 1024 under bf16 autocast, AdamW over the adapters; built in an earlier cell",
        (LLAMA_MODEL
         + "model.requires_grad_(False)\n",
         "class LoRALinear(nn.Module):\n"
         "    def __init__(self, base, rank=16, alpha=32):\n"
         "        super().__init__()\n"
         "        self.base = base\n"
         "        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features, device=base.weight.device) / rank)\n"
         "        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device))\n"
         "        self.scale = alpha / rank\n"
         "    def forward(self, x):\n"
         "        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale\n"
         "\n"
         "for layer in model.model.layers:\n"
         "    layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj)\n"
         "    layer.self_attn.v_proj = LoRALinear(layer.self_attn.v_proj)\n"
         "optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)\n"),
        "",
        "batch_size = {batch}\n"
        "input_ids = torch.randint(0, config.vocab_size, (batch_size, 1024), device=dev)\n"
        "with torch.autocast(dev, dtype=torch.bfloat16):\n"
        "    loss = model(input_ids=input_ids, labels=input_ids).loss\n"
        "loss.backward()\n"
        "optimizer.step()\n"
        "optimizer.zero_grad()\n",
        needs=("transformers",),
        small=LLAMA_SMALL + (("(batch_size, 1024)", "(batch_size, 32)"),),
    ),
    Workload(
        "bert_base_seq512_gradient_accumulation",
        "BERT-base (110M) for sequence classification at sequence 512, fp32, four micro-batches accumulated "
        "before each AdamW step; model and optimizer built in an earlier cell, the micro-batch a literal",
        ("from transformers import BertConfig, BertForSequenceClassification\n"
         "config = BertConfig(num_labels=2)\n"
         "with torch.device(dev):\n"
         "    model = BertForSequenceClassification(config)\n"
         "optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)\n",),
        "",
        "micro_batch_size = {batch}\n"
        "accumulation_steps = 4\n"
        "for micro_step in range(accumulation_steps):\n"
        "    input_ids = torch.randint(0, config.vocab_size, (micro_batch_size, 512), device=dev)\n"
        "    labels = torch.randint(0, 2, (micro_batch_size,), device=dev)\n"
        "    loss = model(input_ids=input_ids, labels=labels).loss / accumulation_steps\n"
        "    loss.backward()\n"
        "optimizer.step()\n"
        "optimizer.zero_grad()\n",
        needs=("transformers",),
        small=(("BertConfig(num_labels=2)", "BertConfig(num_labels=2, hidden_size=64, num_hidden_layers=1, "
                "num_attention_heads=2, intermediate_size=128)"), (", 512)", ", 32)")),
    ),
    Workload(
        "gpt2_gradient_checkpointing_built_in_cell",
        "GPT-2 (124M) from GPT2Config with gradient checkpointing at sequence 1024 under bf16 autocast, built "
        "with AdamW in the failing cell, the batch a literal in a call",
        ("from transformers import GPT2Config, GPT2LMHeadModel",),
        "",
        "with torch.device(dev):\n"
        "    gpt = GPT2LMHeadModel(GPT2Config())\n"
        "gpt.gradient_checkpointing_enable()\n"
        "gpt.train()\n"
        "optimizer = torch.optim.AdamW(gpt.parameters(), lr=3e-4)\n"
        "tokens = torch.randint(0, 50257, ({batch}, 1024), device=dev)\n"
        "with torch.autocast(dev, dtype=torch.bfloat16):\n"
        "    loss = gpt(input_ids=tokens, labels=tokens).loss\n"
        "loss.backward()\n"
        "optimizer.step()\n"
        "optimizer.zero_grad(set_to_none=True)\n",
        needs=("transformers",),
        where="a literal in a call in the cell",
        small=(("GPT2Config()", "GPT2Config(n_embd=64, n_layer=1, n_head=2, n_positions=64)"), (", 1024)", ", 32)")),
    ),
    Workload(
        "convnext_fp16_grad_scaler",
        "timm ConvNeXt-T at 224x224 under fp16 autocast with a GradScaler, SGD with momentum, two steps; model, "
        "optimizer and scaler built in an earlier cell",
        ("import timm\n"
         "model = timm.create_model('convnext_tiny', pretrained=False, num_classes=100).to(dev)\n"
         "optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)\n"
         "scaler = torch.amp.GradScaler(dev)\n",),
        "",
        "batch_size = {batch}\n"
        "for step in range(2):\n"
        "    images = torch.randn(batch_size, 3, 224, 224, device=dev)\n"
        "    labels = torch.randint(0, 100, (batch_size,), device=dev)\n"
        "    with torch.autocast(dev, dtype=torch.float16):\n"
        "        loss = nn.functional.cross_entropy(model(images), labels)\n"
        "    scaler.scale(loss).backward()\n"
        "    scaler.step(optimizer)\n"
        "    scaler.update()\n"
        "    optimizer.zero_grad(set_to_none=True)\n",
        needs=("timm",),
        small=(("num_classes=100)", "num_classes=100, depths=(1, 1, 1, 1), dims=(8, 16, 32, 64))"),
               ("224, 224", "32, 32")),
    ),
    Workload(
        "gpt2_medium_generate_in_batches",
        "GPT-2 medium (355M) from GPT2Config, fp32, greedy generate() of 64 tokens after each of 96 prompts of 512, "
        "a batch of prompts at a time (the KV cache grows each step); model and prompts from an earlier cell, the "
        "batch a name set in an earlier cell",
        ("from transformers import GPT2Config, GPT2LMHeadModel\n"
         "with torch.device(dev):\n"
         "    model = GPT2LMHeadModel(GPT2Config(n_embd=1024, n_layer=24, n_head=16)).eval()\n"
         "prompts = torch.randint(0, 50257, (96, 512))\n",),
        "batch_size = {batch}\n",
        "completions = []\n"
        "for start in range(0, len(prompts), batch_size):\n"
        "    chunk = prompts[start:start + batch_size].to(dev)\n"
        "    generated = model.generate(chunk, attention_mask=torch.ones_like(chunk), max_new_tokens=64,\n"
        "                               do_sample=False, pad_token_id=50256)\n"
        "    completions.extend(generated[:, 512:].tolist())\n",
        needs=("transformers",),
        where="a name set in an earlier cell",
        small=(("n_embd=1024, n_layer=24, n_head=16", "n_embd=64, n_layer=1, n_head=2, n_positions=128"),
               ("(96, 512)", "(4, 16)"), ("max_new_tokens=64", "max_new_tokens=4"), ("generated[:, 512:]", "generated[:, 16:]")),
    ),
    # Issue 40's: the steady state differs from one run. Written with the steady oracle, before any GPU run.
    Workload(
        "transformer_lm_adamw_loop4_from_earlier_cell",
        "a 12-layer causal transformer LM of plain torch.nn (width 1024, vocab 32000, 217M) with AdamW, built in "
        "an earlier cell; the cell loops over 4 steps at sequence 128, the optimizer state appearing in the "
        "first; weights + gradients + AdamW state 0.54 of the cap",
        ("class CausalLM(nn.Module):\n"
         "    def __init__(self, vocab=32000, width=1024, layers=12, heads=16):\n"
         "        super().__init__()\n"
         "        self.embed = nn.Embedding(vocab, width)\n"
         "        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,\n"
         "                                           norm_first=True)\n"
         "        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)\n"
         "        self.head = nn.Linear(width, vocab)\n"
         "    def forward(self, tokens):\n"
         "        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)\n"
         "        return self.head(self.blocks(self.embed(tokens), mask=mask, is_causal=True))\n"
         "with torch.device(dev):\n"
         "    lm = CausalLM()\n"
         "opt = torch.optim.AdamW(lm.parameters(), lr=3e-4)\n",),
        "",
        "batch_size = {batch}\n"
        "for step in range(4):\n"
        "    tokens = torch.randint(0, 32000, (batch_size, 129), device=dev)\n"
        "    logits = lm(tokens[:, :-1])\n"
        "    loss = nn.functional.cross_entropy(logits.reshape(-1, 32000), tokens[:, 1:].reshape(-1))\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad(set_to_none=True)\n",
        small=(("vocab=32000, width=1024, layers=12, heads=16", "vocab=32000, width=32, layers=1, heads=2"),
               ("(batch_size, 129)", "(batch_size, 17)")),
    ),
    Workload(
        "lstm_classifier_adam_built_in_cell",
        "a 3-layer LSTM classifier (input 512, hidden 1536, 50M) over 128 steps, built with Adam in the failing "
        "cell: the last run's model, optimizer and outputs stay bound until the lines that bind them again",
        (),
        "",
        "batch_size = {batch}\n"
        "lstm = nn.LSTM(512, 1536, num_layers=3, batch_first=True).to(dev)\n"
        "head = nn.Linear(1536, 20).to(dev)\n"
        "opt = torch.optim.Adam([*lstm.parameters(), *head.parameters()], lr=1e-3)\n"
        "x = torch.randn(batch_size, 128, 512, device=dev)\n"
        "y = torch.randint(0, 20, (batch_size,), device=dev)\n"
        "out, _ = lstm(x)\n"
        "loss = nn.functional.cross_entropy(head(out[:, -1]), y)\n"
        "loss.backward()\n"
        "opt.step()\n",
        small=(("nn.LSTM(512, 1536, num_layers=3", "nn.LSTM(512, 32, num_layers=1"),
               ("nn.Linear(1536, 20)", "nn.Linear(32, 20)"), ("batch_size, 128, 512", "batch_size, 8, 512")),
    ),
    Workload(
        "t5_base_finetune_adamw_from_earlier_cell",
        "T5-base (223M) from T5Config, fp32, input 256 and target 64 tokens, one AdamW step; model and optimizer "
        "built in an earlier cell: the AdamW state (1.7 GiB) its first step makes is held by every later run",
        ("from transformers import T5Config, T5ForConditionalGeneration\n"
         "config = T5Config(d_model=768, d_ff=3072, num_layers=12, num_heads=12, d_kv=64, decoder_start_token_id=0,\n"
         "                  pad_token_id=0)\n"
         "with torch.device(dev):\n"
         "    model = T5ForConditionalGeneration(config)\n"
         "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)\n",),
        "",
        "batch_size = {batch}\n"
        "input_ids = torch.randint(0, config.vocab_size, (batch_size, 256), device=dev)\n"
        "labels = torch.randint(0, config.vocab_size, (batch_size, 64), device=dev)\n"
        "loss = model(input_ids=input_ids, labels=labels).loss\n"
        "loss.backward()\n"
        "optimizer.step()\n"
        "optimizer.zero_grad()\n",
        needs=("transformers",),
        small=(("d_model=768, d_ff=3072, num_layers=12, num_heads=12, d_kv=64,",
                "d_model=64, d_ff=128, num_layers=1, num_heads=2, d_kv=32,"),
               ("(batch_size, 256)", "(batch_size, 16)"), ("(batch_size, 64)", "(batch_size, 8)")),
    ),
    # Five written after the search's rules, to try it where it was never run (issue 40: "it will be tried on
    # workloads you have not seen"): fine-tunes in a loop, the regime the brief puts first.
    Workload(
        "gpt2_from_config_loop3_adamw_from_earlier_cell",
        "GPT-2 (12 layers, width 1024, 203M) from GPT2Config, fp32, AdamW, three steps at sequence 256 with the "
        "loss from labels; model and optimizer built in an earlier cell, the batch a name set in an earlier cell",
        ("from transformers import GPT2Config, GPT2LMHeadModel\n"
         "with torch.device(dev):\n"
         "    gpt = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=1024, n_head=16, n_positions=512))\n"
         "gpt.train()\n"
         "optimizer = torch.optim.AdamW(gpt.parameters(), lr=3e-4)\n",),
        "batch_size = {batch}\n",
        "for step in range(3):\n"
        "    tokens = torch.randint(0, 50257, (batch_size, 256), device=dev)\n"
        "    loss = gpt(input_ids=tokens, labels=tokens).loss\n"
        "    loss.backward()\n"
        "    optimizer.step()\n"
        "    optimizer.zero_grad()\n",
        needs=("transformers",),
        where="a name set in an earlier cell",
        small=(("n_layer=12, n_embd=1024, n_head=16, n_positions=512", "n_layer=1, n_embd=64, n_head=2, n_positions=64"),
               ("(batch_size, 256)", "(batch_size, 16)")),
    ),
    Workload(
        "qwen2_bf16_weights_adamw_loop2_from_earlier_cell",
        "a Qwen2-style causal LM (24 layers, width 1024, grouped-query attention, 302M) from Qwen2Config with "
        "bfloat16 weights, AdamW (its state bfloat16 too), two steps at sequence 1024; built in an earlier cell",
        ("from transformers import Qwen2Config, Qwen2ForCausalLM\n"
         "config = Qwen2Config(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16,\n"
         "                     num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048,\n"
         "                     tie_word_embeddings=True)\n"
         "with torch.device(dev):\n"
         "    lm = Qwen2ForCausalLM(config).to(torch.bfloat16)\n"
         "opt = torch.optim.AdamW(lm.parameters(), lr=1e-4)\n",),
        "",
        "batch_size = {batch}\n"
        "for _ in range(2):\n"
        "    ids = torch.randint(0, 32000, (batch_size, 1024), device=dev)\n"
        "    out = lm(input_ids=ids, labels=ids)\n"
        "    out.loss.backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad(set_to_none=True)\n",
        needs=("transformers",),
        small=(("num_hidden_layers=24", "num_hidden_layers=1"), ("(batch_size, 1024)", "(batch_size, 16)")),
    ),
    Workload(
        "roberta_sgd_momentum_loop_over_batches_from_earlier_cell",
        "RoBERTa-base (125M) from RobertaConfig for 3-way classification, SGD with momentum, a list of three "
        "batches at sequence 256 made in the cell and looped over; model and optimizer built in an earlier cell",
        ("from transformers import RobertaConfig, RobertaForSequenceClassification\n"
         "with torch.device(dev):\n"
         "    clf = RobertaForSequenceClassification(RobertaConfig(max_position_embeddings=514, num_labels=3))\n"
         "clf.train()\n"
         "sgd = torch.optim.SGD(clf.parameters(), lr=1e-3, momentum=0.9)\n",),
        "",
        "batch_size = {batch}\n"
        "batches = [(torch.randint(5, 50265, (batch_size, 256), device=dev),\n"
        "            torch.randint(0, 3, (batch_size,), device=dev)) for _ in range(3)]\n"
        "for ids, labels in batches:\n"
        "    loss = clf(input_ids=ids, labels=labels).loss\n"
        "    loss.backward()\n"
        "    sgd.step()\n"
        "    sgd.zero_grad()\n",
        needs=("transformers",),
        small=(("RobertaConfig(max_position_embeddings=514, num_labels=3)",
                "RobertaConfig(max_position_embeddings=514, num_labels=3, hidden_size=64, num_hidden_layers=1, "
                "num_attention_heads=2, intermediate_size=128)"), (", 256)", ", 16)")),
    ),
    Workload(
        "swin_clip_grad_scheduler_loop3_from_earlier_cell",
        "timm Swin-B (88M) at 224x224, fp32, AdamW with gradient clipping and a cosine schedule, three steps; "
        "model, optimizer and schedule built in an earlier cell, the batch a name set in an earlier cell",
        ("import timm\n"
         "swin = timm.create_model('swin_base_patch4_window7_224', pretrained=False, num_classes=100).to(dev)\n"
         "optimizer = torch.optim.AdamW(swin.parameters(), lr=1e-4, weight_decay=0.05)\n"
         "schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)\n",),
        "batch_size = {batch}\n",
        "for step in range(3):\n"
        "    images = torch.randn(batch_size, 3, 224, 224, device=dev)\n"
        "    labels = torch.randint(0, 100, (batch_size,), device=dev)\n"
        "    loss = nn.functional.cross_entropy(swin(images), labels)\n"
        "    optimizer.zero_grad(set_to_none=True)\n"
        "    loss.backward()\n"
        "    torch.nn.utils.clip_grad_norm_(swin.parameters(), 1.0)\n"
        "    optimizer.step()\n"
        "    schedule.step()\n",
        needs=("timm",),
        where="a name set in an earlier cell",
    ),
    Workload(
        "vit_b16_384_checkpointing_bf16_built_in_cell",
        "timm ViT-B/16 at 384x384 (577 tokens) with activation checkpointing under bf16 autocast, built with "
        "AdamW in the failing cell, two steps",
        ("import timm",),
        "",
        "model = timm.create_model('vit_base_patch16_384', pretrained=False, num_classes=10).to(dev)\n"
        "model.set_grad_checkpointing(True)\n"
        "opt = torch.optim.AdamW(model.parameters(), lr=1e-4)\n"
        "for step in range(2):\n"
        "    x = torch.randn({batch}, 3, 384, 384, device=dev)\n"
        "    y = torch.randint(0, 10, (x.shape[0],), device=dev)\n"
        "    with torch.autocast(dev, dtype=torch.bfloat16):\n"
        "        loss = nn.functional.cross_entropy(model(x), y)\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad(set_to_none=True)\n",
        needs=("timm",),
        where="a literal in a call in the cell",
    ),
    Workload(
        "distilbert_fp16_scaler_zero_grad_first_loop3_from_earlier_cell",
        "DistilBERT (66M) from DistilBertConfig for classification at sequence 512 under fp16 autocast with a "
        "GradScaler, AdamW, three steps that zero the gradients first (the last step's stay allocated); built "
        "in an earlier cell",
        ("from transformers import DistilBertConfig, DistilBertForSequenceClassification\n"
         "with torch.device(dev):\n"
         "    bert = DistilBertForSequenceClassification(DistilBertConfig(num_labels=2))\n"
         "opt = torch.optim.AdamW(bert.parameters(), lr=5e-5)\n"
         "scaler = torch.amp.GradScaler(dev)\n",),
        "batch_size = {batch}\n",
        "for step in range(3):\n"
        "    ids = torch.randint(0, 30522, (batch_size, 512), device=dev)\n"
        "    labels = torch.randint(0, 2, (batch_size,), device=dev)\n"
        "    opt.zero_grad()\n"
        "    with torch.autocast(dev, dtype=torch.float16):\n"
        "        loss = bert(input_ids=ids, labels=labels).loss\n"
        "    scaler.scale(loss).backward()\n"
        "    scaler.step(opt)\n"
        "    scaler.update()\n",
        needs=("transformers",),
        where="a name set in an earlier cell",
    ),
    Workload(
        "whisper_from_config_seq2seq_adamw_from_earlier_cell",
        "a Whisper-style speech seq2seq (12 + 12 layers, width 768, 240M) from WhisperConfig, fp32, AdamW, one "
        "step on 30 s of log-mel features and 64 target tokens; built in an earlier cell",
        ("from transformers import WhisperConfig, WhisperForConditionalGeneration\n"
         "config = WhisperConfig(d_model=768, encoder_layers=12, decoder_layers=12, encoder_attention_heads=12,\n"
         "                       decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072)\n"
         "with torch.device(dev):\n"
         "    asr = WhisperForConditionalGeneration(config)\n"
         "optimizer = torch.optim.AdamW(asr.parameters(), lr=1e-5)\n",),
        "",
        "batch_size = {batch}\n"
        "features = torch.randn(batch_size, 80, 3000, device=dev)\n"
        "labels = torch.randint(0, 50000, (batch_size, 64), device=dev)\n"
        "loss = asr(input_features=features, labels=labels).loss\n"
        "loss.backward()\n"
        "optimizer.step()\n"
        "optimizer.zero_grad()\n",
        needs=("transformers",),
    ),
    Workload(
        "opt_adafactor_loop2_from_earlier_cell",
        "an OPT-style causal LM (24 layers, width 1024, 356M) from OPTConfig, fp32, torch's Adafactor (its state "
        "factored, far smaller than the weights), two steps at sequence 512; built in an earlier cell",
        ("from transformers import OPTConfig, OPTForCausalLM\n"
         "config = OPTConfig(hidden_size=1024, num_hidden_layers=24, ffn_dim=4096, num_attention_heads=16,\n"
         "                   word_embed_proj_dim=1024, max_position_embeddings=2048)\n"
         "with torch.device(dev):\n"
         "    opt_lm = OPTForCausalLM(config)\n"
         "adafactor = torch.optim.Adafactor(opt_lm.parameters(), lr=1e-3)\n",),
        "",
        "batch_size = {batch}\n"
        "for _ in range(2):\n"
        "    tokens = torch.randint(0, 50272, (batch_size, 512), device=dev)\n"
        "    loss = opt_lm(input_ids=tokens, labels=tokens).loss\n"
        "    loss.backward()\n"
        "    adafactor.step()\n"
        "    adafactor.zero_grad()\n",
        needs=("transformers",),
    ),
)
WORKLOAD_NAMES = tuple(w.name for w in WORKLOADS)
QUICK_WORKLOADS = (
    "t5_base_finetune_adamw_from_earlier_cell",      # steady largest <= 10, fixed at half the cap
    "transformer_lm_adamw_loop4_from_earlier_cell",  # 11-64 expected, fixed at half the cap, a 4-step loop
    "convnext_fp16_grad_scaler",                     # > 64: a convnet under fp16 autocast with a GradScaler
    "lstm_classifier_adam_built_in_cell",            # the cell builds its model and optimizer again
)
"""``--quick``: one workload per regime and one that builds its model in the cell, the first GPU sweep."""


def missing_module(workload: Workload) -> str | None:
    """Why the workload cannot run here (its library does not import), or ``None``."""
    import importlib

    for module in workload.needs:
        try:
            importlib.import_module(module)
        except Exception as error:  # an import that fails in any way skips the workload, with its reason
            return f"{module} does not import: {type(error).__name__}: {str(error)[:200]}"
    return None


# -- searches: pure logic over "does batch b fit?" ------------------------------------------------
def largest_fitting(fits: Callable[[int], bool], first: int = ORACLE_FIRST_PROBE,
                    limit: int = ORACLE_MAX_BATCH) -> tuple[int, list[tuple[int, bool]]]:
    """The largest batch that fits, by doubling from ``first`` then bisection; with every probe
    (``bisect_batch.largest_fitting``: 0 when not even a batch of 1 fits, monotone fitting assumed)."""
    return bisect_batch.largest_fitting(fits, first, up=lambda batch: 2 * batch, limit=limit)


def steady_largest(runs_fitting: Callable[[int], int], single_run: int | None = None, bound: bool = False,
                   runs: int = STEADY_RUNS) -> tuple[int, list[tuple[int, int]]]:
    """The largest batch whose probe fits ``runs`` runs in a row, and every ``(batch, runs that fitted)``.

    ``runs_fitting(batch)`` runs the cell up to ``runs`` times in a fresh namespace, stopping at the first
    OOM. ``single_run``: the largest batch for one run, where known. With ``bound`` (measured on this
    device, cap and cells) the answer is at most it: the search starts there and never runs above it;
    without, it is a first guess (``HINT_STEP`` steps from it). With none, doubling from 16.
    """
    probes: list[tuple[int, int]] = []

    def fits(batch: int) -> bool:
        fitted = runs_fitting(batch)
        probes.append((batch, fitted))
        return fitted >= runs

    if single_run is None:
        found, _ = largest_fitting(fits)
        return found, probes
    if bound and single_run < 1:
        return 0, probes
    found, _ = bisect_batch.largest_fitting(
        fits, max(single_run, 1), up=lambda batch: max(int(batch * HINT_STEP), batch + 1),
        down=lambda batch: max(int(batch / HINT_STEP), 1) if batch > 1 else 0,
        limit=ORACLE_MAX_BATCH, failing=single_run + 1 if bound else None)
    return found, probes


def single_run_from_probes(probes: Iterable[tuple[int, int]]) -> int | None:
    """The largest batch whose first run fitted, where the probes pin it (its next batch up failed its
    first run); else ``None``. The first run of a steady probe is a single-run probe."""
    probes = list(probes)
    fitted = [batch for batch, runs in probes if runs >= 1]
    failed = [batch for batch, runs in probes if runs == 0]
    low = max(fitted, default=0)
    if failed and min(failed) == low + 1:
        return low
    return None


@dataclass
class PeerResult:
    """A peer finder's run: the batch it ended on (``None``: none fitted) and every try."""

    found_batch: int | None
    trail: list[tuple[int, bool]] = field(default_factory=list)
    error: str | None = None

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "found_batch": self.found_batch,
            "tries": len(self.trail),
            "reruns": max(len(self.trail) - 1, 0),
            "trail": [[batch, fitted] for batch, fitted in self.trail],
        }
        if self.error:
            out["error"] = self.error
        return out


class StartFitted(Exception):
    """The cell fitted at its start batch (the oracle's one run said otherwise): the case is void."""


class NotOutOfMemory(Exception):
    """A try failed with something other than an OOM: the search stops and the error is recorded."""


def halving(start: int, run: Callable[[int], bool]) -> PeerResult:
    """Start at ``start``; after each OOM try half the batch (floor), until one fits or 1 fails."""
    result = PeerResult(None)
    batch = start
    try:
        while batch >= 1:
            fitted = run(batch)
            result.trail.append((batch, fitted))
            if fitted:
                result.found_batch = batch
                break
            batch //= 2
    except NotOutOfMemory as error:
        result.error = str(error)
    return result


# The text accelerate's ``should_reduce_batch_size`` looks for in a RuntimeError's only argument.
ACCELERATE_OOM_TEXT = "CUDA out of memory."


def accelerate_search(start: int, run: Callable[[int], bool]) -> PeerResult:
    """accelerate's ``find_executable_batch_size`` with its defaults (x0.9 after each OOM), from ``start``.

    ``run(batch)`` returns whether the batch fitted; an OOM is handed to accelerate as a fresh
    RuntimeError worded as PyTorch's (accelerate matches the text), without the failed cell's frames.
    """
    from accelerate.utils import find_executable_batch_size

    result = PeerResult(None)

    @find_executable_batch_size(starting_batch_size=start)
    def train(batch_size: int) -> int:
        fitted = run(batch_size)
        result.trail.append((batch_size, fitted))
        if not fitted:
            raise RuntimeError(f"{ACCELERATE_OOM_TEXT} (the benchmark's cell at batch {batch_size})")
        return batch_size

    try:
        result.found_batch = train()
    except NotOutOfMemory as error:
        result.error = str(error)
    except RuntimeError as error:  # "No executable batch size found, reached zero."
        result.error = f"{type(error).__name__}: {error}"
    return result


# -- the batch search's states, for debugging it offline -------------------------------------------
TRACES_DIR: Path | None = None
"""``--traces DIR``: each ``%oomfix`` case's batch search, as it stood at each of its choices (its tries with
their recorded allocations, the segments and cap the next try starts from, the fixed memory read from the
namespace), pickled to ``DIR/<workload>_x<start>.pkl.gz``: ``copy.deepcopy`` of the ``BatchSearch``, so the
choice can be replayed on a CPU (``search.next()``) and the policy debugged on the GPU's own figures. Beside
it, ``DIR/<workload>_x<start>.tries.pkl.gz``: every try the fix ran, its last (a rerun confirming the batch)
included, as ``(batch, fitted, reason, recorded run)``, and the segments the fixed cell's next runs start
from (``growth.replay.StartSegment``): ``growth.fitting.fits_in_a_row(run.events, run.start, cap)``, with
the case's ``cap_bytes``, replays a try's next runs, to be held against the next runs the case recorded."""


@contextlib.contextmanager
def searches_kept() -> Any:
    """Every ``BatchSearch`` state at each ``next()`` while the block runs (empty unless ``--traces``)."""
    kept: list[Any] = []
    if TRACES_DIR is None:
        yield kept
        return
    from jupyter_cudamem.batchsearch import BatchSearch

    original = BatchSearch.next

    def next_kept(search: Any) -> Any:
        kept.append(copy.deepcopy(search))
        return original(search)

    BatchSearch.next = next_kept  # type: ignore[method-assign]
    try:
        yield kept
    finally:
        BatchSearch.next = original  # type: ignore[method-assign]


def keep_pickled(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wb") as file:
        pickle.dump(value, file)


def keep_tries(path: Path, outcome: Any, torch: Any, dev: str) -> None:
    """``%oomfix``'s tries with their recorded runs, and where its fixed cell's next runs start (``TRACES_DIR``)."""
    from jupyter_cudamem.sources.torch_trace import start_segments

    tries = [(t.batch, t.fitted, t.reason, t.recorded) for t in getattr(outcome, "tries", ()) or ()]
    segments = () if dev != "cuda" else start_segments({"segments": torch.cuda.memory_snapshot()},
                                                       torch.cuda.current_device())
    keep_pickled(path, {"tries": tries, "next_runs_start": segments})


# -- reading %oomfix's outcome ----------------------------------------------------------------------
def read_outcome(outcome: Any) -> dict[str, Any]:
    """What the benchmark takes from ``%oomfix -o``'s outcome, read defensively (the driver changes).

    Relied on: ``outcome.tries`` (a sequence; its length is the reruns), each try's ``batch`` (``None``
    for a try that changed no batch) and ``fitted``. The found batch is ``outcome.batch_after``, the batch
    the fixed cell has (below the largest try that fitted where that try's own run does not keep fitting),
    or the largest try that fitted where the outcome gives none. Recorded when present:
    ``strategy``, ``notes``, each try's ``strategy``, ``peak_bytes``, ``reason``, ``need_bytes``,
    ``left_bytes``, and its field naming the allocated memory at its start (``allocated_at_start_bytes``).
    """
    if outcome is None:
        return {"found_batch": None, "reruns": None, "error": "%oomfix returned no outcome"}
    tries = list(getattr(outcome, "tries", ()) or ())
    fitted_batches = [t.batch for t in tries if getattr(t, "fitted", False) and getattr(t, "batch", None) is not None]
    found = getattr(outcome, "batch_after", None) if getattr(outcome, "fitted", False) else None
    if found is None and fitted_batches:
        found = max(fitted_batches)
    record: dict[str, Any] = {
        "found_batch": found,
        "reruns": len(tries),
        "strategy": getattr(outcome, "strategy", None),
        "notes": [str(note) for note in getattr(outcome, "notes", ()) or ()],
        "fixed_source": getattr(outcome, "fixed_source", None),
        "tries": [],
    }
    for t in tries:
        entry = {
            "batch": getattr(t, "batch", None),
            "fitted": bool(getattr(t, "fitted", False)),
            "strategy": getattr(t, "strategy", None),
            "peak_bytes": getattr(t, "peak_bytes", None),
            "reason": str(getattr(t, "reason", "")),
        }
        if isinstance(getattr(t, "steady", None), bool):  # ran as the cell's next run will (the driver says)
            entry["steady"] = t.steady
        for name in ("allocated_at_start_bytes", "allocated_start_bytes", "allocated_before_bytes",
                     "start_allocated_bytes"):
            value = getattr(t, name, None)
            if isinstance(value, int):
                entry["allocated_at_start_bytes"] = value
                break
        for name in ("need_bytes", "left_bytes"):  # the driver's figures for the try, where it gives them
            value = getattr(t, name, None)
            if isinstance(value, int):
                entry[name] = value
        record["tries"].append(entry)
    return record


# -- one case ---------------------------------------------------------------------------------------
def start_batch(oracle: int, ratio: float) -> int:
    """The batch a case starts at: ``ratio`` times the oracle, rounded, and always above the oracle."""
    return max(int(round(ratio * oracle)), oracle + 1)


def run_case(bench: Any, workload: Workload, ratio: float, oracle: int,
             finders: Iterable[str] = FINDERS, single_run: int | None = None) -> dict[str, Any]:
    """One workload at one start ratio: ``%oomfix``, accelerate and halving (those of ``finders``) from
    the same start, each followed by the fixed cell's next runs.

    ``oracle`` is the steady one (``single_run`` the one-run largest, where known, for the record; the
    start's base where no batch keeps fitting). ``bench`` runs cells (``ShellBench`` on the GPU; a
    simulated one in the tests): ``oomfix(workload, start)`` returns ``read_outcome``'s record plus what
    it measured, its next runs included; ``peer(workload, start)`` is a context manager giving
    ``run(batch) -> fitted`` in one namespace, and ``next_runs_at(workload, batch)`` runs the cell again
    in it; ``release()`` frees everything and returns the allocated bytes above the baseline.
    """
    start = start_batch(oracle if oracle >= 1 else max(single_run or 1, 1), ratio)
    record: dict[str, Any] = {
        "workload": workload.name,
        "start_ratio": ratio,
        "start_batch": start,
        "oracle_batch": oracle,
        "oracle_runs": STEADY_RUNS,
        "single_run_oracle_batch": single_run,
    }
    finders = tuple(finders)
    if "oomfix" in finders:
        record.update(_run_oomfix(bench, workload, start, oracle))
    for name, search in (("accelerate", accelerate_search), ("halving", halving)):
        if name not in finders:
            continue
        started = time.perf_counter()
        try:
            with bench.peer(workload, start) as run:
                peer = search(start, run).record()
                if peer["found_batch"] is not None:
                    peer.update(bench.next_runs_at(workload, peer["found_batch"]))
        except ImportError as error:
            peer = {"found_batch": None, "tries": None, "error": f"not installed: {error}"}
        except Exception as error:
            peer = {"found_batch": None, "tries": None, "error": f"{type(error).__name__}: {error}"}
        peer.setdefault("next_runs_fit", None)
        peer["seconds"] = round(time.perf_counter() - started, 2)
        peer["allocated_after_above_baseline_bytes"] = bench.release()
        record[name] = peer
    leftovers = [record[key]["allocated_after_above_baseline_bytes"] for key in FINDERS if key in record]
    record["memory_back_to_baseline"] = all(abs(v) <= BASELINE_TOLERANCE_BYTES for v in leftovers if v is not None)
    return record


def next_runs_record(fitted: list[bool], error: str | None, runs: int = NEXT_RUNS,
                     seconds: float | None = None) -> dict[str, Any]:
    """A finder's next runs as recorded: each run's outcome, whether all ``runs`` fitted, how many did."""
    record: dict[str, Any] = {"next_runs": list(fitted), "next_runs_fit": len(fitted) == runs and all(fitted),
                              "next_runs_fitted": sum(fitted)}
    if error is not None:
        record["next_runs_error"] = error
    if seconds is not None:
        record["next_runs_seconds"] = round(seconds, 2)
    return record


def _run_oomfix(bench: Any, workload: Workload, start: int, oracle: int) -> dict[str, Any]:
    """``%oomfix`` from ``start``: the case's fields it fills (and the chunk oracle where it chunked)."""
    record: dict[str, Any] = {}
    started = time.perf_counter()
    try:
        ours = bench.oomfix(workload, start)
    except StartFitted as error:
        ours = {"found_batch": None, "reruns": None, "error": str(error)}
        record["void"] = str(error)
    except Exception as error:  # a case that breaks is recorded; the sweep goes on
        ours = {"found_batch": None, "reruns": None, "error": f"{type(error).__name__}: {error}",
                "traceback": traceback.format_exc()[-2000:]}
    ours["seconds"] = round(time.perf_counter() - started, 2)
    ours["allocated_after_above_baseline_bytes"] = bench.release()
    record["found_batch"] = ours.pop("found_batch")
    record["reruns"] = ours.pop("reruns")
    record["next_runs_fit"] = ours.get("next_runs_fit")
    record["next_runs_fitted"] = ours.get("next_runs_fitted")
    template = chunk_template(ours.get("notes") or [], ours.get("fixed_source"), record["found_batch"])
    if template is not None:
        # The fix kept every row and shrank the chunk: the batch it found is a chunk of the start's
        # data, and the largest chunk that keeps fitting over that data is what it is measured against.
        started_oracle = time.perf_counter()
        chunk, probes = steady_largest(
            lambda rows: bench.runs_fitting(workload, start, cell=template.replace(CHUNK_SLOT, str(rows))),
            single_run=record["found_batch"])
        bench.release()
        record.update(oracle_batch=chunk, unchunked_oracle_batch=oracle,
                      oracle_kind="the largest chunk that keeps fitting over the start's whole data (the fix chunks it)",
                      chunk_oracle_probes=[[b, f] for b, f in probes],
                      chunk_oracle_seconds=round(time.perf_counter() - started_oracle, 2))
    record["oomfix"] = ours
    oracle_here = record.get("oracle_batch", oracle)
    record["found_fraction"] = (None if oracle_here < 1 else round(record["found_batch"] / oracle_here, 4)
                                if record["found_batch"] else 0.0)
    return record


CHUNK_SLOT = "{rows per chunk}"


def chunk_template(notes: list[str], fixed_source: str | None, found: int | None) -> str | None:
    """The cell ``%oomfix`` wrote when it chunked the whole data (its note says so), with the chunk size
    it found replaced by ``CHUNK_SLOT``; ``None`` when it did not chunk."""
    from jupyter_cudamem.oomfix.whole_data import CHUNKED_NOTE

    if not fixed_source or not found or not any(note.startswith(CHUNKED_NOTE) for note in notes):
        return None
    written = f".split({found})"
    if written not in fixed_source:
        return None
    return fixed_source.replace(written, f".split({CHUNK_SLOT})")


# -- what does not grow with the batch: weights, gradients, optimizer state -------------------------
def held_by_models(namespace: Mapping[str, Any], dev: str) -> dict[str, int]:
    """The bytes on ``dev`` that the namespace's ``torch.nn.Module``s and ``torch.optim.Optimizer``s hold,
    each storage counted once (tied weights, a module inside another, a parameter in two groups).

    ``weights_bytes``: parameters and buffers; ``gradients_bytes``: the ``.grad`` tensors present;
    ``gradients_set_to_none_bytes``: the parameters an optimizer trains whose ``.grad`` the cell set to
    ``None`` after its step (``zero_grad()``; they held a gradient of their own size at the step);
    ``optimizer_state_bytes``: the tensors of every optimizer's ``state``; ``fixed_bytes``: their sum.
    Names starting with ``_`` (IPython's output cache) are not looked at.
    """
    import torch

    values = [value for name, value in namespace.items() if not name.startswith("_")]
    modules = [v for v in values if isinstance(v, torch.nn.Module)]
    optimizers = [v for v in values if isinstance(v, torch.optim.Optimizer)]
    seen: set[int] = set()

    def new_bytes(tensor: Any) -> int:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != dev:
            return 0
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            return 0
        seen.add(storage.data_ptr())
        return int(storage.nbytes())

    trained = [p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]]
    parameters = [*(p for m in modules for p in m.parameters()), *trained]
    weights = sum(new_bytes(t) for t in [*parameters, *(b for m in modules for b in m.buffers())])
    gradients = sum(new_bytes(p.grad) for p in parameters if p.grad is not None)
    set_to_none = 0
    counted_to_none: set[int] = set()
    for p in trained:
        if p.grad is None and p.requires_grad and p.device.type == dev and id(p) not in counted_to_none:
            counted_to_none.add(id(p))
            set_to_none += p.numel() * p.element_size()
    state = sum(new_bytes(t) for optimizer in optimizers for entry in optimizer.state.values()
                for t in entry.values())
    return {"fixed_bytes": weights + gradients + set_to_none + state, "weights_bytes": weights,
            "gradients_bytes": gradients, "gradients_set_to_none_bytes": set_to_none,
            "optimizer_state_bytes": state}


# -- the real bench: an IPython shell on the GPU --------------------------------------------------
def _forget_failure(shell: Any, error: BaseException | None) -> None:
    """Drop every reference IPython, ``sys`` and the extension's failure record keep to a failed cell's
    exception (and so its frames). The record is kept for ``%oomfix``; a next run that failed otherwise
    keeps its tensors through the runs after it (on the H200, 5.7 GB stayed allocated after one did)."""
    from jupyter_cudamem.ipython_state import recorder_for

    if error is not None:
        traceback.clear_frames(error.__traceback__)
    recorder = recorder_for(shell)
    if recorder is not None:
        recorder.forget()
    for name in ("last_exc", "last_value", "last_traceback", "last_type"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    for owner, name in ((shell, "_last_traceback"), (getattr(shell, "InteractiveTB", None), "tb")):
        if owner is not None and hasattr(owner, name):
            setattr(owner, name, None)
    if hasattr(shell, "last_execution_result"):
        shell.last_execution_result = None


def _is_oom(error: BaseException) -> bool:
    return type(error).__name__ == "OutOfMemoryError" or "out of memory" in str(error).lower()


class ShellBench:
    """Runs a workload's cells in one ``InteractiveShell`` with the extension loaded, on ``dev``."""

    def __init__(self, dev: str = "cuda", hardware: Any = None, allocated: Callable[[], int] | None = None,
                 inject: Mapping[str, Any] | None = None) -> None:
        """``hardware`` is what the extension measures with (default: the real GPU); ``allocated``
        reads the allocated bytes (default: ``torch.cuda.memory_allocated``; 0 on CPU); ``inject``
        names put in the namespace before the setup cells. The last three let the CPU tests drive the
        real shell and ``%oomfix`` against a simulated card."""
        import torch
        from IPython.core.interactiveshell import InteractiveShell

        self.torch = torch
        self.dev = dev
        self.hardware = hardware
        self.read_allocated = allocated
        self.inject = dict(inject or {})
        self.shell = InteractiveShell.instance()
        self.output = io.StringIO()
        self.allocated_at_cell_start: list[int] = []
        self.held_after_runs: dict[int, dict[str, int]] = {}
        self.shell.events.register("pre_run_cell", self._note_allocated)
        self.baseline = self._allocated()

    def close(self) -> None:
        """Free everything and stop listening to the shell (it is the process's singleton)."""
        self.release()
        try:
            self.shell.events.unregister("pre_run_cell", self._note_allocated)
        except ValueError:
            pass

    def _allocated(self) -> int:
        if self.read_allocated is not None:
            return int(self.read_allocated())
        return int(self.torch.cuda.memory_allocated()) if self.dev == "cuda" else 0

    def _note_allocated(self, info: Any = None) -> None:
        self.allocated_at_cell_start.append(self._allocated())

    def run(self, source: str, store_history: bool = False) -> BaseException | None:
        """Run one cell; its output goes to ``self.output``; return its exception, or ``None``."""
        with contextlib.redirect_stdout(self.output), contextlib.redirect_stderr(self.output):
            result = self.shell.run_cell(source, store_history=store_history)
        return result.error_before_exec or result.error_in_exec

    def release(self) -> int:
        """Reset the namespace, unload the extension, free; return allocated bytes above the baseline."""
        from jupyter_cudamem import magics

        extension = magics.loaded(self.shell)
        with contextlib.redirect_stdout(self.output), contextlib.redirect_stderr(self.output):
            self.shell.run_line_magic("reset", "-f")
            magics.unload(self.shell)
        if extension is not None:
            # IPython's magics registry keeps an unloaded magics instance: drop what ours holds.
            for instance in extension.magics:
                if hasattr(instance, "last_outcome"):
                    instance.last_outcome = None
                self.shell.magics_manager.registry.pop(type(instance).__name__, None)
            del extension
        _forget_failure(self.shell, None)
        if self._allocated() > self.baseline + BASELINE_TOLERANCE_BYTES:
            gc.collect()  # %reset collected already; again only if something is still held (a collection costs 0.1-0.4 s)
        if self.dev == "cuda":
            self.torch.cuda.synchronize()
            # cuBLAS keeps a workspace per handle in the caching allocator; it is not the cell's memory.
            clear_workspaces = getattr(self.torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:
                clear_workspaces()
            self.torch.cuda.empty_cache()
        self.output = io.StringIO()
        return self._allocated() - self.baseline

    def _setup(self, workload: Workload, store_history: bool = False) -> None:
        self.shell.user_ns.update(self.inject)
        for cell in workload.setup_cells(self.dev):
            error = self.run(cell, store_history=store_history)
            if error is not None:
                raise RuntimeError(f"a setup cell failed: {type(error).__name__}: {str(error)[:300]}\n"
                                   f"{self.output.getvalue()[-1500:]}")

    def fits(self, workload: Workload, batch: int) -> bool:
        """A single-run probe: fresh namespace, setup, knob and cell at ``batch``."""
        return self.runs_fitting(workload, batch, runs=1) == 1

    def runs_fitting(self, workload: Workload, batch: int, runs: int = STEADY_RUNS, cell: str | None = None) -> int:
        """An oracle probe: fresh namespace, setup, the knob at ``batch``, then ``cell`` (the workload's at
        ``batch`` by default, or a form of it) up to ``runs`` times in a row; how many ran before the first
        OOM. Where all fit, what the models and optimizers hold is kept in ``held_after_runs[batch]``."""
        cell = workload.cell_at(batch, self.dev) if cell is None else cell
        try:
            self._setup(workload)
            knob = workload.knob_at(batch, self.dev)
            if knob and self.run(knob) is not None:
                raise RuntimeError(f"the knob cell failed at batch {batch}: {self.output.getvalue()[-1500:]}")
            for fitted in range(runs):
                error = self.run(cell)
                if error is not None and not _is_oom(error):
                    raise RuntimeError(f"the cell failed at batch {batch} (run {fitted + 1}): "
                                       f"{type(error).__name__}: {str(error)[:300]}")
                if error is not None:
                    del error
                    return fitted
            self.held_after_runs[batch] = held_by_models(self.shell.user_ns, self.dev)
            return runs
        finally:
            self.release()

    def next_runs(self, cell: str, runs: int = NEXT_RUNS) -> dict[str, Any]:
        """``cell`` run ``runs`` more times in this namespace, as the user runs the fixed cell again: the
        record's ``next_runs`` (each run fitted or not), ``next_runs_fit``, ``next_runs_fitted``. A failed
        run's exception is dropped before the next; an error that is not an OOM stops them."""
        started = time.perf_counter()
        fitted: list[bool] = []
        error_text = None
        for _ in range(runs):
            error = self.run(cell)
            fitted.append(error is None)
            if error is None:
                continue
            oom = _is_oom(error)
            error_text = f"{type(error).__name__}: {str(error)[:300]}"
            _forget_failure(self.shell, error)
            del error
            if self._allocated() > self.baseline + BASELINE_TOLERANCE_BYTES:
                gc.collect()
            if self.dev == "cuda":
                self.torch.cuda.empty_cache()
            if not oom:
                break
        return next_runs_record(fitted, error_text, runs, time.perf_counter() - started)

    def fixed(self, workload: Workload, batch: int) -> dict[str, int]:
        """``held_by_models`` after the cell ran at ``batch`` (one that fits) in a fresh namespace."""
        try:
            self._setup(workload)
            knob = workload.knob_at(batch, self.dev)
            if knob and self.run(knob) is not None:
                raise RuntimeError(f"the knob cell failed at batch {batch}: {self.output.getvalue()[-1500:]}")
            error = self.run(workload.cell_at(batch, self.dev))
            if error is not None:
                raise RuntimeError(f"the cell did not fit at batch {batch}: {type(error).__name__}: {str(error)[:300]}")
            return held_by_models(self.shell.user_ns, self.dev)
        finally:
            self.release()

    def oomfix(self, workload: Workload, start: int) -> dict[str, Any]:
        """Fail the cell at ``start`` as a plain cell, then ``%oomfix --yes -o``; the outcome's record."""
        from jupyter_cudamem import magics

        # As a notebook does: the extension loaded first, every cell in IPython's history.
        with contextlib.redirect_stdout(self.output), contextlib.redirect_stderr(self.output):
            magics.load(self.shell, self.hardware)
        self._setup(workload, store_history=True)
        knob = workload.knob_at(start, self.dev)
        if knob:
            error = self.run(knob, store_history=True)
            if error is not None:
                raise RuntimeError(f"the knob cell failed: {error!r}")
        # The user runs the cell until it fails: a start between the steady and the single-run largest
        # fits its first run and runs out of memory on a later one.
        for start_runs_fitted in range(STEADY_RUNS):
            self.allocated_at_cell_start = []
            error = self.run(workload.cell_at(start, self.dev), store_history=True)
            if error is not None:
                break
        if error is None:
            raise StartFitted(f"the cell fitted {STEADY_RUNS} runs in a row at its start batch {start}: nothing to fix")
        if not _is_oom(error):
            raise RuntimeError(f"the cell failed otherwise at {start}: {type(error).__name__}: {str(error)[:300]}")
        first_line = str(error).splitlines()[0][:300]
        del error
        at_failed_cell = list(self.allocated_at_cell_start)
        self.allocated_at_cell_start = []
        with contextlib.redirect_stdout(self.output), contextlib.redirect_stderr(self.output), \
                searches_kept() as searches:
            outcome = self.shell.run_line_magic("oomfix", "--yes -o")
        record = read_outcome(outcome)
        if TRACES_DIR is not None:
            keep_pickled(TRACES_DIR / f"{workload.name}_x{start}.pkl.gz", searches)
            keep_tries(TRACES_DIR / f"{workload.name}_x{start}.tries.pkl.gz", outcome, self.torch, self.dev)
        record["failed_cell_error"] = first_line
        record["allocated_when_failed_cell_started_bytes"] = at_failed_cell[0] if at_failed_cell else None
        record["allocated_at_each_try_start_bytes"] = list(self.allocated_at_cell_start)
        if at_failed_cell and self.allocated_at_cell_start:
            # The issue's "a failed try leaves nothing": each try should start where the failed cell did.
            record["most_held_at_a_try_start_above_failed_cell_bytes"] = max(
                a - at_failed_cell[0] for a in self.allocated_at_cell_start)
        record["start_runs_fitted"] = start_runs_fitted
        del outcome
        if record.get("fixed_source"):
            record.update(self.next_runs(record["fixed_source"]))
        record["printed_tail"] = self.output.getvalue()[-1500:]
        return record

    @contextlib.contextmanager
    def peer(self, workload: Workload, start: int) -> Any:
        """A namespace for a peer's loop: setup once; each ``run(batch)`` runs knob and cell at ``batch``,
        and a failed one is forgotten as a function's locals would be."""
        self._setup(workload)

        def run(batch: int) -> bool:
            before = dict(self.shell.user_ns)
            allocated_before = self._allocated()
            knob = workload.knob_at(batch, self.dev)
            error = self.run(knob) if knob else None
            if error is None:
                error = self.run(workload.cell_at(batch, self.dev))
            if error is None:
                del before
                return True
            oom = _is_oom(error)
            summary = f"{type(error).__name__}: {str(error)[:300]}"
            _forget_failure(self.shell, error)
            del error
            namespace = self.shell.user_ns
            for name in [n for n in namespace if n not in before and not n.startswith("_")]:
                del namespace[name]
            for name, value in before.items():
                if namespace.get(name) is not value and not name.startswith("_"):
                    namespace[name] = value
            del before
            if self._allocated() > allocated_before + BASELINE_TOLERANCE_BYTES:
                gc.collect()  # only when a cycle still holds the failed try's tensors: a collection is slow
            if self.dev == "cuda":
                self.torch.cuda.empty_cache()
            if not oom:
                raise NotOutOfMemory(summary)
            return False

        yield run

    def next_runs_at(self, workload: Workload, batch: int) -> dict[str, Any]:
        """A peer's next runs: the cell at the batch it ended on, in its namespace (the knob set there)."""
        return self.next_runs(workload.cell_at(batch, self.dev))


# -- results: parts, merging, summary ----------------------------------------------------------------
def select_part(names: Iterable[str], part: str) -> list[str]:
    """Workloads of part ``K/N``: every N-th from the K-th (so slow and quick ones spread over parts)."""
    try:
        k_text, n_text = part.split("/")
        k, n = int(k_text), int(n_text)
    except ValueError:
        raise ValueError(f"--part takes K/N, e.g. 1/3; got {part!r}") from None
    if not 1 <= k <= n:
        raise ValueError(f"--part {part}: K must be between 1 and N")
    return list(names)[k - 1::n]


def merge(existing: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any]:
    """``new`` (one part's results) merged into ``existing``: its cases replace those of the same workload
    and start ratio, its workloads' oracles replace theirs; a workload's other cases stay where they were
    judged by the same oracle (the same batch and runs in a row) and go where not; the part's timing is
    added under its name.

    A case of ``new`` that lacks a finder (the part ran ``--finders oomfix``, or only the peers) keeps
    that finder's record from ``existing``'s case of the same workload, start ratio and start batch; a
    peer's record says when it was measured (``measured``): the peers do not depend on this project's
    code, so a run of ``%oomfix`` alone is set against peers measured earlier on the same cases.
    """
    merged: dict[str, Any] = dict(existing or {})
    earlier_date = merged.get("date")
    earlier = {(c.get("workload"), c.get("start_ratio")): c for c in merged.get("cases", [])}
    for key in ("device", "versions", "date", "cap_bytes", "ratios"):
        if key in new:
            merged[key] = new[key]
    new_workloads = new.get("workloads", {})
    merged["workloads"] = {**(merged.get("workloads") or {}), **new_workloads}
    cases = []
    for case in new.get("cases", []):
        before = earlier.get((case.get("workload"), case.get("start_ratio")))
        if before is not None and before.get("start_batch") == case.get("start_batch"):
            case = _with_earlier_finders(case, before, earlier_date)
        cases.append(case)
    replaced = {(c.get("workload"), c.get("start_ratio")) for c in cases}

    def stays(case: Mapping[str, Any]) -> bool:
        name = case.get("workload")
        if name not in new_workloads:
            return True
        info = new_workloads[name]
        return ((name, case.get("start_ratio")) not in replaced and info.get("oracle_batch") is not None
                and _workload_oracle(case) == (info["oracle_batch"], info.get("oracle_runs", 1)))

    merged["cases"] = [c for c in merged.get("cases", []) if stays(c)] + cases
    merged["parts"] = {**(merged.get("parts") or {}), **(new.get("parts") or {})}
    return merged


def _workload_oracle(case: Mapping[str, Any]) -> tuple[int, int]:
    """The workload's oracle a case was judged by (not a chunk's), and its runs in a row (1 before issue 40)."""
    return case.get("unchunked_oracle_batch", case.get("oracle_batch")), case.get("oracle_runs", 1)


OOMFIX_FIELDS = ("found_batch", "reruns", "found_fraction", "void", "oomfix", "unchunked_oracle_batch", "oracle_kind",
                 "chunk_oracle_probes", "chunk_oracle_seconds", "next_runs_fit", "next_runs_fitted")
"""A case's fields that ``%oomfix``'s run fills (``oracle_batch`` too, where it chunked the data)."""


def _with_earlier_finders(case: Mapping[str, Any], before: Mapping[str, Any], earlier_date: str | None) -> dict[str, Any]:
    """``case`` with the finders it did not run taken from ``before``, the same case run earlier."""
    case = dict(case)
    for peer in PEERS:
        if peer not in case and peer in before:
            case[peer] = {"measured": earlier_date, **before[peer]}
    if "oomfix" not in case and "oomfix" in before:
        case.update({key: before[key] for key in OOMFIX_FIELDS if key in before})
        case["oracle_batch"] = before["oracle_batch"]
    if "memory_back_to_baseline" in before:
        case["memory_back_to_baseline"] = case.get("memory_back_to_baseline") is not False and bool(
            before["memory_back_to_baseline"])
    return case


def _fractions(cases: list[Mapping[str, Any]], finder: str) -> list[float]:
    out = []
    for case in cases:
        if not _ran(case, finder) or not _judged(case):
            continue  # a part that ran without this finder; a case where no batch keeps fitting
        found = case.get("found_batch") if finder == "oomfix" else (case.get(finder) or {}).get("found_batch")
        # The peers shrink the data itself, not a chunk of it: the workload's own oracle is theirs.
        oracle = case["oracle_batch"] if finder == "oomfix" else case.get("unchunked_oracle_batch", case["oracle_batch"])
        out.append((found or 0) / oracle)
    return out


def _judged(case: Mapping[str, Any]) -> bool:
    """Whether some batch keeps fitting (a steady oracle of 0: the cell cannot run again as written)."""
    return bool(case.get("oracle_batch")) and bool(case.get("unchunked_oracle_batch", case.get("oracle_batch")))


def _ran(case: Mapping[str, Any], finder: str) -> bool:
    """Whether ``finder`` ran on ``case`` (a part may run only some: ``--finders``)."""
    return "found_batch" in case or "oomfix" in case if finder == "oomfix" else finder in case


def _counts(cases: list[Mapping[str, Any]], finder: str) -> list[int]:
    if finder == "oomfix":
        return [c["reruns"] for c in cases if c.get("reruns") is not None]
    return [c[finder]["reruns"] for c in cases if (c.get(finder) or {}).get("reruns") is not None]


def _next_runs(case: Mapping[str, Any], finder: str) -> bool | None:
    """Whether the finder's fixed cell ran ``NEXT_RUNS`` more times without an OOM (``None``: not run)."""
    record = case if finder == "oomfix" else case.get(finder) or {}
    return record.get("next_runs_fit")


def _label(case: Mapping[str, Any]) -> str:
    return f"{case['workload']} x{case['start_ratio']:g}"


def is_steady(case: Mapping[str, Any]) -> bool:
    """Judged by the steady-state oracle (issue 40); the sweeps before it have no ``oracle_runs``."""
    return case.get("oracle_runs", 1) >= STEADY_RUNS


def regime(case: Mapping[str, Any]) -> str:
    """The case's regime by its largest fitting batch (the one ``%oomfix`` is measured against)."""
    oracle = case["oracle_batch"]
    return next(label for low, high, label in REGIMES if oracle >= low and (high is None or oracle <= high))


def fixed_share(case: Mapping[str, Any]) -> str:
    """``fixed >= 0.5`` where weights + gradients + optimizer state are half the cap or more."""
    fixed, cap = case.get("fixed_bytes"), case.get("cap_bytes")
    if not fixed or not cap:
        return "fixed unknown"
    return f"fixed >= {FIXED_SHARE:g} of cap" if fixed / cap >= FIXED_SHARE else f"fixed < {FIXED_SHARE:g} of cap"


def goal_misses(case: Mapping[str, Any]) -> list[str]:
    """How the case misses issue 40's goal for ``%oomfix`` (empty when it meets it): the fixed cell's next
    runs fit (a steady case); found >= largest - 1 (and at least 1) where the largest fitting batch is
    ``SMALL_LARGEST`` or less, else >= ``GOAL_FRACTION`` of it; found/largest not below halving's in the
    same case, where halving's own next runs fit (a batch that does not keep fitting is no bar); at most
    ``GOAL_RERUNS`` reruns. Where no batch keeps fitting, only the next runs and the reruns are judged."""
    oracle, found = case["oracle_batch"], case.get("found_batch") or 0
    misses = []
    if is_steady(case) and case.get("next_runs_fit") is not True:
        fitted = case.get("next_runs_fitted")
        misses.append(f"next runs: {fitted} of {NEXT_RUNS} fitted" if fitted is not None
                      else "next runs not run (nothing fitted)")
    if not _judged(case):
        pass
    elif oracle <= SMALL_LARGEST:
        if found < max(oracle - 1, 1):
            misses.append(f"found {found} where {oracle} fits (needs >= {max(oracle - 1, 1)})")
    elif found < GOAL_FRACTION * oracle:
        misses.append(f"found {found} where {oracle} fits ({found / oracle:.2f} < {GOAL_FRACTION:.2f})")
    halving_record = case.get("halving")
    if _judged(case) and isinstance(halving_record, Mapping) and halving_record.get("found_batch") is not None \
            and halving_record.get("next_runs_fit") is not False:
        ours, halving_fraction = _fractions([case], "oomfix")[0], _fractions([case], "halving")[0]
        if ours < halving_fraction:
            misses.append(f"below halving ({ours:.2f} < {halving_fraction:.2f}, halving found "
                          f"{halving_record['found_batch']})")
    reruns = case.get("reruns")
    if reruns is None or reruns > GOAL_RERUNS:
        misses.append(f"{reruns} reruns" if reruns is not None else "no reruns recorded (%oomfix failed)")
    return misses


def _by_regime(cases: list[Mapping[str, Any]], key: Callable[[Mapping[str, Any]], str],
               labels: Iterable[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label in labels:
        chosen = [c for c in cases if key(c) == label]
        if not chosen:
            continue
        out[label] = {"cases": len(chosen)}
        for finder in FINDERS:
            fractions = _fractions(chosen, finder)
            out[label][finder] = ({"min": round(min(fractions), 3), "median": round(statistics.median(fractions), 3)}
                                  if fractions else {"min": None, "median": None})
            out[label][finder]["next_runs_failed"] = sum(_next_runs(c, finder) is False for c in chosen)
    return out


def summarize(results: Mapping[str, Any]) -> dict[str, Any]:
    """Per finder: found/oracle min, median and max, cases at ``GOAL_FRACTION`` or better, reruns, next
    runs that ran out of memory; by regime; issue 40's goal per case.

    A case where a finder found nothing counts as 0; a void case (the cell kept fitting at its start, so
    the oracle's runs were wrong there) is left out and listed; a case where no batch keeps fitting
    (steady oracle 0) is listed and judged only by its next runs and reruns.
    """
    void = [c for c in results.get("cases", []) if c.get("void")]
    cases = [c for c in results.get("cases", []) if c.get("oracle_batch") is not None and not c.get("void")]
    judged = [c for c in cases if _judged(c)]
    steady = sum(is_steady(c) for c in cases)
    summary: dict[str, Any] = {
        "cases": len(judged), "void_cases": [_label(c) for c in void],
        "oracle": ("steady" if steady == len(cases) else "single-run" if steady == 0 else "mixed"),
        "single_run_oracle_cases": len(cases) - steady,
        "no_batch_keeps_fitting": [_label(c) for c in cases if not _judged(c)],
    }
    for finder in FINDERS:
        fractions = _fractions(judged, finder)
        reruns = _counts(cases, finder)
        summary[finder] = {
            "found_over_oracle_min": round(min(fractions), 3) if fractions else None,
            "found_over_oracle_median": round(statistics.median(fractions), 3) if fractions else None,
            "found_over_oracle_max": round(max(fractions), 3) if fractions else None,
            "cases_at_goal": sum(f >= GOAL_FRACTION for f in fractions),
            "reruns_min": min(reruns) if reruns else None,
            "reruns_median": statistics.median(reruns) if reruns else None,
            "reruns_max": max(reruns) if reruns else None,
            "next_runs_measured": sum(_next_runs(c, finder) is not None for c in cases),
            "next_runs_failed": [_label(c) for c in cases if _next_runs(c, finder) is False],
        }
    ours = [c for c in judged if _ran(c, "oomfix")]
    summary["oomfix"]["cases_below_goal"] = [
        f"{_label(c)}: {f:.2f}" for c, f in zip(ours, _fractions(ours, "oomfix")) if f < GOAL_FRACTION
    ]
    summary["oomfix"]["cases_over_3_reruns"] = sum(r > 3 for r in _counts(cases, "oomfix"))
    held = [(c["oomfix"].get("most_held_at_a_try_start_above_failed_cell_bytes"), c) for c in cases
            if isinstance(c.get("oomfix"), Mapping)]
    held = [(value, c) for value, c in held if value is not None]
    if held:
        value, case = max(held, key=lambda pair: pair[0])
        summary["oomfix"]["most_held_at_a_try_start_mib"] = {
            "mib": round(value / 2**20, 1), "case": _label(case),
            "cases_over_2_mib": sum(v > BASELINE_TOLERANCE_BYTES for v, _ in held)}
    summary["cases_memory_not_back"] = [_label(c) for c in cases if c.get("memory_back_to_baseline") is False]
    summary["by_largest"] = _by_regime(judged, regime, [label for _, _, label in REGIMES])
    summary["by_fixed_share"] = _by_regime(judged, fixed_share, sorted({fixed_share(c) for c in judged}))
    misses = {_label(c): goal_misses(c) for c in cases if _ran(c, "oomfix")}
    median = summary["oomfix"]["found_over_oracle_median"]
    summary["goal"] = {
        "cases_checked": len(misses),
        "cases_missing": {label: reasons for label, reasons in misses.items() if reasons},
        "median_at_least": GOAL_MEDIAN,
        "median_met": median is not None and median >= GOAL_MEDIAN,
        "met": (bool(misses) and not any(misses.values()) and median is not None and median >= GOAL_MEDIAN
                and summary["oracle"] == "steady"),
    }
    return summary


ORACLE_WORDS = {
    "steady": f"found / the steady-state oracle (the largest batch that runs {STEADY_RUNS} times in a row)",
    "single-run": "found / the OLD single-run oracle (the largest batch for one run, before issue 40): "
                  "not the steady state, and no next runs were measured",
    "mixed": "found / oracle: MIXED, some cases judged by the old single-run oracle (see below)",
}


def summary_text(summary: Mapping[str, Any]) -> str:
    lines = [f"{summary['cases']} cases; {ORACLE_WORDS[summary.get('oracle', 'single-run')]}",
             f"finder       found/oracle min  median  max   at >= 0.90   reruns min/median/max  next {NEXT_RUNS} runs OOM"]
    for finder in FINDERS:
        s = summary[finder]
        measured = s.get("next_runs_measured", 0)
        lines.append(
            f"{finder:<12} {s['found_over_oracle_min']!s:>16} {s['found_over_oracle_median']!s:>7} "
            f"{s['found_over_oracle_max']!s:>5}   {s['cases_at_goal']:>3} of {summary['cases']:<4}  "
            f"{str(s['reruns_min']) + '/' + str(s['reruns_median']) + '/' + str(s['reruns_max']):<22}"
            + (f"  {len(s['next_runs_failed'])} of {measured}" if measured else "  not measured")
        )
    below = summary["oomfix"]["cases_below_goal"]
    lines.append("%oomfix below 0.90: " + ("; ".join(below) if below else "none"))
    failed = summary["oomfix"].get("next_runs_failed") or []
    if failed:
        lines.append("%oomfix's fixed cell ran out of memory on a next run: " + "; ".join(failed))
    held = summary["oomfix"].get("most_held_at_a_try_start_mib")
    if held:
        lines.append(f"%oomfix: most held at a try's start above the failed cell's start {held['mib']} MiB "
                     f"({held['case']}); cases over 2 MiB: {held['cases_over_2_mib']}")
    which = "steady largest" if summary.get("oracle") == "steady" else "largest fitting"
    for title, key in ((f"by {which} batch", "by_largest"), ("by weights + gradients + optimizer state",
                                                            "by_fixed_share")):
        if summary.get(key):
            lines.append(f"found/oracle min/median (next runs that ran out of memory) {title}:")
            for label, row in summary[key].items():
                lines.append(f"  {label:<22} {row['cases']:>3} cases  " + "  ".join(
                    f"{finder} {row[finder]['min']}/{row[finder]['median']} ({row[finder].get('next_runs_failed', 0)})"
                    for finder in FINDERS))
    if summary.get("no_batch_keeps_fitting"):
        lines.append("no batch keeps fitting (judged by the next runs and reruns only): "
                     + "; ".join(summary["no_batch_keeps_fitting"]))
    goal = summary.get("goal")
    if goal:
        which_goal = ("goal (issue 40)" if summary.get("oracle") == "steady" else
                      "goal (issue 40's bars, but NOT issue 40's goal: judged by the old single-run oracle, no next runs)")
        lines.append(f"{which_goal}: {'MET' if goal['met'] else 'NOT MET'}; %oomfix median "
                     f"{summary['oomfix']['found_over_oracle_median']} (needs >= {goal['median_at_least']}); "
                     f"{len(goal['cases_missing'])} of the {goal['cases_checked']} cases %oomfix ran on miss")
        for label, reasons in goal["cases_missing"].items():
            lines.append(f"  misses: {label}: " + "; ".join(reasons))
    if summary.get("single_run_oracle_cases"):
        lines.append(f"{summary['single_run_oracle_cases']} cases judged by the OLD single-run oracle (no "
                     "oracle_runs): their found/oracle is not against the steady state")
    if summary.get("void_cases"):
        lines.append("left out (the cell kept fitting at its start batch): " + "; ".join(summary["void_cases"]))
    if summary.get("cases_memory_not_back"):
        lines.append("memory not back to baseline after: " + "; ".join(summary["cases_memory_not_back"]))
    return "\n".join(lines)


def environment(dev: str, cap_bytes: int | None) -> dict[str, Any]:
    import importlib

    import torch

    versions: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                                "cuda": torch.version.cuda}
    for module in ("jupyter_cudamem", "IPython", "accelerate", "transformers", "torchvision", "timm"):
        try:
            versions[module] = getattr(importlib.import_module(module), "__version__", "unknown")
        except Exception as error:  # recorded: a missing peer or library is part of the result
            versions[module] = f"not importable ({type(error).__name__})"
    device = torch.cuda.get_device_name(0) if dev == "cuda" else "CPU (dry run: no OOM, no search)"
    return {"device": device, "versions": versions,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cap_bytes": cap_bytes, "ratios": list(RATIOS)}


# -- main -----------------------------------------------------------------------------------------------
def reusable_oracle(oracles: Mapping[str, Any] | None, workload: Workload, device: str,
                    cap_bytes: int | None, section: str = "workloads") -> dict[str, Any] | None:
    """The measured oracle and fixed bytes of ``workload`` in ``oracles``' ``section`` (``workloads``: the
    single-run ones; ``STEADY_SECTION``: the steady ones, of ``STEADY_RUNS`` runs), when they were measured
    on the same device, under the same cap, of the same cells; else ``None``."""
    entry = ((oracles or {}).get(section) or {}).get(workload.name)
    if not entry or entry.get("oracle_batch") is None or entry.get("fixed_bytes") is None and entry["oracle_batch"]:
        return None
    same = (entry.get("cells_digest") == workload.cells_digest() and entry.get("device") == device
            and entry.get("cap_bytes") == cap_bytes
            and (section != STEADY_SECTION or entry.get("oracle_runs") == STEADY_RUNS))
    return dict(entry) if same else None


def single_run_hint(oracles: Mapping[str, Any] | None, workload: Workload, device: str,
                    cap_bytes: int | None) -> tuple[int, bool, str] | None:
    """Where the steady search starts: a single-run oracle of the same cells and cap, a bound when it was
    measured on this device, a first guess when on another: ``(batch, bound, where it came from)``."""
    entry = ((oracles or {}).get("workloads") or {}).get(workload.name)
    if not entry or entry.get("oracle_batch") is None or entry.get("cells_digest") != workload.cells_digest() \
            or entry.get("cap_bytes") != cap_bytes:
        return None
    same_device = entry.get("device") == device
    return (int(entry["oracle_batch"]), same_device,
            f"single-run oracle on {entry.get('device')}, {entry.get('date')}" + ("" if same_device else " (a guess here)"))


def load_oracles(*paths: Path) -> dict[str, Any]:
    """The oracle files' entries, later files over earlier ones, per section."""
    merged: dict[str, Any] = {"workloads": {}, STEADY_SECTION: {}}
    for path in paths:
        if path.exists():
            saved = json.loads(path.read_text())
            for section in ("workloads", STEADY_SECTION):
                merged[section].update(saved.get(section) or {})
    return merged


def save_oracle(path: Path, name: str, entry: Mapping[str, Any]) -> None:
    """``entry`` written at once into ``path``'s steady section (other entries kept), so a part cut short
    keeps what it measured."""
    saved: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"about": ORACLES_ABOUT, "workloads": {}}
    saved.setdefault("steady_state_about", STEADY_ABOUT)
    saved.setdefault(STEADY_SECTION, {})[name] = dict(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved, indent=1) + "\n")


def merge_oracles(into: Path, parts: Iterable[Path]) -> dict[str, Any]:
    """Parts' oracle files merged into ``into``, per section and workload (a part's entry replaces)."""
    saved: dict[str, Any] = json.loads(into.read_text()) if into.exists() else {"about": ORACLES_ABOUT, "workloads": {}}
    for part in parts:
        new = json.loads(part.read_text())
        for section in ("workloads", STEADY_SECTION):
            if new.get(section):
                saved.setdefault(section, {}).update(new[section])
        if new.get(STEADY_SECTION):
            saved.setdefault("steady_state_about", STEADY_ABOUT)
    into.write_text(json.dumps(saved, indent=1) + "\n")
    return saved


def measure_oracle(bench: Any, workload: Workload, hint: tuple[int, bool, str] | None = None) -> dict[str, Any]:
    """The steady largest batch (``steady_largest``, from ``hint``), the single-run one where known, and
    what the models and optimizers hold after the probe at the answer."""
    started = time.perf_counter()
    held = getattr(bench, "held_after_runs", None)
    if held is not None:
        held.clear()
    single, bound, source = hint if hint is not None else (None, False, None)
    oracle, probes = steady_largest(lambda batch: bench.runs_fitting(workload, batch), single, bound)
    entry: dict[str, Any] = {"oracle_batch": oracle, "oracle_runs": STEADY_RUNS,
                             "oracle_probes": [[b, runs] for b, runs in probes],
                             "oracle_seconds": round(time.perf_counter() - started, 2)}
    if bound:
        entry.update(single_run_oracle_batch=single, single_run_from=source)
    else:
        pinned = single_run_from_probes(probes)
        entry["single_run_oracle_batch"] = pinned
        entry["single_run_from"] = "the probes' first runs" if pinned is not None else "not pinned by the probes"
        if single is not None:
            entry["single_run_elsewhere"] = {"oracle_batch": single, "from": source}
    if oracle >= 1:
        entry.update((held or {}).get(oracle) or bench.fixed(workload, oracle))
    entry["cells_digest"] = workload.cells_digest()
    return entry


def sweep(bench: Any, workloads: list[Workload], ratios: Iterable[float], results: dict[str, Any],
          write: Callable[[], None], finders: Iterable[str] = FINDERS,
          oracles: Mapping[str, Any] | None = None,
          keep_oracle: Callable[[str, dict[str, Any]], None] | None = None) -> None:
    """Steady oracle (reused from ``oracles`` where it applies, else measured and handed to
    ``keep_oracle`` at once) then every ratio, per workload; results written after each case. Each case
    carries the workload's ``fixed_bytes`` and the ``cap_bytes``."""
    finders = tuple(finders)
    device, cap = results.get("device", ""), results.get("cap_bytes")
    for workload in workloads:
        started = time.perf_counter()
        info: dict[str, Any] = {"kind": workload.kind, "batch_lives_in": workload.where}
        results["workloads"][workload.name] = info
        reason = missing_module(workload)
        if reason is not None:
            info["skipped"] = reason
            write()
            say(f"{workload.name}: skipped ({reason})")
            continue
        known = reusable_oracle(oracles, workload, device, cap, STEADY_SECTION)
        try:
            if known is not None:
                entry = known
                info["oracle_from"] = f"the oracle file's steady state, measured {known.get('date')}"
            else:
                entry = measure_oracle(bench, workload, single_run_hint(oracles, workload, device, cap))
                info["oracle_from"] = "measured in this run"
                if keep_oracle is not None:
                    keep_oracle(workload.name, entry)
        except Exception as error:
            info["error"] = f"{type(error).__name__}: {error}"
            info["traceback"] = traceback.format_exc()[-2000:]
            bench.release()
            write()
            say(f"{workload.name}: oracle failed: {info['error']}")
            continue
        oracle = entry["oracle_batch"]
        info.update({key: entry[key] for key in ORACLE_KEYS if key in entry})
        write()
        say(f"{workload.name}: steady largest batch {oracle} (single run: {entry.get('single_run_oracle_batch')}; "
            f"{info['oracle_from']}, {len(entry.get('oracle_probes') or [])} probes, {entry.get('oracle_seconds')} s), "
            f"fixed {(entry.get('fixed_bytes') or 0) / 2**30:.2f} GiB")
        for ratio in ratios:
            case_started = time.perf_counter()
            record = run_case(bench, workload, ratio, oracle, finders, entry.get("single_run_oracle_batch"))
            record["device"] = device
            record["fixed_bytes"] = entry.get("fixed_bytes")
            record["cap_bytes"] = cap
            record["seconds"] = round(time.perf_counter() - case_started, 2)
            for peer in PEERS:
                if peer in record:
                    record[peer]["measured"] = results.get("date")
            results["cases"].append(record)
            write()
            say(f"  x{ratio:g} start {record['start_batch']}: " + "; ".join(_case_line(record, finders))
                + f"; {record['seconds']} s"
                + ("" if record["memory_back_to_baseline"] else "; MEMORY NOT BACK TO BASELINE"))
        info["seconds"] = round(time.perf_counter() - started, 2)
        write()


ORACLE_KEYS = ("oracle_batch", "oracle_runs", "oracle_probes", "oracle_seconds", "single_run_oracle_batch",
               "single_run_from", "single_run_elsewhere", "fixed_bytes", "weights_bytes", "gradients_bytes",
               "gradients_set_to_none_bytes", "optimizer_state_bytes", "cells_digest")


def _next_runs_word(record: Mapping[str, Any]) -> str:
    fit = record.get("next_runs_fit")
    return "" if fit is None else f", next runs {record.get('next_runs_fitted')}/{NEXT_RUNS}"


def _case_line(record: Mapping[str, Any], finders: tuple[str, ...]) -> list[str]:
    parts = []
    if "oomfix" in finders:
        fraction = record.get("found_fraction")
        parts.append(f"%oomfix {record['found_batch']} in {record['reruns']}"
                     + (f" ({fraction:.2f})" if fraction is not None else "") + _next_runs_word(record)
                     + (f" error {record['oomfix'].get('error')}" if record["oomfix"].get("error") else ""))
    for peer in PEERS:
        if peer in finders:
            parts.append(f"{peer} {record[peer].get('found_batch')} in {record[peer].get('tries')}"
                         + _next_runs_word(record[peer]))
    return parts


def measure_oracles(bench: Any, workloads: list[Workload], env: Mapping[str, Any], oracles: Mapping[str, Any],
                    out: Path) -> int:
    """``--oracles-only``: each workload's steady oracle and fixed bytes, written into ``out`` per workload."""
    failures = 0
    for workload in workloads:
        reason = missing_module(workload)
        if reason is not None:
            say(f"{workload.name}: skipped ({reason})")
            continue
        try:
            entry = measure_oracle(bench, workload, single_run_hint(oracles, workload, env["device"], env["cap_bytes"]))
        except Exception as error:
            bench.release()
            failures += 1
            say(f"{workload.name}: oracle failed: {type(error).__name__}: {str(error)[:500]}")
            continue
        entry.update(device=env["device"], cap_bytes=env["cap_bytes"], date=env["date"], versions=env["versions"])
        save_oracle(out, workload.name, entry)
        say(f"{workload.name}: steady largest batch {entry['oracle_batch']} (single run "
            f"{entry.get('single_run_oracle_batch')}; {len(entry['oracle_probes'])} probes, "
            f"{entry['oracle_seconds']} s); fixed {entry.get('fixed_bytes', 0) / 2**30:.3f} GiB "
            f"({entry.get('fixed_bytes', 0) / env['cap_bytes']:.2f} of the cap): weights "
            f"{entry.get('weights_bytes', 0) / 2**30:.3f}, gradients {entry.get('gradients_bytes', 0) / 2**30:.3f} "
            f"(+{entry.get('gradients_set_to_none_bytes', 0) / 2**30:.3f} set to None), optimizer state "
            f"{entry.get('optimizer_state_bytes', 0) / 2**30:.3f} GiB")
    return 1 if failures else 0


PROBE_SECONDS_UNTIMED = 3.0
"""A single-run probe (setup cells and one run) of a workload never timed: the committed ones took 1-6 s,
most of the large models 2-3 s."""
STEADY_PROBE_FACTOR = 2.0
"""A steady probe against a single-run one: the setup once, the cell three times (a run is about half a
probe: the setup builds the model)."""


def estimate_seconds(workload: Workload, ratios: Iterable[float], finders: Iterable[str],
                     oracles: Mapping[str, Any], earlier: Mapping[str, Any] | None, device: str,
                     cap_bytes: int | None) -> dict[str, Any]:
    """GPU seconds the workload will take, roughly: its oracle (none where the steady one is cached) and
    its cases, from the committed timings (the H100 sweep, processes sharing the card: an overestimate
    for a card of its own), else ``PROBE_SECONDS_UNTIMED``."""
    finders = tuple(finders)
    single = ((oracles.get("workloads") or {}).get(workload.name) or {})
    timed = single.get("cells_digest") == workload.cells_digest() and single.get("oracle_probes")
    probe_s = single["oracle_seconds"] / len(single["oracle_probes"]) if timed else PROBE_SECONDS_UNTIMED
    run_s = probe_s / 2
    hint = single_run_hint(oracles, workload, device, cap_bytes)
    if reusable_oracle(oracles, workload, device, cap_bytes, STEADY_SECTION) is not None:
        probes = 0
    else:
        probes = 4 if hint is not None and hint[1] else 7 if hint is not None else len(single.get("oracle_probes") or ()) or 12
    oracle_s = probes * probe_s * STEADY_PROBE_FACTOR
    before = {c.get("start_ratio"): c for c in (earlier or {}).get("cases", []) if c.get("workload") == workload.name}
    cases_s = 0.0
    for ratio in ratios:
        case = before.get(ratio) or {}
        for finder in finders:
            record = case if finder == "oomfix" else case.get(finder) or {}
            seconds = (record.get("oomfix") or {}).get("seconds") if finder == "oomfix" else record.get("seconds")
            if seconds is None:
                tries = {"oomfix": 4, "halving": 1 + math.log2(ratio),
                         "accelerate": 1 + math.log(ratio) / math.log(1 / 0.9)}[finder]
                seconds = probe_s + tries * run_s
            cases_s += seconds + NEXT_RUNS * run_s
        cases_s += 2 * run_s if "oomfix" in finders else 0  # the start's runs until one fails
    return {"oracle_s": round(oracle_s), "cases_s": round(cases_s), "total_s": round(oracle_s + cases_s),
            "timed": bool(timed)}


def print_estimate(workloads: list[Workload], ratios: list[float], finders: tuple[str, ...],
                   oracles: Mapping[str, Any], device: str, cap_bytes: int | None) -> int:
    earlier = json.loads(SINGLE_RUN_RESULTS.read_text()) if SINGLE_RUN_RESULTS.exists() else None
    total = 0
    say(f"estimate (rough, from the committed H100 timings under sharing; {PROBE_SECONDS_UNTIMED:g} s a probe "
        f"where untimed) on {device or 'an unknown device'}, x{', x'.join(f'{r:g}' for r in ratios)}, "
        f"{', '.join(finders)}:")
    for workload in workloads:
        figures = estimate_seconds(workload, ratios, finders, oracles, earlier, device, cap_bytes)
        total += figures["total_s"]
        say(f"  {workload.name:<48} oracle {figures['oracle_s']:>4} s  cases {figures['cases_s']:>4} s  "
            f"total {figures['total_s']:>4} s" + ("" if figures["timed"] else "  (untimed: guessed)"))
    say(f"  all: {total} s of GPU one after another; run as parts at once, the slowest part sets the time")
    return total


def dry_run_cpu(workloads: list[Workload]) -> int:
    """Each workload's cells once, on CPU, at batch 2, in a plain InteractiveShell: checks the code."""
    bench = ShellBench("cpu")
    failures = 0
    for workload in workloads:  # closed by the process's end
        reason = missing_module(workload)
        if reason is not None:
            say(f"{workload.name}: skipped ({reason})")
            continue
        started = time.perf_counter()
        try:
            fitted = bench.fits(workload, 2)
            say(f"{workload.name}: ran at batch 2 on CPU ({time.perf_counter() - started:.1f} s)"
                if fitted else f"{workload.name}: FAILED (reported an OOM on CPU)")
            failures += not fitted
        except Exception as error:
            failures += 1
            say(f"{workload.name}: FAILED {type(error).__name__}: {error}")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", default="1/1", help="K/N: run the K-th of N parts of the workloads (default 1/1)")
    parser.add_argument("--workloads", default="", help=f"comma-separated, from: {', '.join(WORKLOAD_NAMES)}")
    parser.add_argument("--ratios", default="",
                        help=f"comma-separated start ratios (default: {','.join(f'{r:g}' for r in RATIOS)})")
    parser.add_argument("--quick", action="store_true",
                        help=f"the first sweep: {', '.join(QUICK_WORKLOADS)} at x{', x'.join(f'{r:g}' for r in QUICK_RATIOS)} "
                             "(--workloads and --ratios still pick)")
    parser.add_argument("--estimate", action="store_true",
                        help="print the GPU seconds each chosen workload will take, roughly, and exit (runs nothing)")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_WORKLOAD} at x{SMOKE_RATIO:g} only")
    parser.add_argument("--out", default=None,
                        help=f"the JSON to write or merge into (default {RESULTS.relative_to(REPO)}; the sweeps "
                             f"before issue 40: {SINGLE_RUN_RESULTS.relative_to(REPO)})")
    parser.add_argument("--oracles", default=None,
                        help=f"the oracle file to write each steady oracle into as soon as it is measured, read "
                             f"after {ORACLES.relative_to(REPO)} (default: that file)")
    parser.add_argument("--cap-gib", type=float, default=CAP_GIB, help="PyTorch's per-process cap (default 6)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: run each workload's cells once at a tiny batch (checks the code; no search)")
    parser.add_argument("--summary", action="store_true", help="print the summary of --out's results and exit")
    parser.add_argument("--finders", default=",".join(FINDERS),
                        help="comma-separated, from: oomfix, accelerate, halving (default all); a case that "
                             "lacks a peer keeps its record from --out's earlier run of the same case")
    parser.add_argument("--oracles-only", action="store_true",
                        help="measure each workload's steady oracle and fixed bytes into --oracles, no search")
    parser.add_argument("--remeasure-oracles", action="store_true",
                        help="measure every steady oracle again instead of reusing the oracle files'")
    parser.add_argument("--traces", metavar="DIR", default=None,
                        help="pickle each %%oomfix case's batch search at each choice into DIR (offline debugging)")
    parser.add_argument("--merge", nargs="+", metavar="PART",
                        help="merge parts' result files, in order, into --out (its earlier content first) and exit")
    parser.add_argument("--merge-oracles", nargs="+", metavar="PART",
                        help=f"merge parts' oracle files into --oracles (default {ORACLES.relative_to(REPO)}) and exit")
    args = parser.parse_args(argv)
    global TRACES_DIR
    TRACES_DIR = Path(args.traces) if args.traces else None

    out = Path(args.out) if args.out else (Path(tempfile.gettempdir()) / "oomfix_sweep_smoke.json"
                                           if args.smoke else RESULTS)
    oracles_out = Path(args.oracles) if args.oracles else ORACLES
    finders = tuple(name for name in args.finders.split(",") if name)
    if not finders or any(name not in FINDERS for name in finders):
        parser.error(f"--finders takes names from {', '.join(FINDERS)}; got {args.finders!r}")
    if args.merge or args.merge_oracles:
        missing = [part for part in [*(args.merge or []), *(args.merge_oracles or [])] if not Path(part).exists()]
        if missing:
            parser.error(f"no such part file(s): {', '.join(missing)}")
        if args.merge_oracles:
            saved = merge_oracles(oracles_out, [Path(part) for part in args.merge_oracles])
            say(f"{oracles_out}: {len(saved.get(STEADY_SECTION) or {})} steady oracles, "
                f"{len(saved.get('workloads') or {})} single-run")
        if args.merge:
            merged = json.loads(out.read_text()) if out.exists() else None
            for part in args.merge:
                merged = merge(merged, json.loads(Path(part).read_text()))
            out.write_text(json.dumps(merged, indent=1) + "\n")
            say(summary_text(summarize(merged or {})))
        return 0
    if args.summary:
        if not out.exists():
            parser.error(f"no results at {out}: run the sweep first (the sweeps before issue 40: --out "
                         f"{SINGLE_RUN_RESULTS.relative_to(REPO)})")
        say(summary_text(summarize(json.loads(out.read_text()))))
        return 0
    names = [name for name in args.workloads.split(",") if name] or (
        [SMOKE_WORKLOAD] if args.smoke else list(QUICK_WORKLOADS) if args.quick else list(WORKLOAD_NAMES))
    unknown = [name for name in names if name not in WORKLOAD_NAMES]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; known: {', '.join(WORKLOAD_NAMES)}")
    try:
        names = select_part(names, args.part)
    except ValueError as error:
        parser.error(str(error))
    try:
        ratios = [float(r) for r in args.ratios.split(",") if r] or (
            [SMOKE_RATIO] if args.smoke else list(QUICK_RATIOS) if args.quick else list(RATIOS))
    except ValueError:
        parser.error(f"--ratios takes numbers, e.g. 1.5,4; got {args.ratios!r}")
    selected = [w for w in WORKLOADS if w.name in names]
    cap_bytes = int(args.cap_gib * 2**30)
    oracles = load_oracles(ORACLES, oracles_out)
    if args.remeasure_oracles:
        oracles[STEADY_SECTION] = {}

    import torch

    if args.estimate:
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
        print_estimate(selected, ratios, finders, oracles, device, cap_bytes)
        return 0
    if args.device == "cpu":
        return dry_run_cpu(selected)
    if not torch.cuda.is_available():
        parser.error("no CUDA device: run on the GPU machine, or pass --device cpu to check the cells "
                     "(--estimate and --summary need none)")
    torch.cuda.init()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(cap_bytes / total, 1.0), 0)
    torch.zeros(1, device="cuda")  # the context and allocator up before the baseline is read
    env = environment("cuda", cap_bytes)
    print_estimate(selected, ratios, finders, oracles, env["device"], cap_bytes)
    bench = ShellBench("cuda")

    def keep_oracle(name: str, entry: dict[str, Any]) -> None:
        entry.update(device=env["device"], cap_bytes=cap_bytes, date=env["date"], versions=env["versions"])
        save_oracle(oracles_out, name, entry)

    if args.oracles_only:
        try:
            return measure_oracles(bench, selected, env, oracles, oracles_out)
        finally:
            bench.close()

    part_name = f"{args.part}" + (" smoke" if args.smoke else " quick" if args.quick else "") + (
        "" if finders == FINDERS else f" {','.join(finders)}")
    results: dict[str, Any] = {**env, "workloads": {}, "cases": [], "parts": {}}
    existing = json.loads(out.read_text()) if out.exists() else None
    started = time.perf_counter()

    def write() -> None:
        results["parts"] = {part_name: {"workloads": names, "ratios": ratios, "finders": list(finders),
                                        "seconds": round(time.perf_counter() - started, 1),
                                        "date": results["date"]}}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(merge(existing, results), indent=1) + "\n")

    say(f"oomfix sweep on {results['device']}, cap {args.cap_gib:g} GiB, part {args.part}: {', '.join(names)} "
        f"at x{', x'.join(f'{r:g}' for r in ratios)} -> {out} (oracles -> {oracles_out})")
    try:
        sweep(bench, selected, ratios, results, write, finders, oracles, keep_oracle)
    finally:
        bench.close()
    write()
    say(f"part {args.part} done in {time.perf_counter() - started:.1f} s")
    say(summary_text(summarize(merge(existing, results))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
