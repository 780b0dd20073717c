"""``reruns.model_state``: what a cell trains is found, copied to the host once and put back exactly,
with real CPU PyTorch objects (jupyter_cudamem/reruns/model_state.py, sources/torch_state.py)."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from jupyter_cudamem.reruns.model_state import HOST_SHARE, Restorer, copy_fits, training_state  # noqa: E402


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1))


def _step(model, optimizer, scheduler=None, steps=2):
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def _found(namespace, source):
    from jupyter_cudamem.cell.read import read_cell

    read = read_cell(source, lambda text: text)
    return training_state(namespace, read.reads, read.binds_first)


def test_what_the_cell_reads_is_found_through_notebook_functions_and_objects():
    namespace: dict = {"__name__": "__main__"}
    exec("def train(n):\n    return model(torch.randn(n, 4)).sum()\n", namespace)
    model, other = _model(), _model()
    optimizer = torch.optim.Adam(model.parameters())

    class Trainer:  # as a library's Trainer keeps its model and optimizer
        def __init__(self):
            self.model, self.optimizer, self.epochs = model, optimizer, 3

    namespace.update(torch=torch, model=model, other=other, trainer=Trainer(), optimizer=optimizer)
    through_function = _found(namespace, "loss = train(8)\n")
    assert through_function.paths == ["model"]  # read by train(), never named in the cell
    # 2 Linear layers (4x3+3, 3x1+1) and BatchNorm's weight and bias: 6 parameters; its buffers: 3.
    assert len(through_function.parameters) == 6 and len(through_function.buffers) == 3
    through_attributes = _found(namespace, "trainer.fit()\n")
    assert through_attributes.paths == ["trainer.model", "trainer.optimizer"]
    assert through_attributes.optimizers == [optimizer] and len(through_attributes.parameters) == 6
    # ``other`` is bound before it is read: the rerun builds a new one, the old one is not the cell's state.
    rebuilt = _found(namespace, "other = make()\nother(x)\n")
    assert rebuilt.empty
    assert _found(namespace, "get_ipython().run_line_magic('time', 'model')\n").empty  # not the whole shell


def test_the_copy_is_put_back_exactly_weights_grads_buffers_optimizer_scheduler():
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    _step(model, optimizer, scheduler, steps=1)  # state to keep: moments, step 1, lr 0.05, running stats
    namespace = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "torch": torch}
    state = _found(namespace, "train(model, optimizer, scheduler)\n")
    # 6 parameters of 12+3+3+3+3+1 = 25 floats, with their .grad: 200 bytes; buffers: 3+3 floats and one
    # int64 counter, 32 bytes; Adam: two moments (200 bytes) and 6 float32 step counters (24 bytes).
    assert state.nbytes == 200 + 32 + 224
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    moments = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
    restorer = Restorer(state)
    restorer.take()
    for _ in range(3):
        restorer.restore()
        restorer.run(lambda source: _step(model, optimizer, scheduler, steps=3))("")
    # Put back before the 2nd and 3rd: the last rerun started at step 1 and took 3 (without: 1 + 3 x 3 = 10).
    assert optimizer.state[next(model.parameters())]["step"].item() == 4.0
    restorer.finish(last_fitted=False)
    assert restorer.restores == 3  # before the 2nd and 3rd rerun, and after the last (which failed)
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert all(optimizer.state[p]["step"].item() == 1.0 for p in model.parameters())
    assert all(torch.equal(optimizer.state[p]["exp_avg"], m) for p, m in zip(model.parameters(), moments))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05) and scheduler.last_epoch == 1
    # The copy was not changed by the steps after it was put back (no aliasing of CPU tensors).
    restorer2 = Restorer(state)
    restorer2.take()
    restorer2.run(lambda source: _step(model, optimizer, steps=1))("")
    restorer2.restore()
    restorer2.run(lambda source: _step(model, optimizer, steps=1))("")
    restorer2.restore()
    assert torch.equal(model.state_dict()["0.weight"], expected["0.weight"])


def test_restore_keeps_the_memory_a_run_made_and_finish_puts_back_exactly():
    """Between reruns the values go back but what a run made stays allocated (the next run of the cell
    holds it); a failed last rerun's state goes back exactly (no .grad, no moments)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = _found({"model": model, "opt": optimizer}, "step(model, opt)\n")
    restorer = Restorer(state)
    restorer.take()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    restorer.run(lambda source: _step(model, optimizer, steps=1))("")
    grads = [p.grad for p in model.parameters()]
    restorer.restore()
    # The same .grad tensors, zeroed: a step adds to them as it would to None.
    assert all(p.grad is g and not p.grad.any() for p, g in zip(model.parameters(), grads))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    restorer.run(lambda source: None)("")  # a rerun that failed before its backward
    restorer.finish(last_fitted=False)
    assert all(p.grad is None for p in model.parameters())  # exactly as before the reruns


