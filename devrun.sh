#!/bin/bash
set -u
export OUT=${OUT:-out}
export SPECLOOP_COMMIT=$(cat .commit 2>/dev/null)
PHASES_BATCH=1 SPEC_METHODS=medusa,draft_model T_PHASES=200 PHASES_ARGS="--kernels --repeat 5 --engines length,adaptive" \
  BREAKDOWN_ARGS="--batch-sizes 1,64 --steps 20 --warm-steps 6" T_BREAKDOWN=90 bash benchmarks/h200_suite.sh phases breakdown
cp /tmp/specloop-results/step_phases.log /tmp/specloop-results/step_phases_b1.log
PHASES_BATCH=8 SPEC_METHODS=medusa T_PHASES=120 PHASES_ARGS="--kernels --repeat 5 --engines length,adaptive" \
  bash benchmarks/h200_suite.sh phases
