#!/usr/bin/env bash
# On a lent GPU machine, the checks a first GPU run needs first (tools/bench_colocation.py: a weight
# push between two processes on one GPU by CUDA IPC and by NCCL, bf16 and fp32; a FlexAttention
# sweep over a dozen tree lengths at Qwen3-8B shapes; a colocation memory cycle), then
# tools/bench_megatron.py, then the GPU tests (the embedded engine and the torch trainer on CUDA
# against the CPU, tree packing with block masks); each step under its own time limit, so the
# whole call stays under 10 minutes. Its Python (3.12, CUDA torch) has everything the
# benchmark imports except megatron-core and tomli_w, and it cannot reach PyPI, so those wheels
# (and pytest's and hypothesis') are fetched here and carried there.
#
#   here:   bash tools/gpu_bench.sh prepare            # wheels for CPython 3.12 into .whl/ (git-ignored)
#   there:  bash tools/gpu_bench.sh run [BENCH ARGS]   # the device tool's run, with carry [".whl"];
#                                                      # the figures land in $OUT/bench_megatron.json
set -euo pipefail
cd "$(dirname "$0")/.."
MEGATRON="megatron-core==0.19.2"  # the release that runs on the GPU machine's torch 2.11
case "${1:-}" in
prepare)
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$MEGATRON" tomli_w zstandard pytest pluggy iniconfig hypothesis attrs sortedcontainers
    ls .whl
    ;;
run)
    shift
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no GPU"
    out="${OUT:-/tmp/bench}"  # what comes back from the device
    mkdir -p "$out"
    export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
    timeout 300 python3 tools/bench_colocation.py --device cuda --out "$out" 2>&1 | tee "$out/colocation.log" || true
    rm -rf /tmp/bench-megatron  # the random model: gigabytes, never sent back
    # --tree: one tree-packed micro-step of 32K unique tokens (FlexAttention block mask).
    timeout 180 python3 tools/bench_megatron.py --dir /tmp/bench-megatron --tree 32768 "$@" \
        2>&1 | tee "$out/bench.log" || true
    cp /tmp/bench-megatron/bench_megatron.json "$out/" || true
    # The tests marked gpu (here: the embedded engine on CUDA); their log comes back too.
    timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_engine.py tests/test_tree_packing.py \
        2>&1 | tee "$out/gpu_tests.log" || true
    # The serving rules on that machine's Python: version-gated admission after a restart, a load
    # splitting running calls into segments, no KV reused across versions; where the machine has
    # SGLang (GYRE_SGLANG_PYTHON), the replicas, the KV rule and the killed-server run against it too.
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_versions.py tests/test_placement.py \
        tests/test_weight_delta.py tests/test_pushed.py 2>&1 | tee "$out/serving_tests.log" || true
    if [ -n "${GYRE_SGLANG_PYTHON:-}" ]; then
        # Delta pushes too: the loader's verdicts and exact weights, then whole / bf16 / delta side by side.
        GYRE_REQUIRE=sglang timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_sglang.py \
            -k "conversation or replicas or weights_arrive or elements_that_changed" \
            2>&1 | tee "$out/sglang_tests.log" || true
        timeout 300 "$GYRE_SGLANG_PYTHON" tools/bench_sglang.py --json "$out/bench_sglang.json" \
            2>&1 | tail -12 | tee "$out/bench_sglang.log" || true
    fi
    ;;
*)
    echo "usage: bash tools/gpu_bench.sh prepare | run [bench_megatron.py arguments]" >&2
    exit 2
    ;;
esac
