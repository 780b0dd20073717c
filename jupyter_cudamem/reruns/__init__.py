"""Running a cell again, measured: what each rerun must leave as it found it (``model_state``)."""
