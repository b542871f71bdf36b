"""Training replicas: load a snapshot, train micro-steps, hand gradients to the core."""
