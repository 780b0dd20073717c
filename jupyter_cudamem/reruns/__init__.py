"""Running a cell again, measured, on the user's behalf: what each rerun must leave as it found it
(``model_state``), the recording of its allocations for the replay (``recording``), and the policy that picks
the next batch to try (``search``). ``%oomfix`` drives them; no IPython here."""
