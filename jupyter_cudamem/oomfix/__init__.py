"""``%oomfix``: diagnose a CUDA out-of-memory error, free what it left behind, and rerun in a form that fits.

``parse`` reads OOM messages, ``ipython_state`` (what IPython keeps; ``attribution`` says who holds memory) is the
only module that knows IPython's attribute names, ``cleanup`` frees and measures, ``diagnosis`` turns
it into a verdict; ``rewrite``, ``search`` and ``strategies`` build the rerun, and the driver ties them.
"""
