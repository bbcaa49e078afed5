#!/usr/bin/env bash
# One call on the GPU machine: issue 10's serving ladder. Qwen3-8B shape with random weights
# and its random DFlash draft (make-random-checkpoint), `dflash-engine serve --max-num-seqs 32
# --max-model-len 8192`, `dflash-engine bench serve` on the chat endpoint, random 1024 in /
# 512 out, ignore_eos, temperature 0, c = 1..32 (8 prompts below c=4, 4c above): spec off,
# then spec on with 15 drafts and synthetic acceptance length 6.5. Results (JSON + PNG per
# ladder, logs incl. the server's startup memory lines) land in $OUT. AB=1 adds c=32 (AB_CONC)
# rungs with the host/device overlap off and Python's default GIL switch interval (A/B);
# SCHED adds a spec-on ladder with a draft-length schedule; OFF_CONC limits the spec-off rungs.
# KS entries: K (fixed) or aK (adaptive up to K), either with vN appended (e.g. 15v32768: the
# draft proposes among the target's N most frequent tokens; the ranking is written into the
# draft's directory by `dflash-engine draft-vocab --source stdlib-text` if missing);
# RATES: decaying per-position rates (see spec()).
# SHAPE (default qwen3-8b; qwen3.5-27b for the hybrid ladder of issue 19), KS (draft lengths,
# default 15: one spec-on ladder each; KS="" none), MAXLEN (--max-model-len, default 8192), LONG_CONC
# (rungs of one more spec-on ladder at --max-model-len 32768, K = the first of KS), OFF=0
# (no spec-off ladder), SERVE_FLAGS (more serve flags for every ladder, e.g.
# "--mamba-ssm-cache-dtype bfloat16"), NUM_PROMPTS / OFF_PROMPTS / LONG_PROMPTS (requests per
# rung of the spec-on / spec-off / 32k ladders: auto, N or Kx = K x the concurrency),
# LADDER_TIMEOUT (seconds for one ladder's client, default 240; finished rungs are kept).
set -o pipefail
source bench/device_env.sh
SHAPE=${SHAPE:-qwen3-8b}; Q=/tmp/ckpt_$SHAPE; QD=/tmp/ckpt_${SHAPE}_draft; L=/tmp/ladder_logs; mkdir -p $L
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv > $L/smi.txt
[ -f $Q/config.json ] || { t0=$(date +%s); timeout 300 python3 -m dflash_engine.cli make-random-checkpoint --shape $SHAPE $Q \
    --draft $QD 2>&1 | tail -2; echo "checkpoint written in $(( $(date +%s) - t0 )) s"; }
# ladder NAME CONCURRENCIES "ENV=VALUE ..." [serve flags...]
ladder() {
    name=$1; conc=$2; envs=$3; shift 3
    env $envs python3 -m dflash_engine.cli serve $Q --max-num-seqs 32 --max-model-len ${MAXLEN:-8192} --port 8000 \
        ${SERVE_FLAGS:-} "$@" \
        > $L/server_$name.log 2>&1 &
    pid=$!; t0=$(date +%s)
    for i in $(seq 1 ${START_WAIT:-120}); do curl -sf localhost:8000/health > /dev/null && break; kill -0 $pid 2>/dev/null || break; sleep 2; done
    echo "== $name ($envs): server up in $(( $(date +%s) - t0 )) s"; grep -E "KV pool|memory:|state|max concurrency|decode step|SYNTHETIC|Error|hybrid" $L/server_$name.log
    timeout ${LADDER_TIMEOUT:-240} python3 -m dflash_engine.cli bench serve --port 8000 --backend openai-chat \
        --dataset-name random --random-input-len 1024 --random-output-len 512 --num-prompts ${PROMPTS:-auto} \
        --concurrency $conc --result-dir $OUT --result-filename ladder_$name.json \
        --disable-tqdm --label "$name $envs" 2>&1 | tee $L/ladder_$name.log | tail -7
    kill $pid; wait $pid 2>/dev/null
}
# spec K: fixed K drafts; spec aK: adaptive up to K. RATES (a JSON list of K per-position
# acceptance rates, e.g. a real draft's decaying curve) replaces the flat length 6.5.
spec() {
    k=${1%%v*}; vocab=""; [ "$k" != "$1" ] && vocab=', "draft_vocab_size": '${1##*v}
    kk=${k#a}; dl='"fixed"'; [ "$kk" != "$k" ] && dl='"adaptive"'; k=$kk
    if [ -n "$vocab" ] && [ ! -f $QD/draft_vocab.json ]; then
        python3 -m dflash_engine.cli draft-vocab $Q --source stdlib-text --out $QD 2>&1 | tail -2 >&2
    fi
    if [ -n "${RATES:-}" ]; then
        r=$(python3 -c "import json,sys; r=json.loads(sys.argv[1]); k=int(sys.argv[2]); print(json.dumps((r+[r[-1]]*k)[:k]))" "$RATES" $k)
        syn='"synthetic_acceptance_rates": '$r
    else syn='"synthetic_acceptance_length": 6.5'; fi
    echo '{"method": "dflash", "model": "'$QD'", "num_speculative_tokens": '$k', "draft_length": '$dl', "rejection_sample_method": "synthetic", '$syn$vocab'}'
}
KS=${KS-15}; SPEC=$(spec ${KS%% *})
ALL=${CONC:-1,2,4,8,16,32}
[ "${OFF:-1}" = 0 ] || PROMPTS=${OFF_PROMPTS:-auto} ladder spec_off ${OFF_CONC:-$ALL} ""   # OFF_CONC=1,4: only the rungs that showed the start-up TTFT stall
for k in $KS; do PROMPTS=${NUM_PROMPTS:-auto} ladder spec_on_k$k $ALL "" --speculative-config "$(spec $k)"; done
if [ -n "${LONG_CONC:-}" ]; then
    MAXLEN=32768 PROMPTS=${LONG_PROMPTS:-auto} ladder spec_on_32k $LONG_CONC "" --speculative-config "$SPEC"
fi
if [ -n "${SCHED:-}" ]; then   # the draft-length schedule, e.g. SCHED='[[4, 15], [8, 11], [16, 7], [32, 5]]'
    ladder spec_on_sched $ALL "" --speculative-config "${SPEC%\}}, \"num_speculative_tokens_schedule\": $SCHED}"
fi
if [ -n "${AB:-}" ]; then   # the same code with the overlap and the GIL switch interval back to before
    ladder spec_off_sync ${AB_CONC:-32} "DFLASH_OVERLAP=0 DFLASH_SWITCH_INTERVAL_MS=0"
    ladder spec_on_sync ${AB_CONC:-32} "DFLASH_OVERLAP=0 DFLASH_SWITCH_INTERVAL_MS=0" --speculative-config "$SPEC"
fi
tar czf $OUT/logs.tgz -C $L .
