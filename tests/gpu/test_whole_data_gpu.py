"""An inference cell over a whole tensor under a small cap ends with every row computed or with a
refusal, never with a partial result under the cell's names (``%oomfix``, ``batch.whole``)."""

from __future__ import annotations

import pytest

from tests.notebook_runner import gpu_notebook_module

torch, pytestmark = gpu_notebook_module()

from tests.gpu.test_oomfix_gpu import SETUP, cap, errors_of, execute, last_json, text_of  # noqa: E402


MODEL = """classifier = nn.Sequential(nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 10)).cuda()
features_all = torch.randn(65536, 2048, device="cuda")  # 512 MiB of data from an earlier cell
"""

ROWS = 65536
CELLS = {
    # the tutorial's cell: the batch sizes the data, and the predictions over it are kept
    "sized by the batch": f"""batch_size = {ROWS}
features = torch.randn(batch_size, 2048, device="cuda")
predictions = classifier(features).argmax(dim=1)
""",
    # the data from an earlier cell, passed whole
    "whole tensor": "predictions = classifier(features_all).argmax(dim=1)\n",
    # a slice as long as the data
    "slice": f"predictions = classifier(features_all[:{ROWS}]).argmax(dim=1)\n",
}

CHECK = (
    "print(json.dumps({'rows': predictions.shape[0] if 'predictions' in globals() else None, "
    "'allocated': torch.cuda.memory_allocated()}))"
)


@pytest.mark.parametrize("case", list(CELLS))
def test_inference_over_the_whole_data_keeps_every_row(case):
    # 65,536 rows through a 4096-wide hidden layer with autograd on: over 2 GiB of activations, under a 2 GiB cap.
    outputs = execute([SETUP + cap(2) + MODEL, CELLS[case], "%oomfix --yes --verbose", CHECK])
    setup, failed, fixed, check = outputs
    assert errors_of(setup) == [], text_of(setup)
    assert errors_of(failed) == ["OutOfMemoryError"], text_of(failed)
    report = text_of(fixed)
    result = last_json(check)
    if result["rows"] is not None:
        # Whatever fixed it, the result covers every row; chunks (not a smaller batch) when the batch did.
        assert result["rows"] == ROWS, report
        assert "Fixed with" in report, report
        if "smaller batch" in report:
            assert ".split(" in report and "the batch is the data" in report, report
    else:
        # No partial result: the cell's name was never bound, and the report says why in one line.
        assert "does not shrink the batch" in report or "nothing fitted" in report, report


def test_a_result_too_large_for_the_gpu_is_kept_on_the_host():
    # 65,536 rows of 8,192 outputs: a 2 GiB result that cannot come back beside the 512 MiB of data under a
    # 2 GiB cap, whatever the chunk: the chunks' results stay on the host, and every row is computed.
    model = MODEL + 'wide = nn.Linear(2048, 8192).cuda()\n'
    check = ("print(json.dumps({'rows': logits.shape[0] if 'logits' in globals() else None, "
             "'device': str(logits.device) if 'logits' in globals() else None}))")
    outputs = execute([SETUP + cap(2) + model, "logits = wide(features_all)\n", "%oomfix --yes --verbose", check])
    setup, failed, fixed, result_cell = outputs
    assert errors_of(setup) == [], text_of(setup)
    assert errors_of(failed) == ["OutOfMemoryError"], text_of(failed)
    report = text_of(fixed)
    result = last_json(result_cell)
    assert result == {"rows": ROWS, "device": "cpu"}, report
    assert "stay on the host" in report and ".cpu()" in report, report
    assert "Fixed with chunks of" in report, report
