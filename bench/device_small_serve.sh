#!/usr/bin/env bash
# One call on the GPU machine (issue 22's SmolLM2 table): the embedded SmolLM2-135M-Instruct
# through `dflash-engine serve --max-num-seqs 32`, `dflash-engine bench serve` on the chat
# endpoint, temperature 0, EOS honoured, at most 256 new tokens: all 164 HumanEval prompts and
# the 64 chat prompts of bench/eval_draft.py (a custom JSONL), c = CONC. Servers (SERVERS, in
# order; default "off spec15"):
#   off, spec15          spec off / the shipped draft at DRAFT with K = 15 fixed (serve's defaults:
#                        the engine in its own process, mixed-step graphs)
#   adaptive             the shipped draft, adaptive draft length (serve's default policy)
#   *_thread             the same with --disable-frontend-multiprocessing (engine on a thread)
#   *_eagermixed         the same with --max-mixed-graph-tokens 0
# CONC_THREAD: the concurrencies of the *_thread servers (default CONC). Each client line also gets the server's own mean TTFT (from add_request, /metrics). Needs the
# GGUF halves from earlier calls on the same warm machine and the draft at /tmp/dev/draft
# (docs/GPU_NOTES.md).
set -o pipefail
source bench/device_env.sh
D=${DRAFT:-/tmp/dev/draft}; L=/tmp/small_logs; mkdir -p $L
python3 -c "import json, sys; sys.path.insert(0, 'bench'); import eval_draft
open('/tmp/chat.jsonl', 'w').write(''.join(json.dumps({'prompt': p}) + '\n' for p in eval_draft.CHAT_PROMPTS))"
server_ttft() {  # mean server-side TTFT (ms) so far, and the count
    curl -s localhost:8000/metrics | python3 -c "import re, sys; m = sys.stdin.read()
s, c = (float(re.search(r'^vllm:time_to_first_token_seconds_%s\{[^}]*\} (\S+)$' % k, m, re.M).group(1)) for k in ('sum', 'count'))
print(f'{s:.6f} {c:.0f}')"
}
server() {
    name=$1; shift
    python3 -m dflash_engine.cli serve --max-num-seqs 32 --max-model-len 2048 --port 8000 "$@" > $L/server_$name.log 2>&1 &
    pid=$!; t0=$(date +%s)
    for i in $(seq 1 150); do curl -sf localhost:8000/health > /dev/null && break; kill -0 $pid 2>/dev/null || break; sleep 1; done
    echo "== $name: server up in $(( $(date +%s) - t0 )) s"; grep -E "captured|KV pool|Error" $L/server_$name.log | tail -4
    for set in humaneval chat; do
        if [ $set = humaneval ]; then ds="--dataset-name humaneval --humaneval-output-len ${OUT_LEN:-256} --num-prompts ${NUM_HE:-164}"
        else ds="--dataset-name custom --dataset-path /tmp/chat.jsonl --custom-output-len ${OUT_LEN:-256} --num-prompts ${NUM_CHAT:-64}"; fi
        conc=${CONC:-8,32}; case $name in *_thread*) conc=${CONC_THREAD:-$conc} ;; esac
        IFS=, read -ra cs <<< "$conc"
        for c in "${cs[@]}"; do
            before=$(server_ttft)
            timeout ${CLIENT_TIMEOUT:-150} python3 -m dflash_engine.cli bench serve --port 8000 --backend openai-chat $ds \
                --concurrency $c --result-dir $OUT --result-filename small_${name}_${set}_c$c.json --disable-tqdm \
                --label "$name $set" > $L/client_${name}_${set}_c$c.log 2>&1
            after=$(server_ttft)
            row=$(grep -E "^ +$c +(OK|FAIL)" $L/client_${name}_${set}_c$c.log | tail -1)
            python3 -c "b, a = '$before'.split(), '$after'.split(); n = float(a[1]) - float(b[1])
print('$name $set' + ' ' * max(1, 24 - len('$name $set')) + '''$row''' + f'   server TTFT {1e3 * (float(a[0]) - float(b[0])) / max(n, 1):.1f} ms')" | tee -a $OUT/table.txt
            grep -E "^c=$c: host ms" $L/client_${name}_${set}_c$c.log | sed "s/^/    /" | tee -a $OUT/table.txt
        done
    done
    curl -s localhost:8000/metrics | grep -E "^dflash:steps_by_path_total|^vllm:spec_decode_num_draft_tokens_total" > $L/paths_$name.txt
    kill $pid; wait $pid 2>/dev/null
}
SPEC='{"method": "dflash", "model": "'$D'", "num_speculative_tokens": 15, "draft_length": "fixed"}'
ADAPT='{"method": "dflash", "model": "'$D'", "num_speculative_tokens": 15, "draft_length": "adaptive"}'
echo "columns: conc status ok/fail out-tok/s tot-tok/s TTFT p99TTFT TPOT p99TPOT ITL tau idle-ms/step idle%" | tee $OUT/table.txt
for s in ${SERVERS:-off spec15}; do
    case $s in
        off*) args=(--speculative-config none) ;;
        spec15*) args=(--speculative-config "$SPEC") ;;
        adaptive*) args=(--speculative-config "$ADAPT") ;;
    esac
    case $s in *_thread*) args+=(--disable-frontend-multiprocessing) ;; esac
    case $s in *_eagermixed*) args+=(--max-mixed-graph-tokens 0) ;; esac
    server $s "${args[@]}"
done
# Few files come back from $OUT (the device tool's limit): the table, one file of paths; the
# JSONs stay in $OUT, the client and server logs on the machine.
cat $L/paths_*.txt > $OUT/paths.txt 2>/dev/null; rm -f $OUT/small_*.png
