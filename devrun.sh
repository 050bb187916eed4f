#!/bin/bash
set -u
export OUT=${OUT:-out}
export SPECLOOP_COMMIT=$(cat .commit 2>/dev/null)
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/specloop
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:/tmp/pkg
bash benchmarks/h200_suite.sh none >/dev/null 2>&1  # dist-info only
lscpu | grep -E "Model name|MHz|NUMA node|Thread" ; cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>/dev/null
A="--device cuda --batch-sizes 1 --ks 3 --methods medusa --continuous --length-zero --control --repeat 9 --min-rounds 2"
echo "=== unpinned"; python3 benchmarks/spec_decode.py --out $OUT/u $A 2>&1 | grep -E "all runs|speedup|control"
echo "=== pinned to core 5"; taskset -c 5 python3 benchmarks/spec_decode.py --out $OUT/p $A 2>&1 | grep -E "all runs|speedup|control"
echo "=== pinned to cores 4-7"; taskset -c 4-7 python3 benchmarks/spec_decode.py --out $OUT/p4 $A 2>&1 | grep -E "all runs|speedup|control"
