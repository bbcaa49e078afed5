#!/usr/bin/env bash
# One call on the GPU machine (issue 22's SmolLM2 table): the embedded SmolLM2-135M-Instruct
# through `dflash-engine serve --max-num-seqs 32`, `dflash-engine bench serve` on the chat
# endpoint, temperature 0, EOS honoured, at most 256 new tokens: all 164 HumanEval prompts and
# the 64 chat prompts of bench/eval_draft.py (a custom JSONL), c = CONC. Servers: spec off and
# spec on (the shipped draft at DRAFT, K = 15 fixed), each with mixed-step graphs (default) and,
# with AB=1, without (--max-mixed-graph-tokens 0). Needs the GGUF halves from earlier calls on
# the same warm machine and the draft at /tmp/dev/draft (docs/GPU_NOTES.md).
set -o pipefail
source bench/device_env.sh
D=${DRAFT:-/tmp/dev/draft}; L=/tmp/small_logs; mkdir -p $L
python3 -c "import json, sys; sys.path.insert(0, 'bench'); import eval_draft
open('/tmp/chat.jsonl', 'w').write(''.join(json.dumps({'prompt': p}) + '\n' for p in eval_draft.CHAT_PROMPTS))"
server() {
    name=$1; shift
    python3 -m dflash_engine.cli serve --max-num-seqs 32 --max-model-len 2048 --port 8000 "$@" > $L/server_$name.log 2>&1 &
    pid=$!; t0=$(date +%s)
    for i in $(seq 1 120); do curl -sf localhost:8000/health > /dev/null && break; kill -0 $pid 2>/dev/null || break; sleep 1; done
    echo "== $name: server up in $(( $(date +%s) - t0 )) s"; grep -E "captured|KV pool|Error" $L/server_$name.log | tail -4
    for set in humaneval chat; do
        if [ $set = humaneval ]; then ds="--dataset-name humaneval --humaneval-output-len 256 --num-prompts 164"
        else ds="--dataset-name custom --dataset-path /tmp/chat.jsonl --custom-output-len 256 --num-prompts 64"; fi
        timeout ${CLIENT_TIMEOUT:-150} python3 -m dflash_engine.cli bench serve --port 8000 --backend openai-chat $ds \
            --concurrency ${CONC:-8,32} --result-dir $OUT --result-filename small_${name}_$set.json --disable-tqdm \
            --label "$name $set" 2>&1 | tee $L/client_${name}_$set.log | tail -${TAIL:-4}
    done
    curl -s localhost:8000/metrics | grep -E "^dflash:steps_by_path_total" | tee $L/paths_$name.txt
    kill $pid; wait $pid 2>/dev/null
}
SPEC='{"method": "dflash", "model": "'$D'", "num_speculative_tokens": 15, "draft_length": "fixed"}'
server off --speculative-config none
server spec15 --speculative-config "$SPEC"
if [ -n "${AB:-}" ]; then
    server off_eagermixed --speculative-config none --max-mixed-graph-tokens 0
    server spec15_eagermixed --speculative-config "$SPEC" --max-mixed-graph-tokens 0
fi
# Few files come back from $OUT (the device tool's limit): no plots, one file of paths, the
# client logs; the server logs stay on the machine.
rm -f $OUT/small_*.png; cat $L/paths_*.txt > $OUT/paths.txt 2>/dev/null; cp $L/client_*.log $OUT/ 2>/dev/null
