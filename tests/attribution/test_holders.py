"""Finding what holds CUDA memory, with fake tensors: sizes, dedupe, kinds, IPython references."""

from __future__ import annotations

import sys
import warnings

from jupyter_cudamem.attribution.holders import HolderKind, Origin, find_holders
from tests.fakes import FakeModule, FakeOptimizer, FakeTensor, MiB, fake_probe


def by_name(holders):
    return {h.label: h for h in holders}


def test_views_share_one_storage_and_cpu_tensors_do_not_count() -> None:
    x = FakeTensor(100 * MiB)
    ns = {"x": x, "y": x.view(), "pair": [x, x.view()], "cpu": FakeTensor(500 * MiB, device="cpu")}
    holders = by_name(find_holders(ns, {}, probe=fake_probe()))
    assert holders["x"].cuda_bytes == 100 * MiB
    assert holders["pair"].cuda_bytes == 100 * MiB and holders["pair"].tensor_count == 1
    assert holders["pair"].kind is HolderKind.OBJECT
    assert "cpu" not in holders
    # x, y and pair all reach the one storage: none of them alone frees it.
    assert all(h.exclusive_bytes == 0 for h in holders.values())
    assert find_holders(ns, {}, probe=fake_probe()).namespace_bytes == 100 * MiB


def test_module_counts_parameters_gradients_buffers_once() -> None:
    w = FakeTensor(40 * MiB, grad=FakeTensor(40 * MiB))
    b = FakeTensor(1 * MiB)
    stats = FakeTensor(2 * MiB)
    inner = FakeModule({"weight": w, "bias": b}, {"running_mean": stats})
    model = FakeModule({}, {}, block=inner, tied=inner)  # a shared submodule counts once
    model.cache = [FakeTensor(8 * MiB)]  # a tensor kept as a plain attribute
    holders = by_name(find_holders({"model": model}, {}, probe=fake_probe()))
    h = holders["model"]
    assert h.kind is HolderKind.MODULE and h.user_variable
    assert h.cuda_bytes == (40 + 40 + 1 + 2 + 8) * MiB
    assert h.detail == "parameters 41.00 MiB, gradients 40.00 MiB, buffers 2.00 MiB, other tensors 8.00 MiB"
    assert h.exclusive_bytes == h.cuda_bytes


def test_optimizer_counts_its_state_not_the_models_parameters() -> None:
    w = FakeTensor(64 * MiB)
    model = FakeModule({"w": w})
    opt = FakeOptimizer(model.parameters())
    opt.step()
    holders = by_name(find_holders({"model": model, "opt": opt}, {}, probe=fake_probe()))
    assert holders["opt (FakeOptimizer state)"].cuda_bytes == 128 * MiB
    assert holders["opt (FakeOptimizer state)"].kind is HolderKind.OPTIMIZER
    assert holders["model"].cuda_bytes == 64 * MiB
    assert holders["model"].exclusive_bytes == 64 * MiB


def test_tensor_gradient_is_its_own_holder_and_order_is_largest_first() -> None:
    w = FakeTensor(10 * MiB, grad=FakeTensor(30 * MiB))
    ns = {"w": w, "small": FakeTensor(1 * MiB), "big": FakeTensor(50 * MiB)}
    holders = find_holders(ns, {}, probe=fake_probe())
    assert [h.name for h in holders] == ["big", "w.grad", "w", "small"]
    assert by_name(holders)["w.grad"].kind is HolderKind.GRADIENT
    assert by_name(holders)["w"].cuda_bytes == 10 * MiB
    assert [h.name for h in find_holders(ns, {}, top=2, probe=fake_probe())] == ["big", "w.grad"]


def test_ipython_names_modules_and_functions_keeping_nothing_are_not_user_holders() -> None:
    t = FakeTensor(5 * MiB)
    ns = {
        "_": t,
        "__": t,
        "_7": t,
        "Out": {7: t},
        "_oh": {7: t},
        "_i7": "t",
        "In": ["", "t"],
        "sys": sys,
        "FakeTensor": FakeTensor,
        "f": lambda: None,
        "__builtins__": {"t": t},
    }
    assert find_holders(ns, {}, probe=fake_probe()) == []


def test_a_function_keeping_a_tensor_in_its_closure_is_a_holder() -> None:
    t = FakeTensor(5 * MiB)
    ns = {"_": t, "f": lambda: t}  # IPython's ``_`` is no user holder; the closure over t is
    (holder,) = find_holders(ns, {}, probe=fake_probe())
    assert (holder.name, holder.cuda_bytes, holder.detail) == ("f", 5 * MiB, "function reaching 1 CUDA storage")


