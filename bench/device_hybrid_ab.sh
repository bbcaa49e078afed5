#!/usr/bin/env bash
# One call on the GPU machine: the Qwen3.5-27B hybrid step before and after a change, side by
# side. Writes the random checkpoint if missing (60 s), then for each snapshot in SNAPS
# (default ".snap_old .snap": `git archive <commit> python bench | tar -x -C .snap_old`, each
# with python/dflash_engine/_core.abi3.so copied in, both carried) runs bench/profile_step.py
# at C (default 1) eager and with CUDA graphs (this tree's profile_step.py over each snapshot's
# package). Run from the repository root: `ROOT=$PWD bash bench/device_hybrid_ab.sh`.
# Output: $OUT/profile_<snap>_<mode>.md.
set -o pipefail
ROOT=${ROOT:-$PWD}
source bench/device_env.sh
SHAPE=${SHAPE:-qwen3.5-27b}; Q=/tmp/ckpt_$SHAPE; QD=/tmp/ckpt_${SHAPE}_draft
[ -f $Q/config.json ] || timeout 300 python3 -m dflash_engine.cli make-random-checkpoint --shape $SHAPE $Q \
    --draft $QD 2>&1 | tail -1
for snap in ${SNAPS:-.snap_old .snap}; do
    for mode in eager graphs; do
        flag=""; [ $mode = graphs ] && flag=--graphs
        echo "== $snap $mode"
        (cd $ROOT/$snap && PYTHONPATH=/tmp/site:$PWD/python timeout ${PROFILE_TIMEOUT:-150} python3 $ROOT/bench/profile_step.py \
            --target $Q --draft $QD --c ${C:-1} --context 1024 --steps 5 --top 20 $flag 2>&1 | grep -v Warning \
            | tee $OUT/profile_${snap#.}_$mode.md | head -8)
    done
done
