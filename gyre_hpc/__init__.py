"""gyre-hpc: Slurm-native elastic online RL for ultra-long-horizon LLM agents."""

__version__ = "0.1.0"
