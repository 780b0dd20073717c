"""``%%cudamem`` on a real GPU: exact figures from the allocator, NVML beyond it, caps and traces."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

GiB = 1024**3
MiB = 1024**2



@pytest.fixture
def real_hardware(torch):
    from jupyter_cudamem.hardware import default_hardware

    return default_hardware()



def test_torch_device_is_matched_to_nvml_by_uuid(real_hardware, torch):
    [device, *_] = real_hardware.device_map.devices()
    assert device.torch_index == 0 and device.nvml_index is not None
    gpu = real_hardware.nvml.devices()[device.nvml_index]
    from jupyter_cudamem.hardware import normalize_uuid

    assert normalize_uuid(gpu.uuid) == normalize_uuid(str(torch.cuda.get_device_properties(0).uuid))


def test_one_gib_temporary_peak_within_1_percent_and_delta_zero(real_hardware, torch):
    from jupyter_cudamem.measure import Meter

    meter = Meter(real_hardware)
    baseline = meter.start()
    temporary = torch.ones(GiB // 4, dtype=torch.float32, device="cuda")  # 1 GiB
    temporary.mul_(2)
    del temporary
    [device] = meter.stop(baseline).devices
    assert device.peak_above_start_bytes == pytest.approx(GiB, rel=0.01)
    assert device.allocated_delta_bytes == 0


def test_cell_magic_on_a_real_gpu(shell, capsys):
    result = shell.run_cell("%%cudamem\nt = torch.ones(256 * 1024**2, device='cuda')\ndel t")
    assert result.success
    out = capsys.readouterr().out
    assert "cuda:0 peak " in out and "+1.00 GiB above start" in out and "Δ allocated 0 B" in out


def test_cupy_allocation_shows_in_nvml_not_in_pytorch(real_hardware, torch):
    cupy = pytest.importorskip("cupy")
    from jupyter_cudamem.measure import Meter

    meter = Meter(real_hardware, devices=[0])
    baseline = meter.start()
    block = cupy.cuda.alloc(GiB)  # through CuPy's own pool, outside PyTorch
    [device] = meter.stop(baseline).devices
    try:
        assert device.allocated_delta_bytes == 0 and device.reserved_delta_bytes == 0
        assert device.nvml_used_delta_bytes >= GiB * 0.99
        assert device.outside_pytorch_delta_bytes >= GiB * 0.99
    finally:
        del block
        cupy.get_default_memory_pool().free_all_blocks()


def test_limit_makes_3gib_fail_under_2gib_and_is_lifted_afterwards(shell, torch):
    result = shell.run_cell("%%cudamem --limit 2GiB\nbig = torch.empty(3 * 1024**3, dtype=torch.uint8, device='cuda')")
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    after = shell.run_cell("big = torch.empty(3 * 1024**3, dtype=torch.uint8, device='cuda'); del big")
    assert after.success


def test_trace_names_the_users_line(shell, capsys, tmp_path):
    shell.run_line_magic("config", f"CudaMem.trace_dir = {str(tmp_path)!r}")
    result = shell.run_cell(
        "%%cudamem --trace -v\n"
        "small = torch.empty(16 * 1024**2, dtype=torch.uint8, device='cuda')\n"
        "large = torch.empty(512 * 1024**2, dtype=torch.uint8, device='cuda')  # the big one\n"
        "del small, large"
    )
    assert result.success
    out = capsys.readouterr().out
    top = out.split("top allocation sites")[1].splitlines()[1]
    assert "512.00 MiB" in top and "line 2" in top and "the big one" in top  # body lines, as IPython tracebacks count
    assert list(tmp_path.glob("*.pickle"))
