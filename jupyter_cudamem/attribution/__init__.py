"""Who holds device memory: one attribution for ``%oomfix``'s diagnosis and for the report of what a
cell left behind.

``probe`` recognises tensors, modules, optimizers, autograd graphs and module hooks. ``walk`` follows one
root (a variable, a reference IPython keeps) to the storages it keeps alive, within fixed bounds (sorting
each type once, and reading what a function keeps): the plain walk, the specification; ``fast_walk`` is
its fast path over many roots at once (``walk_together``). ``holders`` compares every root's reach
(``find_holders``: who holds memory now). For one cell: ``snapshot`` fingerprints the namespace before
it, and ``left`` sorts what each name reaches after it as new, old or unknown and names the holders
(``left_behind``: who holds what the cell left, as ``left_records``); ``text`` says whether each is a
leak and writes what each is and what to change. ``training_state`` reads what a training step holds
whatever its batch. Nothing here imports IPython or needs CUDA.
"""

from .holders import Holder, HolderKind, Holders, Origin, Reference, find_holders, reaches_cuda
from .probe import TensorProbe, default_probe

__all__ = [
    "Holder",
    "HolderKind",
    "Holders",
    "Origin",
    "Reference",
    "TensorProbe",
    "default_probe",
    "find_holders",
    "reaches_cuda",
]
