#!/usr/bin/env bash
# Set up gyre-hpc on Debian 12, idempotently: system packages (Open MPI, Slurm, munge, PMIx,
# MariaDB for Slurm accounting), a virtual environment in .venv, and the package in it.
#
#   bash tools/setup.sh          # what `gyre-hpc run` and `gyre-hpc submit` need
#   bash tools/setup.sh --test   # also the test tools (pytest, hypothesis, ruff) and megatron-core
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
[ "${1:-}" = "--test" ] && extras="[test,megatron]"

packages=(python3-venv python3-dev build-essential openmpi-bin libopenmpi-dev libpmix-dev
          munge slurmctld slurmd slurmdbd slurm-client mariadb-server)
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ "${#missing[@]}" -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
  echo "setup: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
# torch first and pinned: a bare `torch` requirement resolved fresh pulls a multi-GB CUDA build.
# The package itself only asks for a range, so clusters keep their own CUDA torch.
pip_install() {
  .venv/bin/python -m pip install -q --disable-pip-version-check "$@" >.venv/pip.log 2>&1 \
    || { cat .venv/pip.log >&2; echo "setup: pip install $* failed" >&2; exit 1; }
}
pip_install torch==2.13.0
pip_install -e ".$extras"
.venv/bin/python -c "import gyre_hpc, mpi4py, torch" || { echo "setup: the install failed" >&2; exit 1; }
echo "setup: ready ($(.venv/bin/gyre-hpc --version), torch $(.venv/bin/python -c 'import torch; print(torch.__version__)'))"
