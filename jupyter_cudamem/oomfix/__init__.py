"""``%oomfix``: diagnose a CUDA out-of-memory error, free what it left behind, and rerun in a form that fits.

What an OOM is and what its message says is ``jupyter_cudamem.oom``'s, what IPython keeps
``jupyter_cudamem.ipython_state``'s (``attribution`` says who holds memory). The magic reads a failed cell into
a ``request.FixRequest`` and calls ``fix.fix``, which runs the rest. Here ``cleanup`` frees and
measures, ``diagnosis`` turns it into a verdict; ``search`` picks the next batch (the memory model is
``jupyter_cudamem.growth``), ``strategies`` names the ways to fit, ``options`` checks their settings, and the
driver runs them, recording each try in ``outcome``; ``reruns.set_aside`` makes sure a failed try leaves nothing;
``plan`` is what ``--dry-run`` shows and ``dry_run`` builds it for the magic; ``restore`` decides whether the
state a cell trains is copied and put back around the reruns. Where the batch lives and changing it there is ``jupyter_cudamem.batch``'s,
advice ``jupyter_cudamem.advice``'s.
"""
