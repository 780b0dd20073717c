"""A failed try leaves nothing (jupyter_cudamem/reruns/set_aside.py, and the driver's use of it).

Fake tensors (``tests.fakes.FakeTensor`` on a ``FakeMachine``) hold fake GPU memory as long as they
live, as PyTorch's tensors hold the caching allocator's; a fake mover copies them to the host.
"""

from __future__ import annotations

import gc

from jupyter_cudamem.ipython_names import IPYTHON_NAMES, OUTPUT_CACHE_NAMES
from jupyter_cudamem.oomfix.driver import Driver
from jupyter_cudamem.cell.read import read_cell
from jupyter_cudamem.reruns.set_aside import restore_bindings, set_aside
from tests.fakes import FakeMover, FakeOutOfMemoryError, FakeTensor, GiB, MiB
from tests.oomfix.simulated import OutOfMemoryError, capped_machine, fake_hardware, torch_oom_message


def test_a_name_bound_in_a_loop_the_fitted_try_did_not_run_is_given_back():
    machine = capped_machine(4 * GiB)
    namespace = {"out": FakeTensor(100 * MiB, machine=machine), "x": FakeTensor(10 * MiB, machine=machine)}
    aside = set_aside(namespace, read_cell("x = make(b)\nfor _ in range(n):\n    out = model(x)\n").rebinds, FakeMover(machine))
    assert aside.names == ("x", "out")
    namespace["x"] = FakeTensor(10 * MiB, machine=machine)  # a try that fitted bound x, ran no step
    aside.drop_rebound()
    assert aside.names == ("out",)
    assert aside.give_back() == ["out"] and namespace["out"].is_cuda


def test_set_aside_moves_what_the_cell_binds_again_and_gives_it_back():
    machine = capped_machine(4 * GiB)
    namespace = {"x": FakeTensor(1 * GiB, machine=machine), "model": FakeTensor(100 * MiB, machine=machine),
                 "h": FakeTensor(10 * MiB, machine=machine), "_": FakeTensor(1 * MiB, machine=machine)}
    mover = FakeMover(machine)
    aside = set_aside(namespace, read_cell("x = make(batch)\nh = h * 2\nout = model(x)\n").rebinds, mover)
    gc.collect()
    assert aside.names == ("x",) and "x" not in namespace
    assert machine.gpus[0].allocated == 111 * MiB  # the 1 GiB input is on the host now
    assert aside.give_back() == ["x"]
    assert namespace["x"].is_cuda and machine.gpus[0].allocated == 111 * MiB + 1 * GiB


def test_what_no_longer_fits_on_the_device_is_given_back_as_its_host_copy_never_lost():
    machine = capped_machine(4 * GiB)
    namespace = {"x": FakeTensor(1 * GiB, machine=machine)}
    aside = set_aside(namespace, read_cell("x = make(batch)\n").rebinds, FakeMover(machine))
    gc.collect()
    taken = FakeTensor(int(3.5 * GiB), machine=machine)  # what the reruns left holds the room x had
    assert aside.give_back() == ["x"]
    assert aside.left_on_host == ["x"] and namespace["x"].device == "cpu"
    assert namespace["x"].untyped_storage().nbytes() == 1 * GiB
    del taken


def test_restore_bindings_puts_back_the_output_cache_too():
    before = {"a": 1, "_": "older output"}
    after = {"a": 2, "_": "the failed try's tensor", "__": "x", "Out": {}, "_i3": "cell"}
    assert sorted(restore_bindings(after, before)) == ["_", "__", "a"]
    assert after == {"a": 1, "_": "older output", "Out": {}, "_i3": "cell"}


