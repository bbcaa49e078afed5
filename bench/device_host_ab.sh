#!/usr/bin/env bash
# One device call: the server table (bench/device_small_serve.sh: SmolLM2 + shipped draft,
# HumanEval and chat through `dflash-engine serve`, c = CONC) for two snapshots of the code,
# alternating (A, B, A, B: ROUNDS rounds), so that a host-path change is measured side by
# side on one machine. Run from the repository root on the device, after the GGUF halves
# (docs/GPU_NOTES.md); A and B are directories holding `git archive REV python bench tests`
# (each with its own _core.abi3.so). Tables (with the host path per rung) go to $OUT/ab.txt.
#   A=.snap_old B=.snap SERVERS="spec15 off" CONC=8,32 ROUNDS=2 bash .snap/bench/device_host_ab.sh
export ROOT=${ROOT:-$PWD}
FINAL=${OUT:-/tmp/out}; mkdir -p "$FINAL"
for round in $(seq 1 ${ROUNDS:-2}); do
    for side in A B; do
        dir=${!side}
        echo "== round $round, $side ($dir)" | tee -a "$FINAL/ab.txt"
        (cd "$ROOT/$dir" && OUT=/tmp/ab_${side}_$round SERVERS="${SERVERS:-spec15 off}" CONC=${CONC:-8,32} \
            bash bench/device_small_serve.sh > /tmp/ab_${side}_$round.log 2>&1)
        cat /tmp/ab_${side}_$round/table.txt >> "$FINAL/ab.txt" 2>/dev/null || tail -5 /tmp/ab_${side}_$round.log >> "$FINAL/ab.txt"
    done
done
cat "$FINAL/ab.txt"
