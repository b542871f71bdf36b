"""An execution as a value: its name (``run_id``) and what it ended as (``outcome``). The lowest
floor: it knows nothing of agents, scoring, steps or files."""
