"""Starting processes: a run locally under mpirun or as one heterogeneous Slurm job, the launch
check before either, and what every launcher of a child process shares (a free port, a child that
ends with its parent)."""
