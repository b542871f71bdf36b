#!/usr/bin/env python3
"""Elastic vs async vs colocate as real runs of one recipe: ``gyre-hpc bench modes`` under its old name.

python tools/bench_modes.py [RECIPE] [--steps 4] [--cells 3] [--set section.key=value ...]
"""

import sys

from gyre_hpc.cli.app import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0].startswith("-"):
        args = ["recipes/smoke.toml", *args]
    sys.argv = ["gyre-hpc", "bench", "modes", *args]
    main()
