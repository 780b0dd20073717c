"""The live GPU monitor: a polling thread (``poller``), views of it (``widget``, ``render``) and the
recorded history (``snapshot``). It knows nothing of IPython's magics: ``%cudamem_monitor`` and
``jupyter_cudamem.monitor()`` (``magics/monitor.py``) are its front ends."""
