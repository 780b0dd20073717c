"""``%oomfix`` on a cell that builds its MLP and Adam optimizer, started 50 times too large under a 6 GiB cap
(``benchmarks/oomfix.py``'s ``mlp_builds_own_model`` x50): the fixed cell, run three more times in the same
kernel as the user runs it, keeps fitting. The reruns renew cuBLAS's workspace, which the user's next runs
keep, and the rerun that confirms a batch below the last fit starts where that larger run left the
allocator: both must be in the replay that judges the batch (``growth.fitting.next_run``, ``Tries.kept``).

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_oomfix_next_runs_gpu.py -v`` (under a minute).
"""

from __future__ import annotations

from tests.notebook_runner import gpu_notebook_module

torch, pytestmark = gpu_notebook_module()

from benchmarks.oomfix import WORKLOADS  # noqa: E402
from tests.gpu.test_oomfix_gpu import SETUP, STEADY_RUNS, cap, errors_of, execute, last_json, text_of  # noqa: E402

MLP = next(workload for workload in WORKLOADS if workload.name == "mlp_builds_own_model")
FAILED_BATCH = 50 * 73472  # 50 times the steady largest batch the sweep measured (``oomfix_oracles.json``)

REPORT = """print(json.dumps({"batch": _fix.batch_after, "tries": [[t.batch, t.fitted] for t in _fix.tries]}))"""

# The fixed cell as the user runs it: its source as ``%oomfix`` wrote it (the batch in its first line).
NEXT_RUN = """_ran = get_ipython().run_cell(_fix.fixed_source)
if _ran.error_in_exec is not None:
    raise _ran.error_in_exec
"""


def test_the_fixed_cell_keeps_fitting_when_run_again_and_again():
    prelude = "\n".join(MLP.setup_cells("cuda"))
    outputs = execute([SETUP + cap(6), prelude, MLP.cell_at(FAILED_BATCH, "cuda"), "_fix = %oomfix --yes -o", REPORT]
                      + [NEXT_RUN] * STEADY_RUNS, timeout=600)
    setup, built, failed, fixed, report, *next_runs = outputs
    assert errors_of(setup) == errors_of(built) == [] and errors_of(failed) == ["OutOfMemoryError"], text_of(failed)
    result = last_json(report)
    assert 0 < result["batch"] < FAILED_BATCH and len(result["tries"]) <= 3, (result, text_of(fixed))
    assert [errors_of(run) for run in next_runs] == [[]] * STEADY_RUNS, (result, text_of(fixed))
