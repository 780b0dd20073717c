"""Who holds device memory: one attribution for ``%oomfix``'s diagnosis and for the report of what a
cell left behind.

``probe`` recognises tensors, modules, optimizers, autograd graphs and module hooks; ``walk`` follows
one root (a variable, a reference IPython keeps) to the storages it keeps alive, within fixed bounds;
``holders`` compares every root's reach (``find_holders``: who holds memory now); ``left`` compares the
namespace before and after a cell (``left_behind``: who holds what the cell left, whether it is a leak,
and what to change). Nothing here imports IPython or needs CUDA.
"""

from .holders import Holder, Holders, Reference, find_holders, reaches_cuda
from .probe import TensorProbe, default_probe

__all__ = ["Holder", "Holders", "Reference", "TensorProbe", "default_probe", "find_holders", "reaches_cuda"]
