#!/usr/bin/env bash
# One call on the GPU machine (issue 22, item 3): mixed steps (a new request's prefill beside
# decode rows) through CUDA graphs vs eager, the embedded SmolLM2 + shipped draft, K = 15 fixed,
# spec off and on, all 164 HumanEval / 64 chat prompts, 256 tokens, c = CONC. One process per
# (set, c, mode) (engines of one process are not always given back to the GPU when dropped).
# Needs the GGUF halves from earlier calls on the same warm machine and the draft at
# /tmp/dev/draft (or DRAFT=path); docs/GPU_NOTES.md.
set -o pipefail
source bench/device_env.sh
D=${DRAFT:-/tmp/dev/draft}
for s in ${SETS:-humaneval chat}; do for c in ${CONC:-8 32}; do for m in ${MODES:-0 512}; do
    timeout ${EVAL_TIMEOUT:-200} python3 bench/eval_draft.py --draft $D --sets $s --concurrency $c --max-tokens 256 \
        --draft-lengths ${DL:-15} --repeat ${REPEAT:-2} --max-mixed-graph-tokens $m \
        --json $OUT/mixed${m}_${s}_c$c.json 2>&1 | tee -a $OUT/mixed_ab.log | grep -v '^{' | tail -3
    python3 - "$OUT/mixed${m}_${s}_c$c.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print("  ", r["set"], r["c"], "spec" if r["spec"] else "off", r["tok_s"], r["tok_s_passes"], r.get("steps_by_path"))
PY
done; done; done
