#!/usr/bin/env bash
# One call on the GPU machine (issue 22: the prefills' share of the 8B ladder, docs/perf.md
# "The c = 1 prefill, an open lead"): bench/bench_prefill.py on the random Qwen3-8B pair, the
# prompt alone and beside BESIDE decoding requests (default 0,7,31), spec off and on, with a
# kernel table of each, then the c = 1 step profile without PDL (kernel times that add up).
# Run after bench/device_draft_vocab.sh on the same warm machine (or alone: the checkpoint is
# written if missing). Everything lands in $OUT.
set -o pipefail
source bench/device_env.sh
Q=/tmp/ckpt_qwen3-8b; QD=/tmp/ckpt_qwen3-8b_draft
[ -f $Q/config.json ] || { t0=$(date +%s); timeout 300 python3 -m dflash_engine.cli make-random-checkpoint --shape qwen3-8b $Q \
    --draft $QD 2>&1 | tail -2; echo "checkpoint written in $(( $(date +%s) - t0 )) s"; }
timeout ${PREFILL_TIMEOUT:-200} python3 bench/bench_prefill.py --target $Q --draft $QD --lengths ${LENGTHS:-1024} \
    --beside ${BESIDE:-0,7,31} --repeats ${REPEATS:-3} --profile --top 16 --json $OUT/prefill.json 2>&1 \
    | tee $OUT/prefill.log | grep -v "^USDT"
timeout ${PROFILE_TIMEOUT:-90} python3 bench/profile_step.py --target $Q --draft $QD --c 1 --graphs --replay --pdl off \
    --steps 10 --top 30 2>&1 | tee $OUT/profile_c1_pdloff.log | tail -40
