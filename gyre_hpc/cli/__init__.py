"""The gyre-hpc command line: one module per command group, composed in ``app``."""
