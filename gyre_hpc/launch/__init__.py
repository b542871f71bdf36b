"""Starting a run: locally under mpirun, or as one heterogeneous Slurm job."""
