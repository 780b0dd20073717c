"""A notebook cell's code: read it as IPython runs it (``source``), say what it does (``traits``), read
once into what every part of a fix needs of it (``read``), and change it without touching anything else
(``edit``).

Shared by everything that reads or changes cells: the batch finder (``jupyter_cudamem.batch``), the
advice ``%oomfix`` gives, and its autocast strategy. Pure: no shell, no torch.
"""
