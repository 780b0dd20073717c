"""The ``%oomfix`` sweep's logic on CPU (benchmarks/oomfix.py), so its GPU run works first time: the
oracle's bisection, halving and accelerate's loop counted right, the record schema, parts that split
and merge, the summary, and the real shell path (``%oomfix --yes -o`` in an InteractiveShell) driven
against a simulated card whose memory has an intercept."""

from __future__ import annotations

import ast
import gc
import gzip
import importlib.util
import json
import math
import pickle
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.benchmark_smoke

REPO = Path(__file__).resolve().parents[1]


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("oomfix_sweep_benchmark", REPO / "benchmarks" / "oomfix.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


bench_module = _load_benchmark()


# -- searches -------------------------------------------------------------------------------------
@pytest.mark.parametrize("limit", [0, 1, 2, 7, 15, 16, 17, 31, 37, 100, 1000, 4097, 65535])
def test_oracle_finds_exactly_the_largest_fitting_batch(limit):
    found, probes = bench_module.largest_fitting(lambda batch: batch <= limit)
    assert found == limit
    assert all(fitted == (batch <= limit) for batch, fitted in probes)
    # doubling then bisection: about two probes per power of two, never a linear scan
    assert len(probes) <= 2 * math.log2(max(limit, 2)) + 6


def test_oracle_refuses_a_knob_that_does_not_reach_the_cell():
    with pytest.raises(RuntimeError, match="does not reach"):
        bench_module.largest_fitting(lambda batch: True, limit=1024)


@pytest.mark.parametrize("start,limit", [(100, 20), (100, 100), (64, 1), (1000, 333), (7, 0), (5000, 4999)])
def test_halving_halves_until_one_fits_and_counts_every_try(start, limit):
    result = bench_module.halving(start, lambda batch: batch <= limit)
    expected, batch = [], start
    while batch >= 1:
        expected.append((batch, batch <= limit))
        if batch <= limit:
            break
        batch //= 2
    assert result.trail == expected
    assert result.found_batch == (expected[-1][0] if expected[-1][1] else None)
    record = result.record()
    assert record["tries"] == len(expected) and record["reruns"] == len(expected) - 1


def test_halving_stops_on_an_error_that_is_not_an_oom():
    def run(batch):
        if batch < 50:
            raise bench_module.NotOutOfMemory("ValueError: shape")
        return False

    result = bench_module.halving(200, run)
    assert result.found_batch is None and result.trail == [(200, False), (100, False), (50, False)]
    assert "shape" in result.record()["error"]


@pytest.mark.parametrize("start,limit", [(100, 50), (300, 200), (40, 39), (64, 64)])
def test_accelerate_decays_by_a_tenth_from_the_start(start, limit):
    pytest.importorskip("accelerate")
    result = bench_module.accelerate_search(start, lambda batch: batch <= limit)
    expected, batch = [], start
    while True:
        expected.append((batch, batch <= limit))
        if batch <= limit:
            break
        batch = int(batch * 0.9)
    assert result.trail == expected and result.found_batch == expected[-1][0]
    assert result.record()["tries"] == len(expected)


def test_accelerate_passes_a_non_oom_error_on_as_a_recorded_error():
    pytest.importorskip("accelerate")

    def run(batch):
        raise bench_module.NotOutOfMemory("TypeError: not an OOM")

    result = bench_module.accelerate_search(64, run)
    assert result.found_batch is None and "not an OOM" in result.error


@pytest.mark.parametrize("oracle,ratio,start", [(100, 1.5, 150), (591, 64, 37824), (1, 1.5, 2), (3, 1.1, 4)])
def test_start_batch_is_the_ratio_of_the_oracle_and_always_fails(oracle, ratio, start):
    assert bench_module.start_batch(oracle, ratio) == start


# -- reading the outcome --------------------------------------------------------------------------
def test_read_outcome_takes_the_best_fitting_batch_and_counts_every_try():
    from jupyter_cudamem.oomfix.outcome import Outcome, TryResult
    from jupyter_cudamem.oomfix.strategies import Strategy

    tries = (
        TryResult(1, Strategy.BATCH, "b=10", True, False, 100, 0.1, "probe", batch=10),
        TryResult(2, Strategy.BATCH, "b=80", False, True, 700, 0.1, "line", batch=80),
        TryResult(3, Strategy.BATCH, "b=60", True, False, 600, 0.1, "line", batch=60, steady=True),
    )
    outcome = Outcome("b=800", "b=60", Strategy.BATCH, tries, batch_before=800, batch_after=60, notes=("a note",))
    record = bench_module.read_outcome(outcome)
    assert record["found_batch"] == 60 and record["reruns"] == 3 and record["strategy"] == "batch"
    # The record is written as JSON: the strategy as the word it is today.
    assert json.loads(json.dumps(record))["tries"][0]["strategy"] == "batch"
    assert [t["batch"] for t in record["tries"]] == [10, 80, 60]
    assert [t["fitted"] for t in record["tries"]] == [True, False, True]
    assert record["notes"] == ["a note"]
    assert [t["steady"] for t in record["tries"]] == [False, False, True]  # ran as the next run will


def test_read_outcome_takes_the_batch_the_fixed_cell_has_below_a_try_that_fitted_once():
    from jupyter_cudamem.oomfix.outcome import Outcome, TryResult
    from jupyter_cudamem.oomfix.strategies import Strategy

    tries = (TryResult(1, Strategy.BATCH, "b=1", True, False, 100, 0.1, "probe", batch=1),
             TryResult(2, Strategy.BATCH, "b=33", True, False, 600, 0.1, "replay", batch=33, steady=True))
    # The replay of the try at 33's own run does not keep fitting; 32 does: the cell is fixed at 32.
    outcome = Outcome("b=35", "b=32", Strategy.BATCH, tries, batch_before=35, batch_after=32)
    assert bench_module.read_outcome(outcome)["found_batch"] == 32


def test_read_outcome_is_defensive_about_fields_the_driver_may_rename():
    bare = SimpleNamespace(tries=[SimpleNamespace(batch=5, fitted=True, allocated_before_bytes=1234)])
    record = bench_module.read_outcome(bare)
    assert record["found_batch"] == 5 and record["reruns"] == 1
    assert record["tries"][0]["allocated_at_start_bytes"] == 1234
    nothing = bench_module.read_outcome(None)
    assert nothing["found_batch"] is None and "no outcome" in nothing["error"]
    autocast_only = SimpleNamespace(tries=[SimpleNamespace(batch=None, fitted=True)], fitted=True, batch_after=None,
                                    strategy="autocast")
    assert bench_module.read_outcome(autocast_only)["found_batch"] is None


# -- parts, merge, summary --------------------------------------------------------------------------
def test_parts_cover_every_workload_once():
    names = list(bench_module.WORKLOAD_NAMES)
    for n in (1, 2, 3, 4, len(names)):
        parts = [bench_module.select_part(names, f"{k}/{n}") for k in range(1, n + 1)]
        flat = [name for part in parts for name in part]
        assert sorted(flat) == sorted(names) and len(flat) == len(set(flat))
    for bad in ("0/3", "4/3", "3", "a/b"):
        with pytest.raises(ValueError):
            bench_module.select_part(names, bad)


def _case(workload, ratio, oracle, found, reruns, acc, acc_tries, half, half_tries):
    return {"workload": workload, "start_ratio": ratio, "start_batch": int(ratio * oracle), "oracle_batch": oracle,
            "found_batch": found, "reruns": reruns,
            "accelerate": {"found_batch": acc, "tries": acc_tries, "reruns": acc_tries - 1},
            "halving": {"found_batch": half, "tries": half_tries, "reruns": half_tries - 1}}


def test_parts_merge_and_a_rerun_workload_replaces_its_cases():
    part1 = {"device": "GPU", "versions": {"torch": "x"}, "date": "d1", "workloads": {"a": {"oracle_batch": 10}},
             "cases": [_case("a", 4, 10, 9, 2, 9, 10, 5, 3)], "parts": {"1/2": {"seconds": 100}}}
    part2 = {"device": "GPU", "versions": {"torch": "x"}, "date": "d2", "workloads": {"b": {"oracle_batch": 20}},
             "cases": [_case("b", 4, 20, 19, 3, 18, 12, 10, 3)], "parts": {"2/2": {"seconds": 200}}}
    merged = bench_module.merge(bench_module.merge(None, part1), part2)
    assert [c["workload"] for c in merged["cases"]] == ["a", "b"]
    assert set(merged["parts"]) == {"1/2", "2/2"} and set(merged["workloads"]) == {"a", "b"}
    again = {**part1, "cases": [_case("a", 4, 10, 10, 1, 9, 10, 5, 3)], "parts": {"1/2": {"seconds": 90}}}
    merged = bench_module.merge(merged, again)
    assert sorted((c["workload"], c["found_batch"]) for c in merged["cases"]) == [("a", 10), ("b", 19)]
    assert merged["parts"]["1/2"]["seconds"] == 90


def test_summary_gives_min_median_and_cases_at_goal_per_finder():
    results = {"cases": [
        _case("a", 1.5, 100, 95, 2, 90, 5, 75, 2),
        _case("a", 64, 100, 50, 3, 99, 40, 0, 7),
        _case("b", 4, 200, None, 3, 190, 14, 100, 3),
        {**_case("b", 1.5, 200, None, None, 300, 1, 300, 1), "void": "the cell fitted at its start batch 300"},
    ]}
    summary = bench_module.summarize(results)
    assert summary["cases"] == 3 and summary["void_cases"] == ["b x1.5"]
    ours = summary["oomfix"]
    assert ours["found_over_oracle_min"] == 0.0 and ours["found_over_oracle_median"] == 0.5
    assert ours["cases_at_goal"] == 1 and ours["reruns_max"] == 3 and len(ours["cases_below_goal"]) == 2
    assert summary["accelerate"]["cases_at_goal"] == 3 and summary["accelerate"]["reruns_median"] == 13
    assert summary["halving"]["found_over_oracle_median"] == 0.5
    assert "at >= 0.90" in bench_module.summary_text(summary)


# -- the workloads ----------------------------------------------------------------------------------
def test_at_least_eight_workloads_of_the_kinds_the_issue_names():
    workloads = bench_module.WORKLOADS
    assert len(workloads) >= 8 and len({w.name for w in workloads}) == len(workloads)
    for workload in workloads:
        sources = workload.setup_cells("cuda") + [workload.knob_at(1237, "cuda"), workload.cell_at(1237, "cuda")]
        for source in sources:
            ast.parse(source)  # every cell is plain Python
        assert sum(source.count("1237") for source in sources) == 1, workload.name  # one knob, where it lives
    text = "\n".join(w.knob + w.cell + "".join(w.setup) for w in workloads)
    for needle in ("torchvision.models.resnet", "timm.create_model", "BertConfig", "AdamW", "nn.GRU", "nn.LSTM",
                   "torch.autocast", "DataLoader(", ".eval()", 'config = {{"'):
        assert needle in text, needle
    # inference without no_grad keeps its graph; the one under no_grad holds only weights and its outputs
    assert [w.name for w in workloads if "no_grad" in w.cell] == ["gpt2_850m_inference_no_grad"]
    assert any(not w.knob and "optimizer = torch.optim" in w.cell for w in workloads)  # builds its own


def test_cli_says_what_to_do_on_bad_input(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_module.main(["--workloads", "nope"])
    assert exit_info.value.code == 2 and "unknown workload" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_module.main(["--part", "5/3", "--device", "cpu"])
    assert "K must be between 1 and N" in capsys.readouterr().err


# -- the real shell path, on a simulated card ------------------------------------------------------
def test_the_sweep_runs_oomfix_and_the_peers_in_a_real_shell(tmp_path, capsys, monkeypatch):
    """The sweep end to end on a simulated 2 GiB card whose cell needs 300 MiB whatever the batch plus
    37 MiB per item: the oracle is exact, every finder runs from the same start, memory comes back."""
    pytest.importorskip("torch")
    from tests.fakes import GiB, MiB
    from tests.oomfix.simulated import SimulatedCell, capped_machine, fake_hardware

    machine = capped_machine(2 * GiB, held_bytes=64 * MiB)
    cell = SimulatedCell(machine, lambda batch: 300 * MiB + 37 * MiB * batch)
    oracle = cell.largest_fitting(4096)
    workload = bench_module.Workload(
        "simulated", "a simulated step", (), "",
        "batch_size = {batch}\nx = list(range(3))\ntrain_step(batch_size)\nfinished = batch_size\n",
    )
    bench = bench_module.ShellBench("cpu", hardware=fake_hardware(machine),
                                    allocated=lambda: machine.gpus[0].allocated, inject={"train_step": cell.train_step})
    results = {"device": "simulated", "versions": {}, "date": "now", "workloads": {}, "cases": [], "parts": {}}
    out = tmp_path / "sweep.json"

    def write():
        out.write_text(json.dumps(bench_module.merge(None, results)))

    ratios = (1.5, 16.0)  # accelerate's x0.9 from 64x is 40 tries, each with its own gc.collect(): slow on CPU
    monkeypatch.setattr(bench_module, "TRACES_DIR", tmp_path / "traces")
    try:
        bench_module.sweep(bench, [workload], ratios, results, write)
    finally:
        bench.close()
    saved = json.loads(out.read_text())
    for case in saved["cases"]:  # --traces: every try the fix ran, for replaying its next runs offline
        start = case["start_batch"]
        with gzip.open(tmp_path / "traces" / f"simulated_x{start}.tries.pkl.gz") as file:
            kept = pickle.load(file)
        assert [(batch, fitted) for batch, fitted, _, _ in kept["tries"]] == [
            (t["batch"], t["fitted"]) for t in case["oomfix"]["tries"]]
        assert kept["next_runs_start"] == ()  # no CUDA here; the cap is the case's cap_bytes
    assert saved["workloads"]["simulated"]["oracle_batch"] == oracle
    assert [c["start_ratio"] for c in saved["cases"]] == list(ratios)
    accelerate_installed = importlib.util.find_spec("accelerate") is not None
    for case in saved["cases"]:
        assert {"workload", "start_ratio", "start_batch", "oracle_batch", "found_batch", "reruns", "accelerate",
                "halving"} <= set(case)
        assert case["start_batch"] == bench_module.start_batch(oracle, case["start_ratio"])
        assert "error" not in case["oomfix"], case["oomfix"]
        # %oomfix: a fitted try really fits the simulated card, within its default 3 reruns
        assert case["found_batch"] is not None and 0 < case["found_batch"] <= oracle, case["oomfix"]
        assert 1 <= case["reruns"] <= 3
        assert len(case["oomfix"]["allocated_at_each_try_start_bytes"]) == case["reruns"]
        assert case["oomfix"]["allocated_when_failed_cell_started_bytes"] == 64 * MiB
        # the simulated step frees what it allocated even when it fails: every try starts where the cell did
        assert case["oomfix"]["most_held_at_a_try_start_above_failed_cell_bytes"] == 0
        # halving: the first of start, start/2, ... that fits
        half = case["halving"]
        batch, tries = case["start_batch"], 1
        while batch > oracle:
            batch, tries = batch // 2, tries + 1
        assert (half["found_batch"], half["tries"]) == (batch, tries)
        if accelerate_installed:
            assert case["accelerate"]["found_batch"] <= oracle and case["accelerate"]["tries"] >= 2
        else:
            assert "not installed" in case["accelerate"]["error"]
        assert case["memory_back_to_baseline"]
    # the peers' failed tries were forgotten: nothing the failing cell bound is left in the namespace
    assert machine.gpus[0].allocated == 64 * MiB
    summary_out = bench_module.main(["--summary", "--out", str(out)])
    assert summary_out == 0 and "%oomfix below 0.90" in capsys.readouterr().out


def test_a_peers_failed_try_leaves_no_binding_behind():
    pytest.importorskip("torch")
    bench = bench_module.ShellBench("cpu")
    workload = bench_module.Workload(
        "raises", "fails above 10", ("kept = 'setup'",), "",
        "leftover = {batch}\nif {batch} > 10:\n    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2 GiB')\n",
    )
    try:
        with bench.peer(workload, 40) as run:
            assert run(40) is False
            assert "leftover" not in bench.shell.user_ns and bench.shell.user_ns["kept"] == "setup"
            assert run(10) is True and bench.shell.user_ns["leftover"] == 10
    finally:
        bench.close()
    assert "kept" not in bench.shell.user_ns


# -- a fix that chunks the whole data -------------------------------------------------------------
def test_a_chunked_fix_is_measured_against_the_largest_chunk_over_the_starts_data():
    """Inference over a whole tensor: ``%oomfix`` keeps every row and shrinks a chunk. The data at the
    start stays allocated, so the largest chunk that fits is below the workload's own oracle, and it
    is what the fix is measured against; the peers shrink the data itself and keep the workload's."""
    import contextlib
    import re

    from jupyter_cudamem.oomfix.whole_data import CHUNKED_NOTE

    limit_rows = 120  # over the start's data, chunks of up to 120 rows fit

    class Bench:
        probes: list[int] = []

        def oomfix(self, workload, start):
            source = f"batch = randn({start})\npreds = torch.cat([model(_chunk).detach() for _chunk in batch.split(116)])\n"
            return {"found_batch": 116, "reruns": 3, "notes": [CHUNKED_NOTE + "the cell computes preds ..."],
                    "fixed_source": source}

        def runs_fitting(self, workload, batch, runs=bench_module.STEADY_RUNS, cell=None):
            rows = int(re.search(r"\.split\((\d+)\)", cell).group(1))
            assert f"randn({batch})" in cell  # the start's data, whatever chunk
            self.probes.append(rows)
            return runs if rows <= limit_rows else 0

        def next_runs_at(self, workload, batch):
            return bench_module.next_runs_record([batch <= 222] * 3, None)

        def release(self):
            return 0

        @contextlib.contextmanager
        def peer(self, workload, start):
            yield lambda batch: batch <= 222

    workload = bench_module.Workload("inference", "whole data", (), "", "batch = randn({batch})\npreds = model(batch)\n")
    case = bench_module.run_case(Bench(), workload, 64.0, 222)
    assert case["oracle_batch"] == limit_rows and case["unchunked_oracle_batch"] == 222
    assert case["found_fraction"] == round(116 / limit_rows, 4)
    fractions = {finder: bench_module._fractions([case], finder)[0] for finder in ("oomfix", "halving")}
    assert fractions["oomfix"] == 116 / limit_rows and fractions["halving"] <= 1.0
    assert case["halving"]["found_batch"] <= 222 and fractions["halving"] == case["halving"]["found_batch"] / 222
    # Not chunked, or the chunk not written where the note says: no template, the oracle stands.
    assert bench_module.chunk_template(["another note"], "x.split(116)", 116) is None
    assert bench_module.chunk_template([CHUNKED_NOTE], "x.split(117)", 116) is None
    assert bench_module.chunk_template([CHUNKED_NOTE], "x.split(116)", 116) == "x.split({rows per chunk})"


# -- where users hit OOM: the workloads, their measured oracles and fixed bytes ---------------------
def test_start_ratios_are_no_powers_of_two():
    # halving from 2**k x the largest lands on it exactly, by construction
    assert bench_module.RATIOS == (1.1, 1.5, 3.0, 10.0, 50.0)
    assert not any(math.log2(r).is_integer() for r in bench_module.RATIOS)


ISSUE_40_WORKLOADS = {"transformer_lm_adamw_loop4_from_earlier_cell", "lstm_classifier_adam_built_in_cell",
                      "t5_base_finetune_adamw_from_earlier_cell"}
UNSEEN_WORKLOADS = {"gpt2_from_config_loop3_adamw_from_earlier_cell", "qwen2_bf16_weights_adamw_loop2_from_earlier_cell",
                    "roberta_sgd_momentum_loop_over_batches_from_earlier_cell",
                    "swin_clip_grad_scheduler_loop3_from_earlier_cell", "vit_b16_384_checkpointing_bf16_built_in_cell",
                    "distilbert_fp16_scaler_zero_grad_first_loop3_from_earlier_cell",
                    "whisper_from_config_seq2seq_adamw_from_earlier_cell", "opt_adafactor_loop2_from_earlier_cell"}
STEADY_ONLY = ISSUE_40_WORKLOADS | UNSEEN_WORKLOADS
"""Written with the steady oracle: no single-run oracle was measured of them."""


def test_the_committed_oracles_span_where_users_hit_oom():
    """The measured oracles (results/oomfix_oracles.json) are of the cells as committed, and they put
    the workloads where the issue asks: a third or more with a largest batch of 64 or less, two or
    more of 8 or less, three or more whose weights, gradients and optimizer state are half the cap."""
    saved = json.loads(bench_module.ORACLES.read_text())["workloads"]
    workloads = [w for w in bench_module.WORKLOADS if w.name not in STEADY_ONLY]
    assert len(workloads) >= 15 and set(saved) == {w.name for w in workloads}
    for workload in workloads:
        assert saved[workload.name]["cells_digest"] == workload.cells_digest(), f"{workload.name}: measure it again"
    steady = json.loads(bench_module.ORACLES.read_text())[bench_module.STEADY_SECTION]
    for workload in bench_module.WORKLOADS:  # every workload has its steady oracle, of the cells as written
        assert steady[workload.name]["cells_digest"] == workload.cells_digest(), f"{workload.name}: measure it again"
    oracles = {name: entry["oracle_batch"] for name, entry in saved.items()}
    shares = {name: entry["fixed_bytes"] / entry["cap_bytes"] for name, entry in saved.items()}
    assert sum(o <= 64 for o in oracles.values()) >= max(5, len(workloads) / 3)
    assert sum(o <= 8 for o in oracles.values()) >= 2
    assert sum(share >= 0.5 for share in shares.values()) >= 3
    assert all(entry["cap_bytes"] == 6 * 2**30 for entry in saved.values())
    # the issue's own example: BERT-base, sequence 256, AdamW in the cell: 34 fits under 6 GiB
    assert oracles["bert_base_seq256_adamw_in_cell"] == 34


def test_a_saved_oracle_is_reused_only_for_the_same_cells_device_and_cap():
    workload = bench_module.Workload("w", "k", ("x = 1",), "", "y = {batch}\n")
    entry = {"oracle_batch": 7, "fixed_bytes": 100, "cells_digest": workload.cells_digest(), "device": "GPU",
             "cap_bytes": 1024, "date": "then"}
    saved = {"workloads": {"w": entry}}
    assert bench_module.reusable_oracle(saved, workload, "GPU", 1024)["oracle_batch"] == 7
    assert bench_module.reusable_oracle(saved, workload, "another GPU", 1024) is None
    assert bench_module.reusable_oracle(saved, workload, "GPU", 2048) is None
    changed = bench_module.Workload("w", "k", ("x = 2",), "", "y = {batch}\n")
    assert bench_module.reusable_oracle(saved, changed, "GPU", 1024) is None
    assert bench_module.reusable_oracle({"workloads": {"w": {**entry, "fixed_bytes": None}}}, workload, "GPU", 1024) is None
    assert bench_module.reusable_oracle(None, workload, "GPU", 1024) is None


def test_the_cpu_check_shrinks_what_it_says_and_only_on_cpu():
    for workload in bench_module.WORKLOADS:
        written = "".join(workload.setup) + workload.knob + workload.cell
        for large, _tiny in workload.small:
            assert large in written, (workload.name, large)
        cuda = workload.setup_cells("cuda") + [workload.knob_at(3, "cuda"), workload.cell_at(3, "cuda")]
        cpu = workload.setup_cells("cpu") + [workload.knob_at(3, "cpu"), workload.cell_at(3, "cpu")]
        assert not any(large in "".join(cpu) for large, _ in workload.small), workload.name
        assert all(large in "".join(cuda) for large, _ in workload.small), workload.name
    assert sum(bool(w.small) for w in bench_module.WORKLOADS) >= 6


def test_held_by_models_counts_each_storage_once():
    torch = pytest.importorskip("torch")
    from torch import nn

    model = nn.Sequential(nn.Linear(10, 20), nn.BatchNorm1d(20))
    tied = nn.Linear(10, 20)
    tied.weight = model[0].weight  # shares the first layer's weight storage
    optimizer = torch.optim.AdamW(model.parameters())
    # weights: Linear 10*20 + 20 = 220 floats, BatchNorm 2*20 = 40 floats -> 260 * 4 = 1040 bytes;
    # buffers: running mean and var 2*20 floats (160 bytes) and num_batches_tracked (one int64: 8)
    # -> 1208; the tied layer adds only its own bias (20 floats: 80). Before a step no .grad exists:
    # the optimizer's 4 parameters are counted at their own size (1040) as set to None.
    before = bench_module.held_by_models({"model": model, "tied": tied, "optimizer": optimizer}, "cpu")
    assert before == {"fixed_bytes": 1288 + 1040, "weights_bytes": 1288, "gradients_bytes": 0,
                      "gradients_set_to_none_bytes": 1040, "optimizer_state_bytes": 0}
    model(torch.randn(4, 10)).sum().backward()
    optimizer.step()
    after = bench_module.held_by_models({"model": model, "optimizer": optimizer, "_": model, "_3": optimizer}, "cpu")
    # AdamW: exp_avg and exp_avg_sq per parameter (2 * 1040) and a one-float step per parameter (4 * 4)
    assert after == {"fixed_bytes": 1208 + 1040 + 2096, "weights_bytes": 1208, "gradients_bytes": 1040,
                     "gradients_set_to_none_bytes": 0, "optimizer_state_bytes": 2096}
    optimizer.zero_grad()
    assert bench_module.held_by_models({"model": model, "optimizer": optimizer}, "cpu")["fixed_bytes"] == 1208 + 1040 + 2096
    # only the device's memory is counted
    assert bench_module.held_by_models({"model": model, "optimizer": optimizer}, "cuda")["fixed_bytes"] == 0


def test_a_run_of_oomfix_alone_keeps_the_peers_measured_earlier():
    peers_run = {"date": "2026-01-01", "workloads": {"a": {"oracle_batch": 10}, "b": {"oracle_batch": 20}},
                 "cases": [{k: v for k, v in _case("a", 3.0, 10, None, None, 9, 10, 7, 3).items()
                            if k not in ("found_batch", "reruns")},
                           {k: v for k, v in _case("b", 3.0, 20, None, None, 18, 12, 15, 3).items()
                            if k not in ("found_batch", "reruns")}],
                 "parts": {"peers": {}}}
    ours_a = {k: v for k, v in _case("a", 3.0, 10, 9, 2, 0, 1, 0, 1).items() if k not in ("accelerate", "halving")}
    ours_a["oomfix"] = {"tries": []}
    ours_b = {k: v for k, v in _case("b", 3.0, 20, 19, 3, 0, 1, 0, 1).items() if k not in ("accelerate", "halving")}
    ours_b["oomfix"], ours_b["start_batch"] = {"tries": []}, 61  # another start: the peers do not apply
    ours = {"date": "2026-02-02", "workloads": {"a": {}, "b": {}}, "cases": [ours_a, ours_b], "parts": {"1/1 oomfix": {}}}
    merged = bench_module.merge(peers_run, ours)
    a, b = merged["cases"]
    assert (a["found_batch"], a["accelerate"]["found_batch"], a["halving"]["found_batch"]) == (9, 9, 7)
    assert a["accelerate"]["measured"] == a["halving"]["measured"] == "2026-01-01"
    assert "accelerate" not in b and "halving" not in b and b["found_batch"] == 19
    # the other order: %oomfix first, the peers after; %oomfix's fields stay
    merged = bench_module.merge(bench_module.merge(None, {**ours, "cases": [ours_a]}), {**peers_run, "cases": peers_run["cases"][:1]})
    (a,) = [c for c in merged["cases"] if c["workload"] == "a"]
    assert (a["found_batch"], a["reruns"], a["halving"]["found_batch"]) == (9, 2, 7) and "oomfix" in a


def test_goal_per_case_a_whole_sample_when_small_else_ninety_percent_never_below_halving():
    def case(oracle, found, reruns=2, halving=None):
        c = {"workload": "w", "start_ratio": 3.0, "start_batch": 3 * oracle, "oracle_batch": oracle,
             "found_batch": found, "reruns": reruns}
        if halving is not None:
            c["halving"] = {"found_batch": halving, "tries": 2, "reruns": 1}
        return c

    assert bench_module.goal_misses(case(3, 2)) == []        # 3 - 1
    assert bench_module.goal_misses(case(3, 1)) != []
    assert bench_module.goal_misses(case(1, 1)) == []
    assert bench_module.goal_misses(case(1, None)) != []     # found nothing: below a batch of 1
    assert bench_module.goal_misses(case(34, 31)) == []      # 31 >= 0.9 x 34 = 30.6
    assert bench_module.goal_misses(case(34, 30)) != []
    assert bench_module.goal_misses(case(11, 10)) == []      # 10 >= 9.9
    assert bench_module.goal_misses(case(34, 31, halving=33))[0].startswith("below halving")
    assert bench_module.goal_misses(case(34, 33, halving=33)) == []
    assert bench_module.goal_misses(case(34, 33, reruns=4)) == ["4 reruns"]


def test_summary_by_regime_and_the_goal_per_case(capsys):
    cap = 6 * 2**30

    def case(workload, oracle, found, halving, fixed):
        return {**_case(workload, 3.0, oracle, found, 2, found, 5, halving, 2), "fixed_bytes": fixed, "cap_bytes": cap}

    results = {"cases": [case("llm", 3, 2, 1, 3.3 * 2**30), case("vit", 48, 40, 24, 1.3 * 2**30),
                         case("vitl", 23, 23, 23, 3.2 * 2**30), case("cnn", 360, 350, 180, 0.01 * 2**30)]}
    summary = bench_module.summarize(results)
    by_largest = summary["by_largest"]
    # largest <= 10: llm 2/3; 11-64: vit 40/48 = 0.833, vitl 1.0; > 64: cnn 350/360 = 0.972
    assert by_largest["largest <= 10"]["oomfix"] == {"min": 0.667, "median": 0.667, "next_runs_failed": 0}
    assert by_largest["largest 11-64"]["oomfix"] == {"min": 0.833, "median": 0.917, "next_runs_failed": 0}
    assert by_largest["largest > 64"]["cases"] == 1 and by_largest["largest > 64"]["halving"]["min"] == 0.5
    by_fixed = summary["by_fixed_share"]
    assert by_fixed["fixed >= 0.5 of cap"]["cases"] == 2 and by_fixed["fixed < 0.5 of cap"]["cases"] == 2
    assert by_fixed["fixed >= 0.5 of cap"]["oomfix"]["median"] == round((2 / 3 + 1) / 2, 3)
    goal = summary["goal"]
    assert list(goal["cases_missing"]) == ["vit x3"] and not goal["met"]  # 40 < 0.9 x 48 = 43.2
    # median of 0.667, 0.833, 0.972, 1.0 is 0.903: below 0.95
    assert summary["oomfix"]["found_over_oracle_median"] == 0.903 and not goal["median_met"]
    text = bench_module.summary_text(summary)
    assert "misses: vit x3: found 40 where 48 fits (0.83 < 0.90)" in text and "NOT MET" in text


def test_a_run_of_the_peers_alone_is_summarized_without_oomfix_figures():
    peers_only = {k: v for k, v in _case("a", 3.0, 100, None, None, 95, 12, 75, 3).items()
                  if k not in ("found_batch", "reruns")}
    summary = bench_module.summarize({"cases": [peers_only]})
    assert summary["oomfix"]["found_over_oracle_median"] is None and summary["oomfix"]["cases_below_goal"] == []
    assert summary["halving"]["found_over_oracle_median"] == 0.75
    assert summary["goal"]["cases_checked"] == 0 and not summary["goal"]["met"]


def test_cli_refuses_an_unknown_finder(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_module.main(["--finders", "oomfix,lightning", "--device", "cpu"])
    assert exit_info.value.code == 2 and "--finders takes names from" in capsys.readouterr().err


def test_cli_merges_parts_into_out(tmp_path, capsys):
    peers = {"date": "d1", "workloads": {"a": {}}, "cases": [
        {k: v for k, v in _case("a", 3.0, 10, None, None, 9, 10, 7, 3).items() if k not in ("found_batch", "reruns")}],
        "parts": {"peers": {}}}
    ours = {"date": "d2", "workloads": {"a": {}}, "cases": [
        {**{k: v for k, v in _case("a", 3.0, 10, 9, 2, 0, 1, 0, 1).items() if k not in ("accelerate", "halving")},
         "oomfix": {}}], "parts": {"1/1 oomfix": {}}}
    (tmp_path / "peers.json").write_text(json.dumps(peers))
    (tmp_path / "part1.json").write_text(json.dumps(ours))
    out = tmp_path / "sweep.json"
    assert bench_module.main(["--merge", str(tmp_path / "peers.json"), str(tmp_path / "part1.json"), "--out", str(out)]) == 0
    (case,) = json.loads(out.read_text())["cases"]
    assert (case["found_batch"], case["halving"]["found_batch"], case["halving"]["measured"]) == (9, 7, "d1")
    with pytest.raises(SystemExit):
        bench_module.main(["--merge", str(tmp_path / "nope.json"), "--out", str(out)])
    assert "no such part file" in capsys.readouterr().err


# -- issue 40: the steady state -------------------------------------------------------------------
def _runs_fitting(steady, single):
    """A cell whose every run fits up to ``steady``, whose first run fits up to ``single`` (the second
    holds what the first made), and nothing above."""
    def runs_fitting(batch):
        return bench_module.STEADY_RUNS if batch <= steady else 1 if batch <= single else 0
    return runs_fitting


@pytest.mark.parametrize("steady,single", [(0, 0), (0, 3), (1, 1), (2, 4), (29, 45), (45, 45), (141, 195), (95, 95),
                                           (700, 3390)])
def test_the_steady_oracle_from_a_bound_never_runs_above_it(steady, single):
    found, probes = bench_module.steady_largest(_runs_fitting(steady, single), single_run=single, bound=True)
    assert found == steady
    assert all(batch <= single for batch, _ in probes)
    assert all(runs == _runs_fitting(steady, single)(batch) for batch, runs in probes)
    if steady == single and single:
        assert probes == [(single, bench_module.STEADY_RUNS)]  # one probe: the bound keeps fitting
    if steady:  # both sides of the answer were run, or the answer is the bound
        assert (steady, bench_module.STEADY_RUNS) in probes
        assert steady == single or any(batch == steady + 1 for batch, _ in probes)


@pytest.mark.parametrize("steady,single,guess", [(29, 45, 44), (29, 45, 20), (29, 45, 400), (2, 4, 3), (0, 3, 5),
                                                 (700, 3390, 3000)])
def test_the_steady_oracle_from_a_guess_or_from_nothing_is_exact(steady, single, guess):
    for hint in (guess, None):
        found, probes = bench_module.steady_largest(_runs_fitting(steady, single), single_run=hint)
        assert found == steady, hint
        assert len(probes) <= 3 * math.log2(max(single, guess, 16)) + 8


def test_the_single_run_oracle_is_read_from_the_probes_first_runs_where_they_pin_it():
    assert bench_module.single_run_from_probes([(16, 3), (32, 1), (64, 0), (48, 0), (40, 1), (44, 1), (46, 0),
                                                (45, 1)]) == 45
    assert bench_module.single_run_from_probes([(16, 3), (32, 1), (24, 3)]) is None  # no first run failed
    assert bench_module.single_run_from_probes([(16, 0), (8, 0), (2, 0), (1, 0)]) == 0
    assert bench_module.single_run_from_probes([(40, 1), (44, 0)]) is None  # 41-43 never run


def test_next_runs_are_recorded_as_the_user_meets_them():
    assert bench_module.next_runs_record([True, True, True], None) == {
        "next_runs": [True, True, True], "next_runs_fit": True, "next_runs_fitted": 3}
    partial = bench_module.next_runs_record([True, False, False], "OutOfMemoryError: CUDA out of memory")
    assert partial["next_runs_fit"] is False and partial["next_runs_fitted"] == 1
    stopped = bench_module.next_runs_record([True], "NameError: x")  # an error that is not an OOM stops them
    assert stopped["next_runs_fit"] is False and stopped["next_runs_error"] == "NameError: x"


def _steady_case(workload, ratio, oracle, found, next_fit, halving=None, halving_fit=True, reruns=2, fixed=None):
    case = {"workload": workload, "start_ratio": ratio, "start_batch": int(ratio * max(oracle, 1)) + 1,
            "oracle_batch": oracle, "oracle_runs": 3, "found_batch": found, "reruns": reruns,
            "next_runs_fit": next_fit, "next_runs_fitted": 3 if next_fit else 1, "oomfix": {},
            "cap_bytes": 6 * 2**30, "fixed_bytes": fixed if fixed is not None else 2**30}
    if halving is not None:
        case["halving"] = {"found_batch": halving, "tries": 2, "reruns": 1, "next_runs_fit": halving_fit,
                           "next_runs_fitted": 3 if halving_fit else 0}
    return case


def test_the_goal_of_issue_40_asks_next_runs_that_fit_and_halving_only_where_its_answer_holds():
    assert bench_module.goal_misses(_steady_case("w", 1.5, 141, 139, True)) == []
    assert bench_module.goal_misses(_steady_case("w", 1.5, 141, 139, False)) == ["next runs: 1 of 3 fitted"]
    # halving's 150 ran out of memory on its next runs: it sets no bar; where its 140 kept fitting, it does
    assert bench_module.goal_misses(_steady_case("w", 1.5, 141, 139, True, halving=150, halving_fit=False)) == []
    assert bench_module.goal_misses(_steady_case("w", 1.5, 141, 139, True, halving=140))[0].startswith("below halving")
    assert bench_module.goal_misses(_steady_case("w", 1.5, 2, 1, True)) == []  # 2 - 1
    assert bench_module.goal_misses(_steady_case("w", 1.5, 2, 4, False)) == ["next runs: 1 of 3 fitted"]
    # no batch keeps fitting (a cell that builds a large model again): only the next runs and reruns count
    assert bench_module.goal_misses(_steady_case("w", 1.5, 0, 3, False)) == ["next runs: 1 of 3 fitted"]
    assert bench_module.goal_misses(_steady_case("w", 1.5, 0, 3, True, reruns=4)) == ["4 reruns"]
    nothing = {**_steady_case("w", 1.5, 10, None, None), "next_runs_fitted": None}
    assert "next runs not run (nothing fitted)" in bench_module.goal_misses(nothing)


def test_the_summary_of_a_steady_sweep_counts_next_runs_and_judges_by_regime():
    half_cap = 3.5 * 2**30
    cases = [_steady_case("t5", 1.5, 6, 5, True, halving=4, fixed=half_cap),
             _steady_case("t5", 10, 6, 6, True, halving=3, fixed=half_cap),
             _steady_case("loop", 1.5, 25, 24, True, halving=19, fixed=half_cap),
             _steady_case("loop", 10, 25, 31, False, halving=31, halving_fit=False, fixed=half_cap),
             _steady_case("lstm", 1.5, 300, 295, True, halving=225),
             _steady_case("rebuild", 1.5, 0, 3, False, halving=3, halving_fit=False)]
    summary = bench_module.summarize({"cases": cases})
    assert summary["oracle"] == "steady" and summary["cases"] == 5
    assert summary["no_batch_keeps_fitting"] == ["rebuild x1.5"]
    # found/oracle: 5/6 = 0.833, 1.0, 24/25 = 0.96, 31/25 = 1.24, 295/300 = 0.983 -> median 0.983
    assert summary["oomfix"]["found_over_oracle_min"] == 0.833 and summary["oomfix"]["found_over_oracle_median"] == 0.983
    assert summary["oomfix"]["next_runs_failed"] == ["loop x10", "rebuild x1.5"]
    assert summary["halving"]["next_runs_failed"] == ["loop x10", "rebuild x1.5"]
    assert summary["oomfix"]["reruns_max"] == 2
    assert summary["by_largest"]["largest <= 10"]["oomfix"] == {"min": 0.833, "median": 0.917, "next_runs_failed": 0}
    assert summary["by_largest"]["largest 11-64"]["oomfix"]["next_runs_failed"] == 1
    assert summary["by_fixed_share"]["fixed >= 0.5 of cap"]["cases"] == 4
    goal = summary["goal"]
    # t5 x1.5: 5 >= 6 - 1 meets it; loop x10 and the rebuild miss on their next runs
    assert set(goal["cases_missing"]) == {"loop x10", "rebuild x1.5"} and not goal["met"]
    assert goal["median_met"]  # 0.983 >= 0.97
    text = bench_module.summary_text(summary)
    assert "steady-state oracle" in text and "goal (issue 40): NOT MET" in text
    assert "ran out of memory on a next run: loop x10; rebuild x1.5" in text
    assert "no batch keeps fitting" in text and "OLD" not in text
    met = bench_module.summarize({"cases": [c for c in cases if c["workload"] in ("t5", "lstm")]})
    assert met["goal"]["met"], met["goal"]


def test_the_summary_of_the_sweeps_before_issue_40_says_it_is_the_old_oracle():
    saved = json.loads(bench_module.SINGLE_RUN_RESULTS.read_text())
    summary = bench_module.summarize(saved)
    assert summary["oracle"] == "single-run" and summary["single_run_oracle_cases"] == summary["cases"] > 100
    assert not summary["goal"]["met"]  # issue 40's goal needs the steady oracle and the next runs
    text = bench_module.summary_text(summary)
    assert "OLD single-run oracle" in text and "NOT issue 40's goal" in text and "not measured" in text


def test_a_part_replaces_its_ratios_and_keeps_the_others_judged_by_the_same_oracle():
    first = {"date": "d1", "workloads": {"w": {"oracle_batch": 25, "oracle_runs": 3}},
             "cases": [_steady_case("w", 1.5, 25, 24, True), _steady_case("w", 10, 25, 20, True)], "parts": {}}
    again = {"date": "d2", "workloads": {"w": {"oracle_batch": 25, "oracle_runs": 3}},
             "cases": [_steady_case("w", 10, 25, 25, True)], "parts": {}}
    merged = bench_module.merge(bench_module.merge(None, first), again)
    assert sorted((c["start_ratio"], c["found_batch"]) for c in merged["cases"]) == [(1.5, 24), (10, 25)]
    # measured again against another oracle (or the old single-run one): the workload's other cases go
    other = {**again, "workloads": {"w": {"oracle_batch": 24, "oracle_runs": 3}},
             "cases": [_steady_case("w", 10, 24, 24, True)]}
    assert [c["start_ratio"] for c in bench_module.merge(merged, other)["cases"]] == [10]
    old = {"workloads": {"w": {"oracle_batch": 25}}, "cases": [{**_case("w", 1.5, 25, 24, 2, 0, 1, 0, 1)}]}
    assert [c["start_ratio"] for c in bench_module.merge(old, again)["cases"]] == [10]


def test_steady_oracles_are_cached_apart_and_reused_only_for_the_same_cells_device_cap_and_runs(tmp_path):
    workload = bench_module.Workload("w", "k", ("x = 1",), "", "y = {batch}\n")
    entry = {"oracle_batch": 29, "oracle_runs": 3, "fixed_bytes": 100, "cells_digest": workload.cells_digest(),
             "device": "GPU", "cap_bytes": 1024, "date": "now"}
    path = tmp_path / "oracles.json"
    bench_module.save_oracle(path, "w", entry)
    saved = bench_module.load_oracles(tmp_path / "absent.json", path)
    steady = bench_module.STEADY_SECTION
    assert bench_module.reusable_oracle(saved, workload, "GPU", 1024, steady)["oracle_batch"] == 29
    assert bench_module.reusable_oracle(saved, workload, "GPU", 1024) is None  # not a single-run oracle
    assert bench_module.reusable_oracle(saved, workload, "H200", 1024, steady) is None
    one_run = {**entry, "oracle_runs": 1}
    assert bench_module.reusable_oracle({steady: {"w": one_run}}, workload, "GPU", 1024, steady) is None
    # no batch keeps fitting: nothing to read fixed bytes at, and the entry still stands
    zero = {**entry, "oracle_batch": 0, "fixed_bytes": None}
    assert bench_module.reusable_oracle({steady: {"w": zero}}, workload, "GPU", 1024, steady)["oracle_batch"] == 0
    # the single-run oracle: a bound on its own device, a guess on another
    single = {"workloads": {"w": {**entry, "oracle_batch": 45, "oracle_runs": None}}}
    assert bench_module.single_run_hint(single, workload, "GPU", 1024)[:2] == (45, True)
    assert bench_module.single_run_hint(single, workload, "H200", 1024)[:2] == (45, False)
    assert bench_module.single_run_hint(single, workload, "GPU", 2048) is None
    # parts' files merged into one, per section
    other = tmp_path / "other.json"
    bench_module.save_oracle(other, "v", {**entry, "oracle_batch": 7})
    into = tmp_path / "into.json"
    into.write_text(json.dumps(single))
    merged = bench_module.merge_oracles(into, [path, other])
    assert set(merged[steady]) == {"w", "v"} and merged["workloads"]["w"]["oracle_batch"] == 45
    assert json.loads(into.read_text()) == merged


def test_quick_picks_one_workload_per_regime_and_one_that_builds_its_model():
    quick = [w for w in bench_module.WORKLOADS if w.name in bench_module.QUICK_WORKLOADS]
    assert len(quick) == len(bench_module.QUICK_WORKLOADS) == 4 and bench_module.QUICK_RATIOS == (1.5, 10.0)
    assert any("GradScaler" in "".join(w.setup) and "torch.float16" in w.cell for w in quick)
    assert any("for step in range(4)" in w.cell and "AdamW" in "".join(w.setup) for w in quick)
    assert any(not w.setup and "opt = torch.optim" in w.cell for w in quick)  # builds model and optimizer again
    assert set(bench_module.QUICK_WORKLOADS) >= ISSUE_40_WORKLOADS


def test_the_estimate_prints_seconds_per_workload_without_a_gpu(capsys):
    assert bench_module.main(["--estimate", "--quick"]) == 0
    out = capsys.readouterr().out
    for name in bench_module.QUICK_WORKLOADS:
        line = next(line for line in out.splitlines() if name in line)
        assert int(line.split("total")[1].split()[0]) > 0
    assert "all:" in out


class _State:
    """What a first step makes and later runs hold (an optimizer's state), drawn on a simulated card."""

    def __init__(self, cell, size):
        self.machine, self.size = cell.machine, 0
        try:
            cell.machine.allocate(0, size)
        except Exception:
            cell._raise(size)
        self.size = size

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self

    def __del__(self):
        self.machine.free(0, self.size)
        self.size = 0


def test_the_steady_sweep_in_a_real_shell_sees_state_the_first_run_makes(tmp_path, capsys):
    """A simulated 2 GiB card (64 MiB held) whose cell needs 300 MiB plus 37 MiB per item and, after its
    first run, keeps 600 MiB of state: one run fits up to (2048 - 64 - 300) / 37 = 45, every run after
    the first up to (1684 - 600) / 37 = 29. The oracle is 29, bracketed from 45 without running above it;
    each finder's next runs fit exactly where its batch is 29 or less."""
    pytest.importorskip("torch")
    from tests.fakes import GiB, MiB
    from tests.oomfix.simulated import SimulatedCell, capped_machine, fake_hardware

    machine = capped_machine(2 * GiB, held_bytes=64 * MiB)
    cell = SimulatedCell(machine, lambda batch: 300 * MiB + 37 * MiB * batch)
    workload = bench_module.Workload(
        "stateful", "a step whose first run makes state the next runs hold", (), "",
        "batch_size = {batch}\ntrain_step(batch_size)\nstate = globals().get('state') or make_state()\n",
    )
    bench = bench_module.ShellBench("cpu", hardware=fake_hardware(machine),
                                    allocated=lambda: machine.gpus[0].allocated,
                                    inject={"train_step": cell.train_step, "make_state": lambda: _State(cell, 600 * MiB)})
    results = {"device": "simulated", "cap_bytes": 2 * GiB, "versions": {}, "date": "now", "workloads": {},
               "cases": [], "parts": {}}
    single = {"oracle_batch": 45, "cells_digest": workload.cells_digest(), "device": "simulated", "cap_bytes": 2 * GiB}
    kept = {}
    # What the shell imported (torch) frozen, as tests/conftest.py does between modules: the sweep's reruns
    # each collect garbage a few times, and each full pass walked all of it, half the test's time.
    gc.collect()
    gc.freeze()
    try:
        bench_module.sweep(bench, [workload], (1.5, 3.0), results, lambda: None, ("oomfix", "halving"),
                           {"workloads": {"stateful": single}}, lambda name, entry: kept.update({name: entry}))
    finally:
        bench.close()
    entry = kept["stateful"]
    assert entry["oracle_batch"] == 29 and entry["single_run_oracle_batch"] == 45
    assert all(batch <= 45 for batch, _ in entry["oracle_probes"])
    assert [29, 3] in entry["oracle_probes"] and [30, 1] in entry["oracle_probes"]
    assert results["workloads"]["stateful"]["oracle_runs"] == 3
    first, second = results["cases"]
    # from 1.5 x 29 = 44: one run fits (44 <= 45), the second runs out of memory, then %oomfix
    assert first["start_batch"] == 44 and first["oomfix"]["start_runs_fitted"] == 1
    assert second["start_batch"] == 87 and second["oomfix"]["start_runs_fitted"] == 0
    for case in results["cases"]:
        assert case["oracle_batch"] == 29 and case["single_run_oracle_batch"] == 45
        assert case["found_batch"] is not None, case["oomfix"]
        assert case["next_runs_fit"] == (case["found_batch"] <= 29), case["oomfix"]
        assert case["next_runs_fitted"] == (3 if case["found_batch"] <= 29 else case["next_runs_fitted"])
        assert len(case["oomfix"]["next_runs"]) == 3
        half = case["halving"]
        assert half["next_runs_fit"] == (half["found_batch"] <= 29) and len(half["next_runs"]) == 3
        assert case["memory_back_to_baseline"]
    # halving from 44 stops at 44 (its one run fits) and its next runs run out of memory; from 87, 43 the same
    assert (first["halving"]["found_batch"], second["halving"]["found_batch"]) == (44, 43)
    assert first["halving"]["next_runs_fit"] is False and first["halving"]["next_runs_fitted"] == 0
    assert machine.gpus[0].allocated == 64 * MiB
    summary = bench_module.summarize(results)
    assert summary["oracle"] == "steady" and summary["halving"]["next_runs_failed"] == ["stateful x1.5", "stateful x3"]
