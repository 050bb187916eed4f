#!/usr/bin/env bash
# One GPU session, in priority order: the GPU tests, then the benchmarks. Each stage has its own
# time limit, logs to $RES/<stage>.log and re-packs $OUT/results.tgz, so a session cut short still
# returns what finished. Run from the project root on the GPU machine:
#   OUT=/some/dir SPECLOOP_COMMIT=<hash> benchmarks/h200_suite.sh [stage ...]
# (stages: tests offline decode decode8b prefill breakdown structured; the commit is passed in because the
# tree reaches the GPU machine without .git).
set -u
OUT=${OUT:-out/suite}
RES=${RES:-/tmp/specloop-results}
CKPT=${CKPT:-/tmp/specloop-checkpoints}
mkdir -p "$OUT" "$RES" "$CKPT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/specloop && export PYTHONPATH=/tmp/pkg:${PYTHONPATH:-}
# The tree is importable without installing it; the built-in plugins are the distribution's entry
# points, so give it the metadata an install would write.
python3 - <<'PY'
import pathlib, tomllib
project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
info = pathlib.Path(f"/tmp/pkg/specloop-{project['version']}.dist-info")
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: specloop\nVersion: {project['version']}\n")
eps = "".join(f"{k} = {v}\n" for k, v in project["entry-points"]["specloop"].items())
(info / "entry_points.txt").write_text("[specloop]\n" + eps)
PY

pack() { tar czf "$OUT/results.tgz" -C "$RES" . 2>/dev/null; }
stage() {  # stage NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s) $(date +%T)"
  timeout "$limit" "$@" > "$RES/$name.log" 2>&1
  local rc=$?
  grep -v -e '^Processed prompts' -e 'it/s\]$' "$RES/$name.log" | tail -n "${TAIL:-40}"
  echo "=== $name rc=$rc in $((SECONDS - t0))s"
  pack
}

stages=${*:-tests offline decode prefill breakdown}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv > "$RES/nvidia-smi.csv" 2>&1
echo "${SPECLOOP_COMMIT:-$(git log -1 --format=%h 2>/dev/null)}" > "$RES/commit.txt"
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)' \
  | tee "$RES/versions.txt"
for s in $stages; do
  case $s in
    tests) stage gpu_tests "${T_TESTS:-170}" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=15 \
             tests/test_gpu_backend.py tests/test_rejection_sampler.py ;;
    offline) stage offline_throughput "${T_OFFLINE:-230}" python3 benchmarks/offline_throughput.py --out "$RES" \
             --ckpt-root "$CKPT" --peer-time-limit "${PEER_S:-40}" ;;
    decode) stage decode_latency "${T_DECODE:-120}" python3 benchmarks/decode_latency.py --out "$RES" \
             --ckpt-root "$CKPT" --shapes qwen3-0.6b --batch-sizes 1,4,16,64,256 ;;
    decode8b) stage decode_latency_8b "${T_DECODE8B:-200}" python3 benchmarks/decode_latency.py --out "$RES/8b" \
             --ckpt-root "$CKPT" --shapes llama3-8b --batch-sizes 1,16,64 ;;
    prefill) stage prefill "${T_PREFILL:-60}" python3 benchmarks/prefill.py --out "$RES" --ckpt-root "$CKPT" ;;
    breakdown) stage step_breakdown "${T_BREAKDOWN:-60}" python3 benchmarks/step_breakdown.py --out "$RES" \
             --ckpt-root "$CKPT" ;;
    structured) stage structured_outputs "${T_STRUCTURED:-240}" python3 benchmarks/structured_outputs.py --out "$RES" \
             --ckpt-root "$CKPT" --batch 64 ;;
  esac
done
echo "=== done $(date +%T)"
