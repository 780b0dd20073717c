"""The ``%oomfix`` sweep's logic on CPU (benchmarks/oomfix.py), so its GPU run works first time: the
oracle's bisection, halving and accelerate's loop counted right, the record schema, parts that split
and merge, the summary, and the real shell path (``%oomfix --yes -o`` in an InteractiveShell) driven
against a simulated card whose memory has an intercept."""

from __future__ import annotations

import ast
import importlib.util
import json
import math
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
        TryResult(3, Strategy.BATCH, "b=60", True, False, 600, 0.1, "line", batch=60),
    )
    outcome = Outcome("b=800", "b=60", Strategy.BATCH, tries, batch_before=800, batch_after=60, notes=("a note",))
    record = bench_module.read_outcome(outcome)
    assert record["found_batch"] == 60 and record["reruns"] == 3 and record["strategy"] == "batch"
    # The record is written as JSON: the strategy as the word it is today.
    assert json.loads(json.dumps(record))["tries"][0]["strategy"] == "batch"
    assert [t["batch"] for t in record["tries"]] == [10, 80, 60]
    assert [t["fitted"] for t in record["tries"]] == [True, False, True]
    assert record["notes"] == ["a note"]


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
def test_the_sweep_runs_oomfix_and_the_peers_in_a_real_shell(tmp_path, capsys):
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
    try:
        bench_module.sweep(bench, [workload], ratios, results, write)
    finally:
        bench.close()
    saved = json.loads(out.read_text())
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

        def fits_cell(self, workload, batch, cell):
            rows = int(re.search(r"\.split\((\d+)\)", cell).group(1))
            assert f"randn({batch})" in cell  # the start's data, whatever chunk
            self.probes.append(rows)
            return rows <= limit_rows

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


def test_the_committed_oracles_span_where_users_hit_oom():
    """The measured oracles (results/oomfix_oracles.json) are of the cells as committed, and they put
    the workloads where the issue asks: a third or more with a largest batch of 64 or less, two or
    more of 8 or less, three or more whose weights, gradients and optimizer state are half the cap."""
    saved = json.loads(bench_module.ORACLES.read_text())["workloads"]
    workloads = bench_module.WORKLOADS
    assert len(workloads) >= 15 and set(saved) == set(bench_module.WORKLOAD_NAMES)
    for workload in workloads:
        assert saved[workload.name]["cells_digest"] == workload.cells_digest(), f"{workload.name}: measure it again"
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
    assert by_largest["largest <= 10"]["oomfix"] == {"min": 0.667, "median": 0.667}
    assert by_largest["largest 11-64"]["oomfix"] == {"min": 0.833, "median": 0.917}
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
