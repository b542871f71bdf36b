"""The models that ship with gyre-hpc, built offline: ``run.model`` resolved to a directory
(``resolve``), and the warm start of the tiny model (``warmstart``)."""
