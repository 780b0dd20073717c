"""The engines table from records written by hand: spread, straggler, shared cards, oomfix lines, flat rows."""

from __future__ import annotations

import pickle

from jupyter_cudamem.engines.records import (
    EngineAnswer,
    EngineCell,
    EngineDevice,
    EngineIdentity,
    EngineReport,
    EngineStatus,
    OomfixSummary,
)
from jupyter_cudamem.engines.table import EnginesHistory, EnginesReport
import pytest

# Nothing here runs a library whose version `make test-min` changes (tests/versioned.py).
pytestmark = pytest.mark.dependency_free

GiB = 1024**3
CARD_A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
CARD_B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"


def device(uuid: str, peak_gib: int, total_gib: int = 80, limit_gib: int | None = None, process_gib: float = 1.0) -> EngineDevice:
    return EngineDevice(
        uuid=uuid,
        name="H100",
        label="cuda:0",
        total_bytes=total_gib * GiB,
        limit_bytes=(limit_gib or total_gib) * GiB,
        peak_allocated_bytes=peak_gib * GiB,
        peak_above_start_bytes=peak_gib * GiB,
        allocated_delta_bytes=GiB,
        reserved_delta_bytes=2 * GiB,
        nvml_used_delta_bytes=None,
        process_bytes=int(process_gib * GiB),
        process_delta_bytes=None,
        outside_pytorch_delta_bytes=None,
    )


def answer(engine: int, host: str, pid: int, *devices: EngineDevice, cells: int = 1, recorded: int = 1, oomfix=None, rank=None) -> EngineAnswer:
    cell_list = tuple(EngineCell(n, f"step({n})", 1000.0 + n, 0.5, None, devices) for n in range(1, cells + 1))
    identity = EngineIdentity(host=host, pid=pid, rank=rank, world_size=None if rank is None else 4)
    report = EngineReport(identity, loaded=True, cells=cell_list, cells_recorded=recorded, oomfix=oomfix)
    return EngineAnswer(engine, EngineStatus.ANSWERED, report)


FIX = OomfixSummary("%oomfix: fits with batch 96 (was 256) after 2 reruns", True, False, "batch", 256, 96, 2, "-a\n+b\n")

ANSWERS = [
    # Listed out of order: the table sorts by engine id.
    answer(2, "host-b", 300, device(CARD_B, 20, total_gib=24), rank=2),
    answer(0, "host-a", 100, device(CARD_A, 10, process_gib=10.5), rank=0),
    answer(1, "host-a", 200, device(CARD_A, 30, limit_gib=40, process_gib=31.0), rank=1, oomfix=FIX),
    EngineAnswer(3, EngineStatus.NO_ANSWER, note="none within 10 s (busy running a cell, or hung)"),
]


def test_spread_and_straggler_by_share_of_each_engines_limit():
    report = EnginesReport(ANSWERS)
    spread = report.spread
    assert spread is not None
    # Peaks 10, 30 and 20 GiB: 20 GiB apart. Shares: 10/80 = 12.5%, 30/40 = 75% (a cap), 20/24 = 83.3%.
    assert (spread.engines, spread.lowest_peak_bytes, spread.highest_peak_bytes, spread.spread_bytes) == (3, 10 * GiB, 30 * GiB, 20 * GiB)
    assert spread.straggler_engine == 2 and spread.straggler_host == "host-b"
    assert round(spread.straggler_share, 4) == round(20 / 24, 4)


def test_text_names_shared_cards_by_host_and_uuid_and_the_engines_oomfix():
    text = EnginesReport(ANSWERS).text()
    assert "engines 0, 1 share H100 GPU-aaaaaaaa… on host-a; NVML per process: engine 0 (pid 100) 10.50 GiB, engine 1 (pid 200) 31.00 GiB" in text
    assert "closest to its limit: engine 2 on host-b cuda:0 GPU-bbbbbbbb…, 20.00 GiB of 24.00 GiB (83.3%)" in text and "share H100 GPU-bbbbbbbb" not in text
    assert "%oomfix on the engines: engine 1: %oomfix: fits with batch 96 (was 256) after 2 reruns" in text
    assert "no answer: none within 10 s" in text
    assert "peaks from 10.00 GiB to 30.00 GiB (20.00 GiB apart)" in text
    lines = text.splitlines()
    assert [line.split()[0] for line in lines[3:7]] == ["0", "1", "2", "3"]
    assert " 2/4 " in lines[5]  # rank 2 of a world of 4
    assert "75.0%" in lines[4] and "83.3%" in lines[5]


def test_html_marks_the_straggler_row():
    html = EnginesReport(ANSWERS)._repr_html_()
    rows = [row.split("</tr>")[0] for row in html.split("<tr")]
    straggler = [row for row in rows if "host-b" in row and "<td" in row]
    assert len(straggler) == 1 and 'style="color:#d62728"' in straggler[0]
    assert sum('color:#d62728' in row for row in rows) == 1


def test_flat_rows_and_pickled_records():
    rows = EnginesReport(ANSWERS).rows()
    assert [(r["engine"], r["status"], r["peak_allocated_bytes"], r["device_uuid"]) for r in rows] == [
        (0, "answered", 10 * GiB, CARD_A),
        (1, "answered", 30 * GiB, CARD_A),
        (2, "answered", 20 * GiB, CARD_B),
        (3, "no answer", None, None),
    ]
    assert pickle.loads(pickle.dumps(ANSWERS)) == ANSWERS


def test_one_engine_has_no_spread():
    assert EnginesReport(ANSWERS[1:2]).spread is None
    assert "spread" not in EnginesReport(ANSWERS[1:2]).text()


def test_history_lists_each_engines_cells_and_says_when_there_are_more():
    history = EnginesHistory([answer(0, "host-a", 100, device(CARD_A, 1), cells=2, recorded=5), answer(1, "host-a", 200, device(CARD_A, 2))])
    text = history.text()
    assert [line.split()[0] for line in text.splitlines()[3:6]] == ["0", "0", "1"]
    assert "[1] step(1)" in text and "[2] step(2)" in text
    assert "engine 0: the latest 2 of 5 measured cells" in text
    assert "engine 1:" not in text
