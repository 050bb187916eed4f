#!/bin/bash
set -u
export OUT=${OUT:-out}
SPECLOOP_COMMIT=$(cat .commit 2>/dev/null) bash benchmarks/h200_suite.sh "$@"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/smi.txt 2>&1
