#!/usr/bin/env bash
# Set up everything, start a local Slurm (munge, slurmdbd, slurmctld, 5 emulated nodes), and run
# the whole test suite. Idempotent. CI runs exactly this; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh --test --sglang --agents
bash tools/local_slurm.sh start
# Here the mpi, slurm, megatron, SGLang, agent-program, sandbox, task-image, root, cgroup and seccomp
# tests must run: a missing launcher, package or kernel feature is an error, not a skip.
export GYRE_REQUIRE="${GYRE_REQUIRE-mpi,slurm,megatron,sglang,agents,bwrap,image,root,cgroups,seccomp}"
exec .venv/bin/python -m pytest --durations=25 "$@"
