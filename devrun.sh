#!/bin/bash
set -u
export OUT=${OUT:-out}
export SPECLOOP_COMMIT=$(cat .commit 2>/dev/null)
PHASES_BATCH=1 SPEC_METHODS=medusa,draft_model T_PHASES=170 PHASES_ARGS="--repeat 5 --engines length --warm-seconds 6" \
  bash benchmarks/h200_suite.sh phases