def test_ipython_references_are_grouped_and_measured_against_the_namespace() -> None:
    kept = FakeTensor(4096 * MiB)
    shared = FakeTensor(100 * MiB)

    def train_step():
        big = kept  # noqa: F841 - a local the traceback keeps alive
        also = shared  # noqa: F841
        raise RuntimeError("CUDA out of memory.")

    try:
        train_step()
    except RuntimeError as error:
        exc = error
    frame = exc.__traceback__.tb_next.tb_frame
    refs = {
        "sys.last_value": exc,
        "sys.last_exc": exc,
        "train_step()": frame,
        "Out[3]": FakeTensor(7 * MiB),
        "_": None,
    }
    holders = find_holders({"shared": shared}, refs, probe=fake_probe())
    named = by_name(holders)
    exc_holder = named["sys.last_value / sys.last_exc"]
    assert exc_holder.kind is HolderKind.TRACEBACK and not exc_holder.user_variable
    assert exc_holder.cuda_bytes == (4096 + 100) * MiB
    assert exc_holder.exclusive_bytes == 4096 * MiB  # `shared` stays reachable from the namespace
    frame_holder = named["frame of train_step() (from the failed cell's traceback)"]
    assert frame_holder.origin is Origin.FRAME and frame_holder.name == "train_step()"
    assert frame_holder.cuda_bytes == (4096 + 100) * MiB
    assert named["Out[3]"].kind is HolderKind.IPYTHON and named["Out[3]"].cuda_bytes == 7 * MiB
    assert holders.ipython_only_bytes == (4096 + 7) * MiB
    assert holders.namespace_bytes == 100 * MiB
    del exc, frame, refs


def test_module_level_frame_is_not_walked_as_locals() -> None:
    # The cell's own frame has the user namespace as locals; it must not be counted under the traceback.
    ns = {"t": FakeTensor(3 * MiB)}  # only in the namespace, which the walk never enters through a frame
    code = compile("raise RuntimeError('x')", "<cell>", "exec")
    try:
        exec(code, ns)
    except RuntimeError as error:
        exc = error
    holders = find_holders(ns, {"sys.last_value": exc}, probe=fake_probe())
    assert [h.name for h in holders] == ["t"]


def test_objects_that_break_on_inspection_and_warnings_are_silenced() -> None:
    class Hostile:
        @property
        def __dict__(self):  # type: ignore[override]
            raise RuntimeError("no")

    class Noisy:
        def __init__(self) -> None:
            self.t = FakeTensor(2 * MiB)

        def __getattribute__(self, name):
            if name == "__dict__":
                warnings.warn("deprecated", FutureWarning, stacklevel=2)
            return object.__getattribute__(self, name)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        holders = find_holders({"h": Hostile(), "n": Noisy()}, {}, probe=fake_probe())
    assert [h.name for h in holders] == ["n"]


def test_cycles_terminate() -> None:
    a: list = []
    b = [a, FakeTensor(1 * MiB)]
    a.append(b)
    d: dict = {}
    d["self"] = d
    holders = find_holders({"a": a, "d": d}, {}, probe=fake_probe())
    assert by_name(holders)["a"].cuda_bytes == 1 * MiB


def test_without_torch_imported_nothing_is_found(monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert find_holders({"x": FakeTensor(1 * MiB)}, {}) == []


def test_real_torch_cpu_tensors_are_not_cuda() -> None:
    import pytest

    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    assert find_holders({"model": model, "opt": opt, "x": torch.ones(1000)}, {}) == []


def test_handles_on_the_machinery_are_not_user_holders() -> None:
    from IPython.core.interactiveshell import InteractiveShell

    from jupyter_cudamem.ipython_state import FailureRecorder

    shell = InteractiveShell.instance()
    shell.user_ns["kept"] = FakeTensor(3 * MiB)
    try:
        ns = {"ip": shell, "recorder": FailureRecorder(), "x": FakeTensor(1 * MiB)}
        assert [h.name for h in find_holders(ns, {}, probe=fake_probe())] == ["x"]
    finally:
        del shell.user_ns["kept"]


def test_huge_plain_data_is_cheap_and_a_huge_graph_is_bounded() -> None:
    import time

    from jupyter_cudamem.attribution import walk as holders_module

    floats = [float(i) for i in range(1_000_000)]
    nested = [[FakeTensor(1)] for _ in range(150_000)]  # 300k objects: more than one root may queue
    start = time.perf_counter()
    found = find_holders({"floats": floats, "nested": nested, "t": FakeTensor(1 * MiB)}, {}, probe=fake_probe())
    assert time.perf_counter() - start < 10
    named = by_name(found)
    assert "floats" not in named and named["t"].cuda_bytes == 1 * MiB
    assert 0 < named["nested"].tensor_count < 150_000  # stopped at the budget, not the end
    assert named["nested"].tensor_count <= holders_module.WALK_LIMIT


def test_what_the_failed_cell_bound_is_held_by_a_name_but_not_counted_as_your_variables() -> None:
    # Tutorial 4: ``images = torch.randn(batch_size, ...)`` then the forward pass fails. ``images`` is the
    # cell's own (a rerun binds it again), yet its name keeps it: the traceback is not its only holder,
    # so no cleanup is said to free it.
    images, earlier = FakeTensor(192 * MiB, grad=FakeTensor(192 * MiB)), FakeTensor(50 * MiB)

    def forward():
        batch = images  # noqa: F841 - a local the traceback keeps alive
        raise RuntimeError("CUDA out of memory.")

    try:
        forward()
    except RuntimeError as error:
        exc = error
    holders = find_holders({"images": images, "earlier": earlier}, {"sys.last_value": exc},
                           probe=fake_probe(), remade={"images"})
    named = by_name(holders)
    assert "images" not in named and "images.grad" not in named and "earlier" in named
    # The traceback's frames (this test's among them) reach all three tensors; a name holds each.
    assert named["sys.last_value"].cuda_bytes == (192 + 192 + 50) * MiB and named["sys.last_value"].exclusive_bytes == 0
    assert holders.ipython_only_bytes == 0
    assert holders.namespace_bytes == 50 * MiB
    del exc