def test_ipython_names_are_never_set_aside_and_a_try_binding_them_is_not_undone_but_for_the_output_cache():
    # Every name of the one list (ipython_names), plus its patterns (_12, _i12, dunders), bound by the cell
    # to GPU memory, and a try that rebinds them all.
    machine = capped_machine(4 * GiB)
    names = sorted(IPYTHON_NAMES | {"_12", "_i12", "__builtins__"})
    namespace = {name: FakeTensor(1 * MiB, machine=machine) for name in names}
    namespace["x"] = FakeTensor(1 * MiB, machine=machine)
    source = "".join(f"{name} = make(1)\n" for name in names) + "x = make(1)\n"
    aside = set_aside(namespace, read_cell(source).rebinds, FakeMover(machine))
    assert aside.names == ("x",)
    before = dict(namespace)
    after = {name: object() for name in namespace}
    assert sorted(restore_bindings(after, before)) == sorted(OUTPUT_CACHE_NAMES)
    assert all(after[name] is not before[name] for name in names if name not in OUTPUT_CACHE_NAMES)


class _Cell:
    """A training cell on a fake machine: binds its input ``x`` (1 MiB per sample), then a forward that
    needs ``forward`` MiB per sample, then a backward; fails with a PyTorch-worded OOM."""

    def __init__(self, machine, namespace, forward_mib=4, backward_mib=2):
        self.machine = machine
        self.namespace = namespace
        self.forward_mib = forward_mib
        self.backward_mib = backward_mib

    def run(self, source):
        ns = self.namespace
        batch = int(source.split("=", 1)[1].split("\n", 1)[0])
        gpu = self.machine.gpus[0]
        try:
            ns["batch_size"] = batch  # bound again by every run, and holding no GPU memory
            ns["x"] = FakeTensor(batch * MiB, machine=self.machine)
            ns["loss"] = FakeTensor(batch * self.forward_mib * MiB, machine=self.machine)  # the graph
            workspace = batch * self.backward_mib * MiB
            self.machine.allocate(0, workspace)
            self.machine.free(0, workspace)
            ns["loss"] = 0.5
            ns["trained"] = batch
            return None
        except FakeOutOfMemoryError:
            allowed = int(gpu.fraction * gpu.total_bytes)
            return OutOfMemoryError(torch_oom_message(batch * MiB, gpu.total_bytes, gpu.total_bytes - gpu.reserved,
                                                      gpu.reserved, allowed, gpu.allocated, 0))


def _fix(forward_mib, backward_mib, cap=2 * GiB, held=300 * MiB, max_tries=3):
    machine = capped_machine(cap, held_bytes=held)
    namespace: dict = {"kept": FakeTensor(0, device="cpu")}
    cell = _Cell(machine, namespace, forward_mib, backward_mib)
    source = "batch_size = 1024\nx = make(batch_size)\nloss = train(x)\n"
    started = machine.gpus[0].allocated
    error = cell.run(source)
    assert error is not None and namespace["x"].is_cuda  # the failed cell bound its 1 GiB input, then failed
    driver = Driver(cell.run, fake_hardware(machine), lambda failed: machine.empty_cache(),
                    strategies=("batch",), max_tries=max_tries, mover=FakeMover(machine))
    outcome = driver.fix(read_cell(source), error, namespace, freed_bytes=0, allocated_before=started)
    return outcome, machine, namespace, started


def test_tries_start_as_the_cells_next_run_will_when_tries_fail_in_forward_and_backward():
    """Until a try fits, every try starts where the failed cell started (its 1 GiB input set aside); after
    one fits, each starts holding what the last try that fitted bound (its input: 1 MiB per sample) at
    the size the try's own batch makes it, as the user's next run of the cell at that batch does; a
    failed try leaves nothing."""
    for forward_mib, backward_mib in ((60, 1), (2, 60)):  # fails in forward / in backward
        outcome, machine, namespace, started = _fix(forward_mib, backward_mib)
        assert outcome.fitted, outcome.text()
        bound_by_last_fit = 0
        for t in outcome.tries:
            held = max(bound_by_last_fit, t.batch * MiB) if bound_by_last_fit else 0
            assert t.allocated_at_start_bytes == started + held, (forward_mib, t)
            if t.fitted:
                bound_by_last_fit = t.batch * MiB
            else:
                assert t.left_bytes == 0 and t.need_bytes is not None
        assert bound_by_last_fit  # a later try started with it: the check above saw both cases
        assert namespace["trained"] == namespace["batch_size"] == outcome.batch_after


