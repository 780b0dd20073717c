"""``%oomfix``: diagnose a CUDA out-of-memory error, free what it left behind, and rerun in a form that fits.

The magic reads a failed cell into a ``request.FixRequest`` and calls ``fix.fix``: ``cleanup`` frees,
``diagnosis`` gives the verdict, the ``driver`` runs the ``strategies`` and records each try in ``outcome``.
"""
