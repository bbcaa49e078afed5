#!/usr/bin/env bash
# One call on the GPU machine: bench/eval_draft.py for the SmolLM2 draft on the H200 (issue 11,
# item 4): HumanEval (164) and 64 chat prompts, c = 1, 8, 32, spec on and off, 256 tokens.
# One process per (set, c): the engines of a process are not always given back to the GPU
# when dropped (see docs/GPU_NOTES.md). Needs the GGUF halves and the draft from earlier
# calls on the same warm machine (/tmp/dev/draft), or DRAFT=path.
set -o pipefail
source bench/device_env.sh
D=${DRAFT:-/tmp/dev/draft}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
for s in ${SETS:-humaneval chat}; do for c in ${CONC:-1 8 32}; do
    timeout ${EVAL_TIMEOUT:-200} python3 bench/eval_draft.py --draft $D --sets $s --concurrency $c --max-tokens 256 \
        --json $OUT/eval_${s}_c$c.json 2>&1 | tee -a $OUT/eval_h200.log | grep -v '^{' | tail -3
done; done