def test_a_failed_try_after_one_that_fitted_keeps_the_names_that_hold_no_gpu_memory():
    """A try after a fit refers only weakly to the GPU values the cell binds again (they go at the line
    that binds them, as in the cell's next run); the rest it binds (``batch_size``) is put back whole."""
    machine = capped_machine(2 * GiB, held_bytes=300 * MiB)
    namespace: dict = {}
    cell = _Cell(machine, namespace, 4, 2)
    runs = []

    def second_fails(source):
        runs.append(source)
        if len(runs) == 3:  # the failed cell, a fitted try, then this one: binds, then runs out of memory
            namespace["batch_size"] = 10**6
            namespace["x"] = FakeTensor(MiB, machine=machine)
            return OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB.")
        return cell.run(source)

    source = "batch_size = 1024\nx = make(batch_size)\nloss = train(x)\n"
    started = machine.gpus[0].allocated
    error = cell.run(source)
    runs.append(source)
    driver = Driver(second_fails, fake_hardware(machine), lambda failed: machine.empty_cache(),
                    strategies=("batch",), max_tries=3, mover=FakeMover(machine))
    outcome = driver.fix(read_cell(source), error, namespace, freed_bytes=0, allocated_before=started)
    assert [t.fitted for t in outcome.tries][:2] == [True, False], outcome.text()
    assert namespace["batch_size"] == namespace["trained"] == outcome.batch_after  # never lost
    assert namespace["x"].untyped_storage().nbytes() == outcome.batch_after * MiB


def test_when_every_try_fails_the_set_aside_input_is_given_back():
    outcome, machine, namespace, started = _fix(4000, 1, max_tries=2)  # nothing fits
    assert not outcome.fitted
    assert all(t.allocated_at_start_bytes == started for t in outcome.tries)
    assert namespace["x"].is_cuda  # bound again, on the device, as the failed cell left it
    assert any("bound again" in note for note in outcome.notes)


def test_an_optimizer_rebound_by_the_cell_has_its_state_set_aside_and_given_back():
    """A cell that builds its model and optimizer binds both again: the old Adam state (twice the
    weights) must not stay on the device during the reruns. Its tensors go to the host in place."""
    import torch

    from jupyter_cudamem.sources.torch_host import TorchMover

    class DeviceTensor:  # stands in for a CUDA tensor on a machine without one
        is_cuda = True
        device = "cuda:0"

        def __init__(self, where=None):
            self.where = where or "cuda:0"
            self.is_cuda = self.where != "cpu"

        def detach(self):
            return self

        def to(self, where):
            return DeviceTensor(str(where))

    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.Adam([weight])
    optimizer.state[weight] = {"exp_avg": DeviceTensor(), "exp_avg_sq": DeviceTensor(), "step": torch.tensor(1.0)}
    mover = TorchMover()
    assert mover.holds_gpu(optimizer)
    namespace = {"opt": optimizer}
    aside = set_aside(namespace, read_cell("opt = torch.optim.Adam(params)\n").rebinds, mover)
    assert aside.names == ("opt",) and "opt" not in namespace
    assert not any(getattr(t, "is_cuda", False) for t in optimizer.state[weight].values())
    assert not mover.holds_gpu(optimizer)
    assert aside.give_back() == ["opt"] and namespace["opt"] is optimizer
    assert optimizer.state[weight]["exp_avg"].is_cuda and optimizer.state[weight]["step"].item() == 1.0
    assert not mover.holds_gpu(torch.optim.SGD([weight], lr=0.1))  # no state: nothing to move