def test_a_fitted_last_rerun_is_kept_and_is_the_run_from_the_copy():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = _found({"model": model, "opt": optimizer}, "step(model, opt)\n")
    restorer = Restorer(state)
    restorer.take()
    torch.manual_seed(1)
    restorer.run(lambda source: _step(model, optimizer, steps=1))("")
    after_one = {k: v.clone() for k, v in model.state_dict().items()}
    grads_one = [p.grad.clone() for p in model.parameters()]
    restorer.restore()
    torch.manual_seed(1)
    restorer.run(lambda source: _step(model, optimizer, steps=1))("")
    restorer.finish(last_fitted=True)
    # The zeroed .grad changed nothing: the same run from the copy, the same gradients.
    assert all(torch.equal(v, after_one[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads_one))


def test_a_first_steps_optimizer_state_is_held_until_the_next_step_begins():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = _found({"model": model, "opt": optimizer}, "step(model, opt)\n")
    restorer = Restorer(state)
    restorer.take()  # no state yet: the cell's first step makes the moments
    restorer.run(lambda source: _step(model, optimizer, steps=1))("")
    import weakref

    moments = [weakref.ref(v) for entry in optimizer.state.values() for v in entry.values() if v.dim() > 0]
    assert len(moments) == 2 * len(list(model.parameters()))  # exp_avg and exp_avg_sq
    restorer.restore()
    assert not optimizer.state  # put back: no state, as before the reruns
    assert all(m() is not None for m in moments)  # but their memory is still held
    steps_seen = []
    optimizer.register_step_pre_hook(lambda *_: steps_seen.append(all(m() is None for m in moments)))
    restorer.run(lambda source: _step(model, optimizer, steps=1))("")
    assert steps_seen == [True]  # let go as the step began, before it made its own
    assert len(optimizer.state) == len(list(model.parameters()))
    restorer.restore()
    restorer.run(lambda source: None)("")  # a rerun that never steps: held until the fix ends
    held = [weakref.ref(v) for entry in restorer._trained.optimizers[0].state.values() for v in entry.values()]
    assert not held  # put back to no state
    restorer.finish(last_fitted=True)
    assert not restorer._held


def test_random_generators_are_put_back():
    model = torch.nn.Linear(2, 2)
    state = _found({"model": model}, "model(x)\n")
    restorer = Restorer(state)
    restorer.take()
    first = (torch.rand(3), random.random())
    restorer.run(lambda source: None)("")
    restorer.restore()
    assert torch.equal(torch.rand(3), first[0]) and random.random() == first[1]


def test_leaf_tensors_trained_by_hand_are_parameters():
    weight = torch.ones(3, requires_grad=True)
    data = torch.ones(3)
    state = _found({"w": weight, "data": data}, "loss = (w * data).sum()\nloss.backward()\n")
    assert state.parameters == [weight] and state.paths == ["w"]  # data trains nothing


def test_copy_fits_leaves_a_share_of_host_memory():
    assert HOST_SHARE == 0.8
    assert copy_fits(800, 1000) and not copy_fits(801, 1000)
    assert copy_fits(10**15, None)  # unknown: taken


class _WrappedOptimizer(torch.optim.Optimizer):
    """As accelerate's ``AcceleratedOptimizer``: an ``Optimizer`` subclass that never runs its base
    ``__init__`` (so it has no step hooks of its own), shares the wrapped optimizer's state and groups,
    and steps it."""

    def __init__(self, optimizer):  # noqa: D107 - no super().__init__, as the wrapper
        self.optimizer = optimizer

    @property
    def state(self):
        return self.optimizer.state

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def defaults(self):
        return self.optimizer.defaults

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        return self.optimizer.step(closure)


def test_a_wrapped_optimizers_state_is_held_until_the_optimizer_it_wraps_steps():
    import weakref

    model, other_model = _model(), _model()
    optimizer = _WrappedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1))
    other = torch.optim.AdamW(other_model.parameters(), lr=0.1)
    restorer = Restorer(_found({"model": model, "opt": optimizer}, "step(model, opt)\n"))
    restorer.take()
    restorer.run(lambda source: _step(model, optimizer, steps=1))("")
    moments = [weakref.ref(v) for entry in optimizer.state.values() for v in entry.values() if v.dim() > 0]
    assert moments
    restorer.restore()  # a wrapper without hooks of its own: no AttributeError
    assert not optimizer.state and all(m() is not None for m in moments)
    _step(other_model, other, steps=1)  # another optimizer's step lets nothing go
    assert all(m() is not None for m in moments)
    restorer.run(lambda source: _step(model, optimizer, steps=1))("")
    assert all(m() is None for m in moments)  # the wrapped optimizer's step did
    restorer.finish(last_fitted=True)
    assert not restorer._held
