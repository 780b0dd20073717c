"""The kept fingerprints (``attribution.tracked``): after each kind of cell, what was refreshed equals a full
snapshot of every user name, and every name is walked only where the cell's text cannot tell. Both ways of
measuring keep them: the every-cell mode (each cell measured) and ``%%cudamem`` alone (the cells between two
``%%cudamem`` cells not measured, only told by IPython's events).

Real shell, fake hardware and fake tensors (see ``tests/fakes.py``)."""

from __future__ import annotations

import pytest
from tests.fakes import FakeTensor, MiB, fake_probe

from jupyter_cudamem import magics
from jupyter_cudamem.attribution.holders import user_items
from jupyter_cudamem.attribution.snapshot import fingerprints
from jupyter_cudamem.cell.names import cell_names

SETUP = """
class Tracker:
    def __init__(self):
        self.history = []
    def log(self, value):
        history_log.append(value)
def train(n):
    global step
    step += n
    step_losses.append(FakeTensor(MiB, machine=m))
def outer():
    train(1)
step = 0
step_losses = []
history_log = []
tracker = Tracker()
losses = []
log = {'losses': losses, 'n': 1}
alias = losses
nested = {'inner': {'deep': []}}
deep = nested['inner']['deep']
t = FakeTensor(MiB, machine=m)
untouched = [FakeTensor(MiB, machine=m) for _ in range(3)]
"""


MODES = ("every_cell", "cell_magic")


def measured(shell, cell: str) -> str:
    """``cell`` as a measured cell of the shell's mode: itself in the every-cell mode, else under ``%%cudamem``."""
    return cell if magics.loaded(shell).magics[0].every_cell.on else "%%cudamem -q\n" + cell


@pytest.fixture(params=MODES)
def tracked_shell(shell, capsys, request):
    cudamem = magics.loaded(shell).magics[0]
    cudamem.probe = fake_probe()
    shell.user_ns.update(FakeTensor=FakeTensor, MiB=MiB)
    shell.run_cell(SETUP)
    if request.param == "every_cell":
        shell.run_cell("%cudamem on")
    shell.run_cell(measured(shell, "x = 1"))  # the first snapshot walks every name
    assert cudamem.attribution.tracked.full_walks == 1
    yield shell, cudamem
    shell.run_cell("%cudamem off")
    for name, _ in user_items(dict(shell.user_ns)):
        if name not in ("m", "GiB"):
            shell.user_ns.pop(name, None)
    capsys.readouterr()


def _kept_equals_full(shell, cudamem) -> None:
    """The next snapshot's fingerprints of user names equal a full fingerprint of them now."""
    kept = cudamem.attribution.snapshot(cudamem.settings()).names
    full = fingerprints(user_items(shell.user_ns), fake_probe())
    assert {name: kept.get(name) for name in full} == full


CELLS = [
    "losses.append(FakeTensor(MiB, machine=m))",  # read, changed in place; log and alias hold it
    "alias.append(FakeTensor(MiB, machine=m))",  # through an alias
    "log['losses'].append(1)",  # through the container that holds it
    "deep.append(1)",  # a child of a child of nested: nested['inner'] records it
    "nested['inner']['deep'].append(2)",
    "train(2)",  # a notebook function: global rebinding and a global appended to
    "outer()",  # ... called from another one
    "tracker.log(3)",  # a method of a notebook class appending to a global
    "tracker.history.append(4)",
    "del t",
    "t = FakeTensor(2 * MiB, machine=m)",
    "new_name = [FakeTensor(MiB, machine=m)]",
    "kept = untouched[0]",  # a new alias of a child of an old name
    "%%time\nlosses.append(5)",  # a magic that runs its body as a cell
    "for i in range(3):\n    losses.append(i)",
    "x = 'step_losses'  # a name in a string or comment is looked at, and found unchanged",
    # Names bound to atoms only (numbers, strings, None), new or rebound, and unbound: refreshed without the
    # warnings filter; an atom bound where a shared object was (the alias) or the other way round is not.
    "step = 5; lr = None; note = 'b'",
    "del step",
    "alias = 7",
    "alias.append(9); alias = 7",  # the list it was bound to changed first: losses and log are refreshed
    "step = losses",
]


@pytest.mark.parametrize("cell", CELLS)
def test_a_cell_refreshes_every_name_it_can_have_changed(tracked_shell, cell):
    shell, cudamem = tracked_shell
    walks = cudamem.attribution.tracked.full_walks
    assert shell.run_cell(cell).success
    _kept_equals_full(shell, cudamem)
    assert cudamem.attribution.tracked.full_walks == walks  # decided by names alone


