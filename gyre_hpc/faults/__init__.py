"""Faults a test makes happen at a moment it names (``faults.points``)."""
