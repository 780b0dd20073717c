"""Choosing the next batch size to try after a CUDA OOM: ``%oomfix``'s batch search. No torch, no IPython.

Followed from the fix to the arithmetic, four files:

- ``oomfix/smaller_batch.py``: the fix asks ``BatchSearch.next()`` for a batch, reruns the cell at it
  and says what the run showed (``record``);
- ``batchsearch/policy.py``: the policy (``BatchSearch``): an ordered list of named rules (``RULES``: the
  probe, halving's batches, the batch the replay or the line predicts...); each choice says why;
- ``batchsearch/state.py``: what the tries showed (``Tries``, ``Observation``, ``Attempt``) and the
  predictions it gives: the line, the replay of the recorded runs;
- ``growth/fitting.py``: the largest batch the allocator's replay fits, requests on the lines of two runs.
"""
