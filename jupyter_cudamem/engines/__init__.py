"""GPU memory across ipyparallel engines: what each engine measured, gathered on the client.

Each engine runs the extension as a kernel does (``%px %load_ext jupyter_cudamem``, ``%%px`` + ``%%cudamem``)
and keeps its own history. The client asks every engine for its latest report through ipyparallel's own
messaging and shows one table: a row per engine and device, the spread between engines and the straggler.

``records`` holds the plain, picklable records an engine sends (no torch, no IPython); ``table`` renders
them; ``gather`` is the thin adapter over an ipyparallel client; ``live`` gathers the engines' monitor
readings at an interval. ipyparallel is optional: nothing here imports it until a client is handed in.
"""
