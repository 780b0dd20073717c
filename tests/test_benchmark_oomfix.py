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

    tries = (
        TryResult(1, "batch", "b=10", True, False, 100, 0.1, "probe", batch=10),
        TryResult(2, "batch", "b=80", False, True, 700, 0.1, "line", batch=80),
        TryResult(3, "batch", "b=60", True, False, 600, 0.1, "line", batch=60),
    )
    outcome = Outcome("b=800", "b=60", "batch", tries, batch_before=800, batch_after=60, notes=("a note",))
    record = bench_module.read_outcome(outcome)
    assert record["found_batch"] == 60 and record["reruns"] == 3 and record["strategy"] == "batch"
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
