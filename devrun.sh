#!/bin/bash
set -u
export OUT=${OUT:-out}
export SPECLOOP_COMMIT=$(cat .commit 2>/dev/null)
PHASES_BATCH=1 SPEC_METHODS=medusa T_PHASES=150 PHASES_ARGS="--profile --repeat 3 --engines length,adaptive" \
  bash benchmarks/h200_suite.sh phases
mkdir -p $OUT/b1 && cp /tmp/specloop-results/phases/* $OUT/b1/
PHASES_BATCH=8 SPEC_METHODS=medusa T_PHASES=120 PHASES_ARGS="--profile --repeat 3 --engines length" \
  bash benchmarks/h200_suite.sh phases
mkdir -p $OUT/b8 && cp /tmp/specloop-results/phases/*b8* $OUT/b8/
