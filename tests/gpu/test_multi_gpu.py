"""Device mapping and multi-device reports on a machine with two or more GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

GiB = 1024**3


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


needs_two = pytest.mark.skipif(_gpu_count() < 2, reason="needs two visible GPUs")

_PROBE = r"""
import json, torch
from jupyter_cudamem.hardware import default_hardware
from jupyter_cudamem.measure import Meter
torch.zeros(1, device="cuda")
hardware = default_hardware()
[device] = hardware.device_map.devices()
nvml_uuid = hardware.nvml.devices()[device.nvml_index].uuid
meter = Meter(hardware)
baseline = meter.start()
kept = torch.empty(1024**3, dtype=torch.uint8, device="cuda:0")
[measured] = meter.stop(baseline).devices
print(json.dumps({"torch_index": device.torch_index, "nvml_index": device.nvml_index, "nvml_uuid": nvml_uuid,
                  "torch_uuid": str(torch.cuda.get_device_properties(0).uuid), "label": measured.device.label,
                  "nvml_delta": measured.nvml_used_delta_bytes, "allocated_delta": measured.allocated_delta_bytes}))
"""


@needs_two
def test_cuda_visible_devices_1_reports_the_right_card():
    environment = dict(os.environ, CUDA_VISIBLE_DEVICES="1")
    output = subprocess.run([sys.executable, "-c", _PROBE], env=environment, capture_output=True, text=True, check=True)
    found = json.loads(output.stdout.strip().splitlines()[-1])
    assert found["torch_index"] == 0 and found["nvml_index"] == 1
    assert found["nvml_uuid"].lower().endswith(found["torch_uuid"].lower())
    assert found["label"] == "cuda:0"
    assert found["allocated_delta"] == GiB
    assert found["nvml_delta"] >= GiB  # seen on NVML's GPU 1, the card cuda:0 really is


@needs_two
def test_a_cell_touching_two_devices_reports_both():
    import torch

    from jupyter_cudamem.hardware import default_hardware
    from jupyter_cudamem.measure import Meter

    for index in (0, 1):
        torch.zeros(1, device=f"cuda:{index}")
    meter = Meter(default_hardware())
    baseline = meter.start()
    first = torch.empty(GiB, dtype=torch.uint8, device="cuda:0")
    second = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda:1")
    measured = {d.device.label: d for d in meter.stop(baseline).devices}
    del first, second
    assert measured["cuda:0"].allocated_delta_bytes == GiB
    assert measured["cuda:1"].allocated_delta_bytes == 2 * GiB
