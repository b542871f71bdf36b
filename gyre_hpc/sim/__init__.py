"""A discrete-event simulator of cells, driving the runtime's own scheduling policy."""
