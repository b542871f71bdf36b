#!/usr/bin/env bash
# On a lent GPU machine (name nvidia-h200: on an H100 the 32K-token tree step does not fit), in
# one call: the GPU tests (megatron's tree packing with block masks, the torch trainer and the
# embedded engine on CUDA against the CPU), tools/bench_megatron.py (a dense model, then a
# Qwen3-MoE-shaped one with and without routing replay, EP 1: one GPU), then tools/bench_colocation.py
# (a weight push between two processes on one GPU by CUDA IPC, bf16 and fp32, and NCCL's answer to
# a broadcast with one GPU twice; a colocation memory cycle; a FlexAttention sweep over a dozen
# tree lengths at Qwen3-8B shapes); each step under its own time limit, so the whole call stays
# under 10 minutes. Its Python (3.12, CUDA torch, pytest, hypothesis) lacks megatron-core, tomli_w
# and zstandard, and it cannot reach PyPI, so those wheels are fetched here and carried there. No
# SGLang: its CUDA wheels are far larger than what can be carried; its contract is tested on the
# CPU here.
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
        -d .whl "$MEGATRON" tomli_w zstandard
    ls .whl
    ;;
run)
    shift
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no GPU"
    out="${OUT:-/tmp/bench}"  # what comes back from the device
    mkdir -p "$out"
    export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
    # Five steps, each under its own limit (together 540 s of the 600 a call may take), each
    # leaving its figures as it ends. 1. The tests marked gpu: megatron's tree micro-step under
    # block masks against its paths (a cold compile), the torch trainer and the embedded engine
    # on CUDA against the CPU.
    timeout 180 python3 -m pytest -q -x --tb=short -p no:cacheprovider -m gpu tests/test_tree_packing.py \
        tests/test_engine.py 2>&1 | tee "$out/gpu_tests.log" || true
    # 2. megatron: load, a micro-step, one tree-packed micro-step of 32K unique tokens, export, apply.
    rm -rf /tmp/bench-megatron  # the random model: gigabytes, never sent back
    timeout 130 python3 tools/bench_megatron.py --dir /tmp/bench-megatron --tree 32768 "$@" \
        2>&1 | tee "$out/bench.log" || true
    cp /tmp/bench-megatron/bench_megatron.json "$out/" || true
    # 2b. A Qwen3-MoE-shaped model (64 experts, 8 routed): a micro-step routing freely, and the
    # same replaying given routes (trainer.routing_replay); EP 1, the GPU being one.
    rm -rf /tmp/bench-moe
    timeout 90 python3 tools/bench_megatron.py --size moe --dir /tmp/bench-moe --steps 2 \
        2>&1 | tee "$out/bench_moe.log" || true
    cp /tmp/bench-moe/bench_megatron.json "$out/bench_megatron_moe.json" || true
    # 3. Weight pushes by reference, NCCL's answer to one GPU twice in a group, the memory cycle;
    # 4. the FlexAttention sweep, with and without grad. Both add to bench_colocation.json.
    timeout 80 python3 tools/bench_colocation.py --device cuda --out "$out" --phases push,broadcast,cycle \
        --broadcast-wait-s 20 2>&1 | tee "$out/colocation.log" || true
    timeout 60 python3 tools/bench_colocation.py --device cuda --out "$out" --phases flex --flex-budget-s 30 \
        2>&1 | tee "$out/flex.log" || true
    ;;
*)
    echo "usage: bash tools/gpu_bench.sh prepare | run [bench_megatron.py arguments]" >&2
    exit 2
    ;;
esac
