"""``%%cudamem`` reports under a real per-process cap: the tutorials emulate a 4 GiB card with
``torch.cuda.set_per_process_memory_fraction``, and the report must measure against that cap."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

GiB = 1024**3




@pytest.fixture
def four_gib_cap(torch):
    if not hasattr(torch.cuda, "get_per_process_memory_fraction"):
        pytest.skip("this torch cannot report its per-process cap (get_per_process_memory_fraction)")
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(4 * GiB / total, 0)
    yield 4 * GiB, total
    torch.cuda.set_per_process_memory_fraction(1.0, 0)


def test_report_measures_against_the_cap_and_names_it(shell, torch, four_gib_cap):
    from jupyter_cudamem.units import format_bytes

    cap, total = four_gib_cap
    shell.user_ns["GiB"] = GiB
    result = shell.run_cell("report = %cudamem -o t = torch.ones(GiB // 4, device='cuda')")
    assert result.success, result.error_in_exec
    report = shell.user_ns["report"]
    [device] = report.devices
    assert device.cap_bytes == pytest.approx(cap, abs=1024)  # the cap is a float fraction of the total: a few bytes of rounding
    text = report.details_text()
    named = f"of the {format_bytes(device.cap_bytes)} cap (set_per_process_memory_fraction)"
    assert named in text, text
    peak_share = device.peak_allocated_bytes / device.cap_bytes
    assert f"{peak_share:.1%} {named}" in text
    # Free at end is under the cap (at most cap - 1 GiB), never the card's tens of GiB.
    assert device.free_after_bytes <= cap - GiB
    assert f"on a {format_bytes(total)}" in text  # the one total: PyTorch's
    nvml_total = device.after.nvml.total_bytes if device.after.nvml is not None else total
    if nvml_total != total:
        assert text.count(format_bytes(nvml_total)) == 1 and "driver" in text
    shell.run_cell("del t, report")


def test_uncapped_report_is_of_the_card(shell, torch):
    shell.user_ns["GiB"] = GiB
    result = shell.run_cell("report = %cudamem -o t = torch.ones(GiB // 4, device='cuda')")
    assert result.success, result.error_in_exec
    report = shell.user_ns["report"]
    assert report.devices[0].cap_bytes is None and "of card" in report.details_text() and " cap " not in report.text()
    shell.run_cell("del t, report")
