"""Scheduling policy (pure) and the controller's schedule."""
