#!/usr/bin/env bash
# One device call, before/after side by side (docs/GPU_NOTES.md): bench_step.py on the
# Qwen3-8B shape (random weights) at c = $AB_CONC for the tree in $ROOT/.before (an older
# commit's python/ + bench/ with its own _core.abi3.so) and for this tree (run from a
# snapshot: `ROOT=$PWD; cd .snap && ROOT=$ROOT bash bench/device_ab.sh`), alternating before,
# after (AB_REPEAT rounds). GPU tests of this tree first unless SKIP_TESTS. Results in $OUT.
set -o pipefail
source bench/device_env.sh   # wheels, PYTHONPATH, $OUT
AFTER=$PWD
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/smi.txt"
[ -z "${SKIP_TESTS:-}" ] && timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q tests/test_gpu_step.py tests/test_kernel_sampling.py \
    -p no:cacheprovider 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -6
rm -rf /tmp/q8 /tmp/q8d
timeout 120 python3 -m dflash_engine.random_checkpoint --shape qwen3-8b /tmp/q8 --draft /tmp/q8d 2>&1 | tail -2
for i in $(seq 1 "${AB_REPEAT:-1}"); do
  for side in before after; do
    dir=$AFTER; [ $side = before ] && dir=$ROOT/.before
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir/python timeout "${BENCH_TIMEOUT:-200}" python3 bench/bench_step.py \
        --target /tmp/q8 --draft /tmp/q8d --steps 20 --concurrency "${AB_CONC:-1,8,32}" \
        --json "$OUT/ab_${side}_$i.json" 2>&1 | tee "$OUT/ab_${side}_$i.log" | tail -9)
  done
done
