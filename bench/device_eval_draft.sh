#!/usr/bin/env bash
# One call on the GPU machine: bench/eval_draft.py for the SmolLM2 draft on the H200 (issue 11,
# item 4): HumanEval (164) and 64 chat prompts, c = 1, 8, 32, spec on and off, 256 tokens.
# Needs the GGUF halves and the draft from an earlier call on the same warm machine
# (/tmp/dev/draft), or DRAFT=path (e.g. the shipped one).
set -o pipefail
source bench/device_env.sh
D=${DRAFT:-/tmp/dev/draft}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
timeout ${EVAL_TIMEOUT:-540} python3 bench/eval_draft.py --draft $D --sets ${SETS:-humaneval,chat} \
    --concurrency ${CONC:-1,8,32} --max-tokens 256 --json $OUT/eval_h200.json 2>&1 | tee $OUT/eval_h200.log | grep -v '^{'
