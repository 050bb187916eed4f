#!/bin/bash
set -u
export OUT=${OUT:-out}
export SPECLOOP_COMMIT=$(cat .commit 2>/dev/null)
T_SPEC=1 T_SPEC_ADAPTIVE=420 SPEC_METHODS=draft_model,medusa,ngram,eagle3 SPEC_KS=3 SPEC_BATCHES=1,8 SPEC_ROUNDS=2 SPEC_REPEAT=5 \
  SPEC_ARGS="--continuous --output-len-spread 0.5 --control" bash benchmarks/h200_suite.sh spec
