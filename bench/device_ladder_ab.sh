#!/usr/bin/env bash
# One device call: the 8B serving ladder (bench/device_ladder.sh) for two snapshots of the
# code, alternating (A, B, A, B: ROUNDS rounds), so that a host-path change is measured side
# by side on one machine. A and B are directories holding `git archive REV python bench tests`
# (each with its own _core.abi3.so); the checkpoint is written once (device_ladder.sh keeps it
# in /tmp while the machine is warm). Every ladder's summary (with host ms / GPU idle) goes
# to $OUT/ladder_ab.txt; SNAPS="DIR DIR ..." alternates more than two snapshots. Any device_ladder.sh setting passes through (CONC, KS, OFF, ...):
#   A=.snap_old B=.snap CONC=32 OFF_CONC=32 ROUNDS=2 bash .snap/bench/device_ladder_ab.sh
export ROOT=${ROOT:-$PWD}
FINAL=${OUT:-/tmp/out}; mkdir -p "$FINAL"
for round in $(seq 1 ${ROUNDS:-2}); do
    for dir in ${SNAPS:-$A $B}; do
        echo "== round $round, $dir" | tee -a "$FINAL/ladder_ab.txt"
        (cd "$ROOT/$dir" && OUT=/tmp/ladder_ab/${dir#.}_$round bash bench/device_ladder.sh 2>&1) | tee -a "$FINAL/ladder_ab.txt"
    done
done
tar czf "$FINAL/ladder_ab_raw.tgz" -C /tmp/ladder_ab .   # (a call returns few files: one archive)
