"""Events and metrics of a run, written to its run directory."""
