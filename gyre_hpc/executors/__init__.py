"""Executor nodes: executions run away from the controller (``hub`` on the controller, ``node`` on
each executor, ``job`` the record between them, ``slots`` the placement rule)."""
