"""``growth.fitting``: the bound from allocated bytes frees what the start holds where the run frees it
(jupyter_cudamem/growth/fitting.py ``held_at_start``, ``allocated_limit``, ``peak_allocated_bytes``)."""

from __future__ import annotations

from jupyter_cudamem.growth.fitting import fitting_from_one, held_at_start
from jupyter_cudamem.growth.replay import ALLOC, FREE, StartSegment, start_keys

MiB, GiB = 1 << 20, 1 << 30


def test_a_value_the_cell_binds_again_frees_its_old_block_in_the_bound_as_in_the_replay():
    # The last run's model (4 GiB) is still bound when the cell runs again; the cell builds a new one
    # (100 MiB, fixed), the old one goes as the name is bound again, then 100 MiB per sample of activations.
    start = (StartSegment(1 << 34, False, ((4 * GiB, True),)),)
    old = start_keys(start)[1 << 34]
    events = [(ALLOC, 0, 100 * MiB, 0), (FREE, old, 0, 0), (ALLOC, 1, 100 * MiB, 0), (FREE, 1, 0, 0)]
    fitting = fitting_from_one(events, 1, start, 6 * GiB, batch_independent={0})
    assert fitting is not None
    largest = fitting.largest(1000)
    assert fitting.fits(largest) and not fitting.fits(largest + 1)
    assert largest > 50  # held to the end, the old block would leave room for 19
    assert held_at_start(start) == {old: 4 * GiB}
