"""Running a cell again, measured, on the user's behalf: what each rerun must leave as it found it
(``model_state``), and the recording of its allocations for the replay (``recording``). ``%oomfix`` drives
them (its batch search is ``batchsearch``); no IPython here."""
