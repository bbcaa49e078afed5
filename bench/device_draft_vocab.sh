#!/usr/bin/env bash
# One call on the GPU machine: the reduced draft vocabulary (docs/perf.md "Draft vocabulary") on
# the GPU. Its GPU test (graphs == eager == spec off with a draft vocabulary), the random Qwen3-8B
# checkpoint and draft, the draft's ranking from the standard library's text (`dflash-engine
# draft-vocab --source stdlib-text`), then bench_step spec on with the full vocabulary and with
# VOCAB (default 32,768) rows at CONC (default 1,8,32). Everything lands in $OUT. Carried: .whl and
# the source tree with its _core (run from a snapshot: `ROOT=$PWD; cd .snap && ROOT=$ROOT bash
# bench/device_draft_vocab.sh`). The checkpoint lands where device_ladder.sh looks for it, and
# the ranking where its `KS="15 15v32768"` needs it.
set -o pipefail
TESTS=tests/test_draft_vocab.py SKIP_BENCH=1 TEST_TIMEOUT=120 bash bench/device_run.sh
source bench/device_env.sh
Q=/tmp/ckpt_qwen3-8b; QD=/tmp/ckpt_qwen3-8b_draft
[ -f $Q/config.json ] || { t0=$(date +%s); timeout 300 python3 -m dflash_engine.cli make-random-checkpoint --shape qwen3-8b $Q \
    --draft $QD 2>&1 | tail -2; echo "checkpoint written in $(( $(date +%s) - t0 )) s"; }
timeout 90 python3 -m dflash_engine.cli draft-vocab $Q --source stdlib-text --out $QD 2>&1 | tail -2 | tee $OUT/draft_vocab.log
timeout ${BENCH_TIMEOUT:-200} python3 bench/bench_step.py --target $Q --draft $QD --modes on,vocab \
    --draft-vocab-size ${VOCAB:-32768} --concurrency ${CONC:-1,8,32} --steps 20 --json $OUT/bench_step_vocab.json 2>&1 \
    | tee $OUT/bench_step_vocab.log | tail -30
