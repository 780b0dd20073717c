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
over prompts a batch at a time). Models come from configs (``transformers``) or
``pretrained=False`` (``timm``), nothing downloaded; the large ones are built on the device.

What runs, per workload:

1. **The oracle**: the largest batch that fits, by doubling then bisection, each probe in a fresh
   namespace (``%reset -f``, the setup cells, the knob at that batch, the cell): a probe fits when the
   cell raises nothing. Then **the fixed bytes**: one more fresh run at the oracle, after which the
   namespace's ``torch.nn.Module``s and ``torch.optim.Optimizer``s are read (``held_by_models``):
   weights, gradients (a gradient the cell set to ``None`` counted at its parameter's size) and
   optimizer state. Neither depends on this project's code: ``--oracles-only`` measures them into
   ``results/oomfix_oracles.json``, and the sweep reuses an entry of the same cells (a digest), device
   and cap instead of measuring again (``--remeasure-oracles`` to measure anyway).
2. For each start ratio (``RATIOS``: 1.1x, 1.5x, 3x, 10x, 50x the oracle; no powers of two, from which
   halving would land on the oracle by construction), three finders from the same start:

   - ``%oomfix``: fresh namespace, the knob and the cell at the start batch run as plain cells in an
     IPython ``InteractiveShell`` with the extension loaded; the cell fails with a CUDA OOM; then
     ``%oomfix --yes -o`` (default 3 reruns) exactly as a user types it. Read from its outcome
     (``read_outcome``): the found batch (the batch of the best try that fitted) and the reruns (the
     number of tries). What PyTorch had allocated when each try started is read by a ``pre_run_cell``
     callback of the benchmark's own, so it does not depend on what the outcome exposes.
   - accelerate's ``find_executable_batch_size`` (its default: multiply by 0.9 after each OOM) around
     a function that runs the knob and the cell at its ``batch_size`` in the same shell.
   - halving: the start, then half of it after each OOM, until one fits.

   ``--finders`` picks which run. The peers' results do not depend on this project's code: a part run
   with ``--finders oomfix`` is merged (``--merge``) over an earlier run of the peers on the same cases
   (same workload, ratio and start batch), whose records keep the date they were measured
   (``measured``). ``results/oomfix_peers.json`` holds such a run (H100, 2026-11-25) of 11 of the
   workloads; the others need every finder (its ``sharing`` says which).

   Where ``%oomfix`` chunked the whole data instead of shrinking it (inference over one tensor: its note
   says so), the batch it found is a chunk of the start's data, which stays allocated whole: the case's
   ``oracle_batch`` is then the largest chunk that fits over that data (bisection over the cell the fix
   wrote, each probe in a fresh namespace) and ``unchunked_oracle_batch`` the workload's own, which the
   peers (they shrink the data itself) are measured against.

   A peer's failed try is forgotten as a function's locals would be: the names the cell bound are
   put back, the exception and IPython's references to its traceback dropped, ``gc.collect()`` and
   ``empty_cache()``. ``tries`` counts every run including the one at the start; ``reruns`` (the
   figure to set against ``%oomfix``'s) is ``tries - 1``, since ``%oomfix`` starts after that failure.
3. Between cases, ``%reset -f``, ``gc.collect()``, ``empty_cache()``, and PyTorch's allocated memory
   must be back within ``BASELINE_TOLERANCE_BYTES`` of what it was before the first case; each record
   says how far it was (``allocated_after_case_above_baseline_bytes``).

Each case records ``oracle_batch``, ``found_batch``, ``reruns``, the peers' records, ``fixed_bytes`` and
``cap_bytes``. ``--summary`` gives per finder the min and median of found/oracle, by regime (largest
fitting batch <= 10, 11-64, > 64; fixed bytes at half the cap or more, or less) and the issue's goal
per case (``goal_misses``): found >= largest - 1 where the largest is 10 or less, else >= 0.90 of it;
not below halving's found/oracle in the same case; at most 3 reruns; a median of 0.95 or more.

The cap: ``set_per_process_memory_fraction`` at ``CAP_GIB`` (6 GiB, a common consumer card, the
budget the issue's figures were taken under; ``--cap-gib`` to change), so every workload runs out at
small, quick sizes on a big card.

Run on the GPU machine (no network), in parts that may run at the same time (each process has its own
cap), each to its own file, then merged into ``benchmarks/results/oomfix_sweep.json``::

    python benchmarks/oomfix.py --finders oomfix --workloads A,B,... --part 1/3 --out /tmp/part1.json
    python benchmarks/oomfix.py --workloads C,D,... --out /tmp/part4.json      # every finder
    python benchmarks/oomfix.py --merge benchmarks/results/oomfix_peers.json /tmp/part*.json
    python benchmarks/oomfix.py --summary

(``--merge`` starts from ``--out``'s content, the committed sweep by default; a workload a part ran
replaces all of that workload's cases there). ``--workloads a,b``
picks workloads, ``--smoke`` runs one workload at one ratio (to a temporary file unless ``--out``),
``--device cpu`` runs each workload's cells once at batch 2 on CPU, the large models shrunk
(``Workload.small``: the same code at a size two cores run in seconds; no OOM, no search: it checks the
cells' code). A workload whose library is missing (torchvision, timm, transformers) is skipped with the
import error.
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
ORACLES = REPO / "benchmarks" / "results" / "oomfix_oracles.json"
ORACLES_ABOUT = (
    "Per workload of benchmarks/oomfix.py: the largest batch that fits (the oracle: doubling from 16 then "
    "bisection, each probe in a fresh namespace, the cell run as a plain cell) and what the namespace's models "
    "and optimizers hold after a fresh run at it (fixed_bytes = weights + gradients + optimizer state), under "
    "cap_bytes on device. None of it depends on jupyter_cudamem's code: the sweep reuses an entry measured on "
    "the same device, under the same cap, of the same cells (cells_digest), instead of measuring it again.")
CAP_GIB = 6.0
RATIOS = (1.1, 1.5, 3.0, 10.0, 50.0)
SMOKE_WORKLOAD, SMOKE_RATIO = "mlp_builds_own_model", 4.0
FINDERS = ("oomfix", "accelerate", "halving")
PEERS = ("accelerate", "halving")
"""The peers' results depend on the workload, the start and the card, not on this project's code: a run
of ``%oomfix`` alone (``--finders oomfix``) keeps the peers of an earlier run of the same case."""
GOAL_FRACTION = 0.90
"""The issue's bar: found batch at 90% of the largest that fits or better (where it is above
``SMALL_LARGEST``)."""
SMALL_LARGEST = 10
"""At a largest fitting batch of 10 or less the bar is a whole sample: found >= largest - 1."""
GOAL_MEDIAN = 0.95
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
)
WORKLOAD_NAMES = tuple(w.name for w in WORKLOADS)


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
choice can be replayed on a CPU (``search.next()``) and the policy debugged on the GPU's own figures."""


@contextlib.contextmanager
def searches_kept() -> Any:
    """Every ``BatchSearch`` state at each ``next()`` while the block runs (empty unless ``--traces``)."""
    kept: list[Any] = []
    if TRACES_DIR is None:
        yield kept
        return
    from jupyter_cudamem.reruns.search import BatchSearch

    original = BatchSearch.next

    def next_kept(search: Any) -> Any:
        kept.append(copy.deepcopy(search))
        return original(search)

    BatchSearch.next = next_kept  # type: ignore[method-assign]
    try:
        yield kept
    finally:
        BatchSearch.next = original  # type: ignore[method-assign]


def keep_searches(path: Path, searches: list[Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wb") as file:
        pickle.dump(searches, file)


# -- reading %oomfix's outcome ----------------------------------------------------------------------
def read_outcome(outcome: Any) -> dict[str, Any]:
    """What the benchmark takes from ``%oomfix -o``'s outcome, read defensively (the driver changes).

    Relied on: ``outcome.tries`` (a sequence; its length is the reruns), each try's ``batch`` (``None``
    for a try that changed no batch) and ``fitted``. The found batch is the batch of the largest try
    that fitted, or ``outcome.batch_after`` where the tries give none. Recorded when present:
    ``strategy``, ``notes``, each try's ``strategy``, ``peak_bytes``, ``reason``, ``need_bytes``,
    ``left_bytes``, and its field naming the allocated memory at its start (``allocated_at_start_bytes``).
    """
    if outcome is None:
        return {"found_batch": None, "reruns": None, "error": "%oomfix returned no outcome"}
    tries = list(getattr(outcome, "tries", ()) or ())
    fitted_batches = [t.batch for t in tries if getattr(t, "fitted", False) and getattr(t, "batch", None) is not None]
    found = max(fitted_batches) if fitted_batches else None
    if found is None and getattr(outcome, "fitted", False):
        found = getattr(outcome, "batch_after", None)
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
             finders: Iterable[str] = FINDERS) -> dict[str, Any]:
    """One workload at one start ratio: ``%oomfix``, accelerate and halving (those of ``finders``) from
    the same start.

    ``bench`` runs cells (``ShellBench`` on the GPU; a simulated one in the tests): ``oomfix(workload,
    start)`` returns ``read_outcome``'s record plus what it measured; ``peer(workload, start)`` is a
    context manager giving ``run(batch) -> fitted`` in one namespace; ``release()`` frees everything
    and returns the allocated bytes above the baseline.
    """
    start = start_batch(oracle, ratio)
    record: dict[str, Any] = {
        "workload": workload.name,
        "start_ratio": ratio,
        "start_batch": start,
        "oracle_batch": oracle,
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
        except ImportError as error:
            peer = {"found_batch": None, "tries": None, "error": f"not installed: {error}"}
        except Exception as error:
            peer = {"found_batch": None, "tries": None, "error": f"{type(error).__name__}: {error}"}
        peer["seconds"] = round(time.perf_counter() - started, 2)
        peer["allocated_after_above_baseline_bytes"] = bench.release()
        record[name] = peer
    leftovers = [record[key]["allocated_after_above_baseline_bytes"] for key in FINDERS if key in record]
    record["memory_back_to_baseline"] = all(abs(v) <= BASELINE_TOLERANCE_BYTES for v in leftovers if v is not None)
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
    template = chunk_template(ours.get("notes") or [], ours.get("fixed_source"), record["found_batch"])
    if template is not None:
        # The fix kept every row and shrank the chunk: the batch it found is a chunk of the start's
        # data, and the largest chunk that fits over that data is what it is measured against.
        started_oracle = time.perf_counter()
        chunk, probes = largest_fitting(lambda rows: bench.fits_cell(workload, start, template.replace(CHUNK_SLOT, str(rows))))
        bench.release()
        record.update(oracle_batch=chunk, unchunked_oracle_batch=oracle,
                      oracle_kind="the largest chunk that fits over the start's whole data (the fix chunks it)",
                      chunk_oracle_probes=[[b, f] for b, f in probes],
                      chunk_oracle_seconds=round(time.perf_counter() - started_oracle, 2))
    record["oomfix"] = ours
    oracle_here = record.get("oracle_batch", oracle)
    record["found_fraction"] = round(record["found_batch"] / oracle_here, 4) if record["found_batch"] else 0.0
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
    """Drop every reference IPython and ``sys`` keep to a failed cell's exception (and so its frames)."""
    if error is not None:
        traceback.clear_frames(error.__traceback__)
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
        """An oracle probe: fresh namespace, setup, knob and cell at ``batch``."""
        return self.fits_cell(workload, batch, workload.cell_at(batch, self.dev))

    def fits_cell(self, workload: Workload, batch: int, cell: str) -> bool:
        """A probe of ``cell`` (the workload's, or a form of it): fresh namespace, setup, the knob at
        ``batch``, then ``cell``; it fits when the cell raises nothing."""
        try:
            self._setup(workload)
            knob = workload.knob_at(batch, self.dev)
            if knob and self.run(knob) is not None:
                raise RuntimeError(f"the knob cell failed at batch {batch}: {self.output.getvalue()[-1500:]}")
            error = self.run(cell)
            if error is not None and not _is_oom(error):
                raise RuntimeError(f"the cell failed at batch {batch}: {type(error).__name__}: {str(error)[:300]}")
            fitted = error is None
            del error
            return fitted
        finally:
            self.release()

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
        self.allocated_at_cell_start = []
        error = self.run(workload.cell_at(start, self.dev), store_history=True)
        if error is None:
            raise StartFitted(f"the cell fitted at its start batch {start}: nothing to fix")
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
            keep_searches(TRACES_DIR / f"{workload.name}_x{start}.pkl.gz", searches)
        record["failed_cell_error"] = first_line
        record["allocated_when_failed_cell_started_bytes"] = at_failed_cell[0] if at_failed_cell else None
        record["allocated_at_each_try_start_bytes"] = list(self.allocated_at_cell_start)
        if at_failed_cell and self.allocated_at_cell_start:
            # The "a failed try leaves nothing": each try should start where the failed cell did.
            record["most_held_at_a_try_start_above_failed_cell_bytes"] = max(
                a - at_failed_cell[0] for a in self.allocated_at_cell_start)
        record["printed_tail"] = self.output.getvalue()[-1500:]
        del outcome
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
    """``new`` (one part's results) merged into ``existing``: its workloads' cases and oracles replace
    theirs, other workloads' stay; the part's timing is added under its name.

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
    ran = set(new.get("workloads", {}))
    merged["workloads"] = {**{k: v for k, v in (merged.get("workloads") or {}).items() if k not in ran},
                           **new.get("workloads", {})}
    cases = []
    for case in new.get("cases", []):
        before = earlier.get((case.get("workload"), case.get("start_ratio")))
        if before is not None and before.get("start_batch") == case.get("start_batch"):
            case = _with_earlier_finders(case, before, earlier_date)
        cases.append(case)
    merged["cases"] = [c for c in merged.get("cases", []) if c.get("workload") not in ran] + cases
    merged["parts"] = {**(merged.get("parts") or {}), **(new.get("parts") or {})}
    return merged


OOMFIX_FIELDS = ("found_batch", "reruns", "found_fraction", "void", "oomfix", "unchunked_oracle_batch", "oracle_kind",
                 "chunk_oracle_probes", "chunk_oracle_seconds")
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
        if not _ran(case, finder):
            continue  # a part that ran without this finder
        found = case.get("found_batch") if finder == "oomfix" else (case.get(finder) or {}).get("found_batch")
        # The peers shrink the data itself, not a chunk of it: the workload's own oracle is theirs.
        oracle = case["oracle_batch"] if finder == "oomfix" else case.get("unchunked_oracle_batch", case["oracle_batch"])
        out.append((found or 0) / oracle)
    return out


def _ran(case: Mapping[str, Any], finder: str) -> bool:
    """Whether ``finder`` ran on ``case`` (a part may run only some: ``--finders``)."""
    return "found_batch" in case or "oomfix" in case if finder == "oomfix" else finder in case


def _counts(cases: list[Mapping[str, Any]], finder: str) -> list[int]:
    if finder == "oomfix":
        return [c["reruns"] for c in cases if c.get("reruns") is not None]
    return [c[finder]["reruns"] for c in cases if (c.get(finder) or {}).get("reruns") is not None]


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
    """How the case misses the issue's goal for ``%oomfix`` (empty when it meets it): found >= largest - 1
    (and at least 1) where the largest fitting batch is ``SMALL_LARGEST`` or less, else >= ``GOAL_FRACTION``
    of it; found/largest not below halving's in the same case; at most ``GOAL_RERUNS`` reruns."""
    oracle, found = case["oracle_batch"], case.get("found_batch") or 0
    misses = []
    if oracle <= SMALL_LARGEST:
        if found < max(oracle - 1, 1):
            misses.append(f"found {found} where {oracle} fits (needs >= {max(oracle - 1, 1)})")
    elif found < GOAL_FRACTION * oracle:
        misses.append(f"found {found} where {oracle} fits ({found / oracle:.2f} < {GOAL_FRACTION:.2f})")
    if isinstance(case.get("halving"), Mapping) and case["halving"].get("found_batch") is not None:
        ours, halving_fraction = _fractions([case], "oomfix")[0], _fractions([case], "halving")[0]
        if ours < halving_fraction:
            misses.append(f"below halving ({ours:.2f} < {halving_fraction:.2f}, halving found "
                          f"{case['halving']['found_batch']})")
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
    return out


def summarize(results: Mapping[str, Any]) -> dict[str, Any]:
    """Per finder: found/oracle min, median and max, cases at ``GOAL_FRACTION`` or better, reruns.

    A case where a finder found nothing counts as 0; a void case (the cell fitted at its start, so the
    oracle's run was wrong there) is left out and listed.
    """
    void = [c for c in results.get("cases", []) if c.get("void")]
    cases = [c for c in results.get("cases", []) if c.get("oracle_batch") and not c.get("void")]
    summary: dict[str, Any] = {"cases": len(cases),
                               "void_cases": [f"{c['workload']} x{c['start_ratio']:g}" for c in void]}
    for finder in ("oomfix", "accelerate", "halving"):
        fractions = _fractions(cases, finder)
        reruns = _counts(cases, finder)
        summary[finder] = {
            "found_over_oracle_min": round(min(fractions), 3) if fractions else None,
            "found_over_oracle_median": round(statistics.median(fractions), 3) if fractions else None,
            "found_over_oracle_max": round(max(fractions), 3) if fractions else None,
            "cases_at_goal": sum(f >= GOAL_FRACTION for f in fractions),
            "reruns_min": min(reruns) if reruns else None,
            "reruns_median": statistics.median(reruns) if reruns else None,
            "reruns_max": max(reruns) if reruns else None,
        }
    ours = [c for c in cases if _ran(c, "oomfix")]
    summary["oomfix"]["cases_below_goal"] = [
        f"{c['workload']} x{c['start_ratio']:g}: {f:.2f}" for c, f in zip(ours, _fractions(ours, "oomfix"))
        if f < GOAL_FRACTION
    ]
    summary["oomfix"]["cases_over_3_reruns"] = sum(r > 3 for r in _counts(cases, "oomfix"))
    held = [(c["oomfix"].get("most_held_at_a_try_start_above_failed_cell_bytes"), c) for c in cases
            if isinstance(c.get("oomfix"), Mapping)]
    held = [(value, c) for value, c in held if value is not None]
    if held:
        value, case = max(held, key=lambda pair: pair[0])
        summary["oomfix"]["most_held_at_a_try_start_mib"] = {
            "mib": round(value / 2**20, 1), "case": f"{case['workload']} x{case['start_ratio']:g}",
            "cases_over_2_mib": sum(v > BASELINE_TOLERANCE_BYTES for v, _ in held)}
    summary["cases_memory_not_back"] = [f"{c['workload']} x{c['start_ratio']:g}" for c in cases
                                        if c.get("memory_back_to_baseline") is False]
    summary["by_largest"] = _by_regime(cases, regime, [label for _, _, label in REGIMES])
    summary["by_fixed_share"] = _by_regime(cases, fixed_share, sorted({fixed_share(c) for c in cases}))
    misses = {f"{c['workload']} x{c['start_ratio']:g}": goal_misses(c) for c in cases if _ran(c, "oomfix")}
    median = summary["oomfix"]["found_over_oracle_median"]
    summary["goal"] = {
        "cases_checked": len(misses),
        "cases_missing": {label: reasons for label, reasons in misses.items() if reasons},
        "median_at_least": GOAL_MEDIAN,
        "median_met": median is not None and median >= GOAL_MEDIAN,
        "met": bool(misses) and not any(misses.values()) and median is not None and median >= GOAL_MEDIAN,
    }
    return summary


def summary_text(summary: Mapping[str, Any]) -> str:
    lines = [f"{summary['cases']} cases", "finder       found/oracle min  median  max   at >= 0.90   reruns min/median/max"]
    for finder in ("oomfix", "accelerate", "halving"):
        s = summary[finder]
        lines.append(
            f"{finder:<12} {s['found_over_oracle_min']!s:>16} {s['found_over_oracle_median']!s:>7} "
            f"{s['found_over_oracle_max']!s:>5}   {s['cases_at_goal']:>3} of {summary['cases']:<4}  "
            f"{s['reruns_min']}/{s['reruns_median']}/{s['reruns_max']}"
        )
    below = summary["oomfix"]["cases_below_goal"]
    lines.append("%oomfix below 0.90: " + ("; ".join(below) if below else "none"))
    held = summary["oomfix"].get("most_held_at_a_try_start_mib")
    if held:
        lines.append(f"%oomfix: most held at a try's start above the failed cell's start {held['mib']} MiB "
                     f"({held['case']}); cases over 2 MiB: {held['cases_over_2_mib']}")
    for title, key in (("by largest fitting batch", "by_largest"), ("by weights + gradients + optimizer state",
                                                                    "by_fixed_share")):
        if summary.get(key):
            lines.append(f"found/oracle min/median {title}:")
            for label, row in summary[key].items():
                lines.append(f"  {label:<22} {row['cases']:>3} cases  " + "  ".join(
                    f"{finder} {row[finder]['min']}/{row[finder]['median']}" for finder in FINDERS))
    goal = summary.get("goal")
    if goal:
        lines.append(f"goal (issue 21): {'MET' if goal['met'] else 'NOT MET'}; %oomfix median "
                     f"{summary['oomfix']['found_over_oracle_median']} (needs >= {goal['median_at_least']}); "
                     f"{len(goal['cases_missing'])} of the {goal['cases_checked']} cases %oomfix ran on miss")
        for label, reasons in goal["cases_missing"].items():
            lines.append(f"  misses: {label}: " + "; ".join(reasons))
    if summary.get("void_cases"):
        lines.append("left out (the cell fitted at its start batch): " + "; ".join(summary["void_cases"]))
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
                    cap_bytes: int | None) -> dict[str, Any] | None:
    """The measured oracle and fixed bytes of ``workload`` in ``oracles`` (``ORACLES``' content), when
    they were measured on the same device, under the same cap, of the same cells; else ``None``."""
    entry = ((oracles or {}).get("workloads") or {}).get(workload.name)
    if not entry or entry.get("oracle_batch") is None or entry.get("fixed_bytes") is None:
        return None
    same = (entry.get("cells_digest") == workload.cells_digest() and entry.get("device") == device
            and entry.get("cap_bytes") == cap_bytes)
    return dict(entry) if same else None


def measure_oracle(bench: Any, workload: Workload) -> dict[str, Any]:
    """The largest fitting batch (each probe in a fresh namespace) and, in one more fresh run at it, the
    bytes the namespace's models and optimizers hold."""
    started = time.perf_counter()
    oracle, probes = largest_fitting(lambda batch: bench.fits(workload, batch))
    entry: dict[str, Any] = {"oracle_batch": oracle, "oracle_probes": [[b, f] for b, f in probes],
                             "oracle_seconds": round(time.perf_counter() - started, 2)}
    if oracle >= 1:
        entry.update(bench.fixed(workload, oracle))
    entry["cells_digest"] = workload.cells_digest()
    return entry


def sweep(bench: Any, workloads: list[Workload], ratios: Iterable[float], results: dict[str, Any],
          write: Callable[[], None], finders: Iterable[str] = FINDERS,
          oracles: Mapping[str, Any] | None = None) -> None:
    """Oracle (reused from ``oracles`` where it applies) then every ratio, per workload; results written
    after each case. Each case carries the workload's ``fixed_bytes`` and the ``cap_bytes``."""
    finders = tuple(finders)
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
        known = reusable_oracle(oracles, workload, results.get("device", ""), results.get("cap_bytes"))
        try:
            if known is not None:
                entry = known
                info["oracle_from"] = f"{ORACLES.relative_to(REPO)}, measured {known.get('date')}"
            else:
                entry = measure_oracle(bench, workload)
                info["oracle_from"] = "measured in this run"
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
        say(f"{workload.name}: largest fitting batch {oracle} ({info['oracle_from']}), "
            f"fixed {entry.get('fixed_bytes', 0) / 2**30:.2f} GiB")
        for ratio in ratios:
            case_started = time.perf_counter()
            record = run_case(bench, workload, ratio, oracle, finders)
            record["fixed_bytes"] = entry.get("fixed_bytes")
            record["cap_bytes"] = results.get("cap_bytes")
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


ORACLE_KEYS = ("oracle_batch", "oracle_probes", "oracle_seconds", "fixed_bytes", "weights_bytes", "gradients_bytes",
               "gradients_set_to_none_bytes", "optimizer_state_bytes", "cells_digest")


def _case_line(record: Mapping[str, Any], finders: tuple[str, ...]) -> list[str]:
    parts = []
    if "oomfix" in finders:
        parts.append(f"%oomfix {record['found_batch']} in {record['reruns']} ({record['found_fraction']:.2f})"
                     + (f" error {record['oomfix'].get('error')}" if record["oomfix"].get("error") else ""))
    for peer in PEERS:
        if peer in finders:
            parts.append(f"{peer} {record[peer].get('found_batch')} in {record[peer].get('tries')}")
    return parts


def measure_oracles(bench: Any, workloads: list[Workload], env: Mapping[str, Any], out: Path) -> int:
    """``--oracles-only``: each workload's oracle and fixed bytes, merged into ``out`` per workload."""
    failures = 0
    for workload in workloads:
        reason = missing_module(workload)
        if reason is not None:
            say(f"{workload.name}: skipped ({reason})")
            continue
        try:
            entry = measure_oracle(bench, workload)
        except Exception as error:
            bench.release()
            failures += 1
            say(f"{workload.name}: oracle failed: {type(error).__name__}: {str(error)[:500]}")
            continue
        entry.update(device=env["device"], cap_bytes=env["cap_bytes"], date=env["date"], versions=env["versions"])
        saved: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {"about": ORACLES_ABOUT, "workloads": {}}
        saved["workloads"][workload.name] = entry
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(saved, indent=1) + "\n")
        say(f"{workload.name}: largest fitting batch {entry['oracle_batch']} ({len(entry['oracle_probes'])} probes, "
            f"{entry['oracle_seconds']} s); fixed {entry.get('fixed_bytes', 0) / 2**30:.3f} GiB "
            f"({entry.get('fixed_bytes', 0) / env['cap_bytes']:.2f} of the cap): weights "
            f"{entry.get('weights_bytes', 0) / 2**30:.3f}, gradients {entry.get('gradients_bytes', 0) / 2**30:.3f} "
            f"(+{entry.get('gradients_set_to_none_bytes', 0) / 2**30:.3f} set to None), optimizer state "
            f"{entry.get('optimizer_state_bytes', 0) / 2**30:.3f} GiB")
    return 1 if failures else 0


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
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_WORKLOAD} at x{SMOKE_RATIO:g} only")
    parser.add_argument("--out", default=None, help="the JSON to write or merge into (default: benchmarks/results/)")
    parser.add_argument("--cap-gib", type=float, default=CAP_GIB, help="PyTorch's per-process cap (default 6)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: run each workload's cells once at a tiny batch (checks the code; no search)")
    parser.add_argument("--summary", action="store_true", help="print the summary of --out's results and exit")
    parser.add_argument("--finders", default=",".join(FINDERS),
                        help="comma-separated, from: oomfix, accelerate, halving (default all); a case that "
                             "lacks a peer keeps its record from --out's earlier run of the same case")
    parser.add_argument("--oracles-only", action="store_true",
                        help=f"measure each workload's oracle and fixed bytes into --out (default "
                             f"{ORACLES.relative_to(REPO)}), no search")
    parser.add_argument("--remeasure-oracles", action="store_true",
                        help=f"measure every oracle again instead of reusing {ORACLES.relative_to(REPO)}")
    parser.add_argument("--traces", metavar="DIR", default=None,
                        help="pickle each %%oomfix case's batch search at each choice into DIR (offline debugging)")
    parser.add_argument("--merge", nargs="+", metavar="PART",
                        help="merge parts' result files, in order, into --out (its earlier content first) and exit")
    args = parser.parse_args(argv)
    global TRACES_DIR
    TRACES_DIR = Path(args.traces) if args.traces else None

    out = Path(args.out) if args.out else (Path(tempfile.gettempdir()) / "oomfix_sweep_smoke.json"
                                           if args.smoke else ORACLES if args.oracles_only else RESULTS)
    finders = tuple(name for name in args.finders.split(",") if name)
    if not finders or any(name not in FINDERS for name in finders):
        parser.error(f"--finders takes names from {', '.join(FINDERS)}; got {args.finders!r}")
    if args.merge:
        missing = [part for part in args.merge if not Path(part).exists()]
        if missing:
            parser.error(f"no such part file(s): {', '.join(missing)}")
        merged = json.loads(out.read_text()) if out.exists() else None
        for part in args.merge:
            merged = merge(merged, json.loads(Path(part).read_text()))
        out.write_text(json.dumps(merged, indent=1) + "\n")
        say(summary_text(summarize(merged or {})))
        return 0
    if args.summary:
        if not out.exists():
            parser.error(f"no results at {out}: run the sweep first")
        say(summary_text(summarize(json.loads(out.read_text()))))
        return 0
    names = [name for name in args.workloads.split(",") if name] or (
        [SMOKE_WORKLOAD] if args.smoke else list(WORKLOAD_NAMES))
    unknown = [name for name in names if name not in WORKLOAD_NAMES]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; known: {', '.join(WORKLOAD_NAMES)}")
    try:
        names = select_part(names, args.part)
    except ValueError as error:
        parser.error(str(error))
    try:
        ratios = [float(r) for r in args.ratios.split(",") if r] or ([SMOKE_RATIO] if args.smoke else list(RATIOS))
    except ValueError:
        parser.error(f"--ratios takes numbers, e.g. 1.5,4; got {args.ratios!r}")
    selected = [w for w in WORKLOADS if w.name in names]

    import torch

    if args.device == "cpu":
        return dry_run_cpu(selected)
    if not torch.cuda.is_available():
        parser.error("no CUDA device: run on the GPU machine, or pass --device cpu to check the cells")
    torch.cuda.init()
    cap_bytes = int(args.cap_gib * 2**30)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(cap_bytes / total, 1.0), 0)
    torch.zeros(1, device="cuda")  # the context and allocator up before the baseline is read
    bench = ShellBench("cuda")
    if args.oracles_only:
        try:
            return measure_oracles(bench, selected, environment("cuda", cap_bytes), out)
        finally:
            bench.close()

    part_name = f"{args.part}" + (" smoke" if args.smoke else "") + ("" if finders == FINDERS else f" {','.join(finders)}")
    results: dict[str, Any] = {**environment("cuda", cap_bytes), "workloads": {}, "cases": [], "parts": {}}
    oracles = None if args.remeasure_oracles or not ORACLES.exists() else json.loads(ORACLES.read_text())
    existing = json.loads(out.read_text()) if out.exists() else None
    started = time.perf_counter()

    def write() -> None:
        results["parts"] = {part_name: {"workloads": names, "ratios": ratios, "finders": list(finders),
                                        "seconds": round(time.perf_counter() - started, 1),
                                        "date": results["date"]}}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(merge(existing, results), indent=1) + "\n")

    say(f"oomfix sweep on {results['device']}, cap {args.cap_gib:g} GiB, part {args.part}: {', '.join(names)} "
        f"at x{', x'.join(f'{r:g}' for r in ratios)} -> {out}")
    try:
        sweep(bench, selected, ratios, results, write, finders, oracles)
    finally:
        bench.close()
    write()
    say(f"part {args.part} done in {time.perf_counter() - started:.1f} s")
    say(summary_text(summarize(merge(existing, results))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
