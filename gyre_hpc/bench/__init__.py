"""Benchmarks the command line runs: the modes side by side, simulated or as real runs, and a
recorded run replayed in the simulator (``replay``)."""