def test_the_same_cell_run_again_is_told_again_after_each_snapshot(tracked_shell):
    # A cell's names are told once until a snapshot takes them (the events and the snapshot tell it up to
    # three times): the same text run again, one string as a loop of run_cell passes it, is told again.
    shell, cudamem = tracked_shell
    walks = cudamem.attribution.tracked.full_walks
    cell = measured(shell, "losses.append(FakeTensor(MiB, machine=m))")
    for _ in range(3):
        assert shell.run_cell(cell).success
    _kept_equals_full(shell, cudamem)
    assert cudamem.attribution.tracked.full_walks == walks


def test_atoms_rebound_between_cells_that_change_shared_objects(tracked_shell):
    shell, cudamem = tracked_shell
    walks = cudamem.attribution.tracked.full_walks
    for cell in ("x = 2", "alias.append(1)", "x = None; y = 3", "del y", "y = alias", "alias = 1",
                 "y.append(2); y = 0", "losses.append(3)", "del x"):
        assert shell.run_cell(measured(shell, cell)).success
        _kept_equals_full(shell, cudamem)
        kept = cudamem.attribution.snapshot(cudamem.settings()).names
        assert not {"x", "y"} & (kept.keys() - shell.user_ns.keys())  # nothing kept of a name deleted
    assert cudamem.attribution.tracked.full_walks == walks


@pytest.mark.parametrize(
    "cell",
    [
        "exec('losses.append(1)')",
        "globals()['losses'].append(1)",
        "from math import *",
        "%run -n nothing_to_run_here.py",
        "get_ipython().user_ns['losses'].append(1)",
    ],
)
def test_a_cell_whose_text_cannot_tell_walks_every_name(tracked_shell, cell):
    shell, cudamem = tracked_shell
    walks = cudamem.attribution.tracked.full_walks
    shell.run_cell(cell)
    _kept_equals_full(shell, cudamem)
    assert cudamem.attribution.tracked.full_walks == walks + 1


def test_code_run_by_a_library_is_bounded_by_the_guard(tracked_shell):
    """A hook stored earlier appends where no name of the cell leads: the fingerprint stays stale until the
    cells since the last full walk have left a quarter of the attribution threshold (64 MiB: 16 MiB)."""
    shell, cudamem = tracked_shell
    shell.run_cell("hooks = [lambda: hooked.append(FakeTensor(4 * MiB, machine=m))]\nhooked = []")
    shell.run_cell(measured(shell, "x = 1"))  # hooks and hooked refreshed
    walks = cudamem.attribution.tracked.full_walks
    for _ in range(4):  # 4 MiB a cell, through a name-less call (under %%cudamem alone, not measured)
        shell.run_cell("hooks[0]()")
        assert cudamem.attribution.tracked.full_walks == walks
    # Each cell names ``hooks``, not ``hooked``: the guard (16 MiB left) walks everything at the next cell.
    shell.run_cell(measured(shell, "x = 2"))
    assert cudamem.attribution.tracked.full_walks == walks + 1
    _kept_equals_full(shell, cudamem)


def test_cell_names_reads_identifiers_and_refuses_what_text_cannot_tell():
    assert cell_names("y = x.append(z)  # w") == frozenset({"y", "x", "append", "z", "w"})
    assert cell_names("%%time\na = b") == frozenset({"time", "a", "b"})
    assert cell_names("out = !ls") == frozenset({"out", "ls"})
    assert cell_names("%%capture c\nx = 1") == frozenset({"capture", "c", "x"})
    for source in ("exec(s)", "vars()['a'] = 1", "from os import *", "%run script.py", "x = %who_ls_unknown",
                   "%load_ext autoreload"):
        assert cell_names(source) is None, source
    # IPython's automagic: a bare magic name at a line's start runs the magic
    assert cell_names("run script.py", frozenset({"run"})) is None
    assert cell_names("run = 3", frozenset({"run"})) == frozenset({"run"})


def test_cells_between_whose_leftovers_cannot_be_read_walk_every_name(shell, monkeypatch):
    cudamem = magics.loaded(shell).magics[0]
    cudamem.probe = fake_probe()
    shell.run_cell("%%cudamem -q\nx = 1")
    walks = cudamem.attribution.tracked.full_walks
    shell.run_cell("y = 2")  # not measured: its leftovers are read at the next snapshot

    def sticky_error(index):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(cudamem.hardware.allocator, "read", sticky_error)
    assert cudamem.attribution.snapshot(cudamem.settings()) is not None
    assert cudamem.attribution.tracked.full_walks == walks + 1
    shell.user_ns.pop("y", None)
