"""Status views of a run; they read only its run directory (and Slurm's job state)."""
