"""The live GPU monitor: a polling thread (``poller``) that reads the devices (``reading``), keeps their
samples and peaks (``store``) and tells its listeners of changes at a bounded rate (``notify``), within the
bounds of ``settings``; what it hands them (``state``), views of it (``widget``, ``render``) and the
recorded history (``snapshot``). It knows nothing of IPython's magics: ``%cudamem_monitor`` and
``jupyter_cudamem.monitor()`` (``magics/monitor.py``) are its front ends."""
