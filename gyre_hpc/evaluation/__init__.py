"""A model or a suite measured outside a training run: a task suite run through the proxy on
engines of this machine and scored (``evaluate``, ``gyre-hpc eval``), and a suite's tasks checked
against their own reference solutions (``verify``, ``gyre-hpc tasks verify``)."""
