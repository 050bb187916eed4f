#!/usr/bin/env bash
# One GPU session, in priority order: the GPU tests, then the benchmarks. Each stage has its own
# time limit, logs to $RES/<stage>.log and re-packs $OUT/results.tgz, so a session cut short still
# returns what finished. Run from the project root on the GPU machine:
#   OUT=/some/dir SPECLOOP_COMMIT=<hash> benchmarks/h200_suite.sh [stage ...]
# (OFFLINE_ARGS: more offline_throughput.py flags, e.g. --no-peer; SPEC_ARGS: more spec_decode.py
# flags for the spec stages, e.g. --batch-invariant or --continuous; SPEC_REPEAT: timed runs of each
# configuration, 2 by default; SPEC_ROUNDS: at least that many rounds of each batch size in the spec
# stage, 1 by default: comparing policies needs 4 or more, or the runs are a few hundred steps;
# STRUCTURED_ARGS: more structured_outputs.py flags, e.g. --shape llama3-8b; MTP_ARGS / DECODE_ARGS: more
# mtp_cost.py / decode_latency.py flags (the decode and deepseek stages), e.g. --no-skinny-gemv)
# (stages: tests spectests offline decode decode8b peer prefill gemv tune moe ds_batch1 long_context probe attention launches breakdown phases serving spec spec8b mtp deepseek structured; the commit is passed in because
# the tree reaches the GPU machine without .git). On a machine of 4 GPUs the multi-GPU stages run by
# name: `benchmarks/h200_suite.sh tp dp` (TP=1/2/4 on llama3-8b and the 70B per-layer shapes over
# 10 of its layers at TP=4; DP=1/2 serving of llama3-8b); runs needing more GPUs than present are
# skipped, and TP_RUNS / DP_SIZES pick fewer runs to fit one call's time.
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

stages=${*:-tests offline decode prefill breakdown deepseek}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv > "$RES/nvidia-smi.csv" 2>&1
echo "${SPECLOOP_COMMIT:-$(git log -1 --format=%h 2>/dev/null)}" > "$RES/commit.txt"
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)' \
  | tee "$RES/versions.txt"
for s in $stages; do
  case $s in
    # The GPU tests in two stages (the whole of them does not fit one call): the backend's, ~450 s on
    # the H200, then the speculation and rejection-sampling ones, ~150 s.
    tests) stage gpu_tests "${T_TESTS:-500}" python3 -P -m pytest -v -m gpu -p no:cacheprovider --durations=15 -rfE \
             --tb=short -k "${GPU_TESTS_K:-}" tests/test_gpu_backend.py ;;
    spectests) stage gpu_spec_tests "${T_SPEC_TESTS:-300}" python3 -P -m pytest -v -m gpu -p no:cacheprovider \
             --durations=15 -rfE --tb=short -k "${GPU_TESTS_K:-}" tests/test_gpu_speculation.py \
             tests/test_rejection_sampler.py ;;
    offline) stage offline_throughput "${T_OFFLINE:-230}" python3 benchmarks/offline_throughput.py --out "$RES" \
             --ckpt-root "$CKPT" --peer-time-limit "${PEER_S:-40}" ${OFFLINE_ARGS:-} ;;
    decode) stage decode_latency "${T_DECODE:-120}" python3 benchmarks/decode_latency.py --out "$RES" \
             --ckpt-root "$CKPT" --shapes qwen3-0.6b --batch-sizes 1,4,16,64,256 ${DECODE_ARGS:-} ;;
    decode8b) stage decode_latency_8b "${T_DECODE8B:-200}" python3 benchmarks/decode_latency.py --out "$RES/8b" \
             --ckpt-root "$CKPT" --shapes llama3-8b --batch-sizes 1,16,64 ${DECODE_ARGS:-} ;;
    peer)  # batch-1 decode's plain-PyTorch peer (static cache, torch.compile reduce-overhead), then specloop's, in turn
      stage gpu_peer_test "${T_PEER_TEST:-150}" python3 -P -m pytest -v -m gpu -p no:cacheprovider -rfE --tb=short \
             tests/test_compiled_peer.py
      stage compiled_peer "${T_PEER:-300}" python3 benchmarks/compiled_peer.py --out "$RES/peer" --ckpt-root "$CKPT" \
             --shapes "${PEER_SHAPES:-qwen3-0.6b}"
      stage decode_beside_peer "${T_DECODE:-120}" python3 benchmarks/decode_latency.py --out "$RES/peer" \
             --ckpt-root "$CKPT" --shapes "${PEER_SHAPES:-qwen3-0.6b}" --batch-sizes 1 ;;
    prefill) stage prefill "${T_PREFILL:-60}" python3 benchmarks/prefill.py --out "$RES" --ckpt-root "$CKPT" ;;
    gemv)  # the few-rows linear kernel against cuBLAS at decode shapes, then batch-1/4 decode with it and without
      stage gemv "${T_GEMV:-200}" python3 benchmarks/gemv.py --out "$RES/gemv"
      stage decode_skinny "${T_DECODE_SKINNY:-240}" python3 benchmarks/decode_latency.py --out "$RES/skinny" \
             --ckpt-root "$CKPT" --shapes "${GEMV_SHAPES:-qwen3-0.6b,llama3-8b}" --batch-sizes 1,4 --skinny-gemv
      stage decode_cublas "${T_DECODE_SKINNY:-240}" python3 benchmarks/decode_latency.py --out "$RES/cublas" \
             --ckpt-root "$CKPT" --shapes "${GEMV_SHAPES:-qwen3-0.6b,llama3-8b}" --batch-sizes 1,4 --no-skinny-gemv ;;
    tune)  # the few-rows kernel's splits of K at qwen3-0.6b, the MoE at 1-4 tokens, latent attention's splits
      stage gemv_tune "${T_TUNE:-240}" python3 benchmarks/gemv.py --out "$RES/tune" --shapes qwen3-0.6b --rows 1 \
             --sweep "${TUNE_SWEEP:-4,8:256,512:4:3:0,2,4}" --moe-tokens 1,2,4 --mla-shapes deepseek-v2-lite ;;
    moe)  # DeepSeek-V2-Lite's one-token MoE: the down kernel's picks over 1-8 programs a block of hidden units,
          # alone, then batch-1 decode with the GPU runner's moe_down_groups at 1 and MOE_GROUPS, in turn
      stage moe_tune "${T_MOE:-150}" python3 benchmarks/gemv.py --out "$RES/moe" --skip-linear --pdl \
             --moe-sweep "${MOE_SWEEP:-4:128:2:3/4,8:256,512:4:2:1,2,4,8}"
      for run in a b; do
        for g in 1 "${MOE_GROUPS:-4}"; do
          stage "ds_decode_groups${g}_$run" "${T_MOE_DECODE:-100}" python3 benchmarks/decode_latency.py \
               --out "$RES/moe_groups${g}_$run" --ckpt-root "$CKPT" --shapes deepseek-v2-lite --batch-sizes 1 \
               --moe-down-groups "$g"
        done
      done ;;
    ds_batch1)  # DeepSeek-V2-Lite batch 1: the defaults, without the shared experts' stream (the fused router
                # is shorter than the stream's kernel), and with PDL, the stream and the fused routing off
                # (DS_OFF), in turn, twice; then the router alone
      for run in a b; do
        for variant in defaults no_stream off; do
          case $variant in
            defaults) flags= ;;
            no_stream) flags=--no-moe-shared-stream ;;
            off) flags=${DS_OFF:---no-pdl --no-moe-shared-stream --no-fused-routing} ;;
          esac
          stage "ds_batch1_${variant}_$run" "${T_DS_B1:-100}" python3 benchmarks/decode_latency.py \
               --out "$RES/ds_batch1_${variant}_$run" --ckpt-root "$CKPT" --shapes deepseek-v2-lite --batch-sizes 1 $flags
        done
      done
      stage router "${T_ROUTER:-150}" python3 benchmarks/gemv.py --out "$RES/router" --skip-linear --moe-shapes "" \
             --router-shapes deepseek-v2-lite --pdl ;;
    long_context)  # decode graphs with more splits over long contexts (long_context_graphs), off and on, in turn
      for run in a b; do
        for opt in --no-long-context-graphs --long-context-graphs; do
          stage "decode_${opt#--}_$run" "${T_LONG:-110}" python3 benchmarks/decode_latency.py \
               --out "$RES/${opt#--}_$run" --ckpt-root "$CKPT" --shapes qwen3-0.6b --batch-sizes 24,32,48,64 \
               --prompt-len 1024 --output-len 256 $opt
        done
      done ;;
    probe)  # a decoder's projection chain in one persistent kernel with grid barriers, against the few-rows kernels
      stage persistent_probe "${T_PROBE:-80}" python3 benchmarks/persistent_probe.py --out "$RES/probe" ;;
    attention)  # decode attention of qwen3-0.6b at batches of sequences: every tile and split count swept
      stage attention_tune "${T_ATTENTION:-150}" python3 benchmarks/gemv.py --out "$RES/attention" --skip-linear \
             --moe-shapes "" --attention-shapes qwen3-0.6b --attention-batches "${ATTENTION_BATCHES:-1,4,16,32,64,256}" \
             --attention-contexts 160,1024 --calls 20 --replays 10 \
             --attention-sweep "${ATTENTION_SWEEP:-32,64,128:4:2:1,2,4,8,16,32}" ;;
    launches)  # fewer launches a layer, each off by default until measured: rotary inside decode attention
               # (rope_in_attention), split sums by the last program (last_sums); their GPU tests, then decode
      [ -n "${LAUNCH_SKIP_TESTS:-}" ] || stage launches_tests "${T_LAUNCHES_TESTS:-150}" python3 -P -m pytest -q -m gpu -p no:cacheprovider \
             tests/test_gpu_backend.py -k "rope or skinny_linear or paged_attention or launch_options"
      for opts in "--no-rope-in-attention --no-last-sums" "--rope-in-attention" "--last-sums" \
                  "--rope-in-attention --last-sums"; do
        name=$(echo "$opts" | tr -d '-' | tr ' ' '_')
        stage "decode_$name" "${T_DECODE_LAUNCHES:-80}" python3 benchmarks/decode_latency.py --out "$RES/$name" \
             --ckpt-root "$CKPT" --shapes qwen3-0.6b --batch-sizes "${LAUNCH_BATCHES:-1,4}" $opts
      done ;;
    tp) stage tp_tests "${T_TP_TESTS:-120}" python3 -P -m pytest -q -m gpu -p no:cacheprovider tests/test_tensor_parallel.py
        stage tensor_parallel "${T_TP:-460}" python3 benchmarks/distributed.py --out "$RES/tp" --ckpt-root "$CKPT" \
             --runs "${TP_RUNS:-llama3-8b@1,llama3-8b@2,llama3-8b@4,llama3-70b:10@4}" --dp "" ;;
    dp) stage data_parallel "${T_DP:-400}" python3 benchmarks/distributed.py --out "$RES/dp" --ckpt-root "$CKPT" \
             --runs "" --dp "${DP_SIZES:-1,2}" ;;
    serving)  # specloop serve (engine in its own process) at rates 4, 16, inf, and offline in the same run
      ckpt=$(python3 -c "import sys, torch; sys.path.insert(0, 'benchmarks'); from common import build_checkpoint; print(build_checkpoint('qwen3-0.6b', '$CKPT', torch.device('cuda')))" | tail -1)
      stage serving "${T_SERVING:-330}" python3 benchmarks/serving.py --model "$ckpt" --rates "${RATES:-4,16,inf}" \
             --num-prompts 200 --input-len 1024 --output-len 128 --offline --json "$RES/serving.json" \
             --engine-args "--skip-tokenizer-init --dtype bfloat16" ;;
    spec)  # speculative decoding on the default models (greedy, held-out prompts), fixed and adaptive K
      stage spec_default "${T_SPEC:-300}" python3 benchmarks/spec_decode.py --out "$RES/spec" --device cuda \
             --batch-sizes "${SPEC_BATCHES:-1,32}" --ks "${SPEC_KS:-1,3}" --methods "${SPEC_METHODS:-ngram,draft_model,eagle,eagle3,medusa}" --repeat "${SPEC_REPEAT:-2}" \
             --min-rounds "${SPEC_ROUNDS:-1}" ${SPEC_ARGS:-}
      stage spec_adaptive "${T_SPEC_ADAPTIVE:-200}" python3 benchmarks/spec_decode.py --out "$RES/spec_adaptive" \
             --device cuda --batch-sizes "${SPEC_BATCHES:-1,32}" --ks 3 --methods "${SPEC_METHODS:-ngram,draft_model,eagle,eagle3,medusa}" --policy adaptive \
             --repeat "${SPEC_REPEAT:-2}" --min-rounds "${SPEC_ROUNDS:-1}" ${SPEC_ARGS:-} ;;
    spec8b)  # acceptance-controlled on llama3-8b: alpha 0.8, K 3, ngram, a random EAGLE-3 head, a 1B draft model
      stage spec_controlled_8b "${T_SPEC8B:-420}" python3 benchmarks/spec_decode.py --out "$RES/spec8b" \
             --device cuda --ckpt-root "$CKPT" --model llama3-8b --draft-model llama3.2-1b --prompts random \
             --alpha 0.8 --ks "${SPEC_KS:-3}" --batch-sizes 1 --methods "${SPEC_METHODS:-ngram,eagle3,draft_model}" \
             --prompt-len 128 --output-len 128 \
             --min-prompts 2 --repeat "${SPEC_REPEAT:-2}" ${SPEC_ARGS:-} ;;
    phases)  # host time per engine phase, with and without drafts (default models, one batch size)
      stage step_phases "${T_PHASES:-150}" python3 benchmarks/step_phases.py --out "$RES/phases" --device cuda \
             --batch "${PHASES_BATCH:-32}" --methods "${SPEC_METHODS:-ngram,eagle3}" ${PHASES_ARGS:-} ;;
    breakdown) stage step_breakdown "${T_BREAKDOWN:-60}" python3 benchmarks/step_breakdown.py --out "$RES" \
             --ckpt-root "$CKPT" ${BREAKDOWN_ARGS:-} ;;
    mtp) stage ds_mtp_cost "${T_DS_MTP:-180}" python3 benchmarks/mtp_cost.py --out "$RES/deepseek" --ckpt-root "$CKPT" \
             ${MTP_ARGS:---token-map 32768} ;;
    deepseek)  # DeepSeek-V2-Lite shape with one MTP layer: KV bytes and MTP cost, decode, offline vs transformers
      stage ds_mtp_cost "${T_DS_MTP:-180}" python3 benchmarks/mtp_cost.py --out "$RES/deepseek" --ckpt-root "$CKPT" \
             ${MTP_ARGS:---token-map 32768}
      stage ds_decode "${T_DS_DECODE:-150}" python3 benchmarks/decode_latency.py --out "$RES/deepseek" \
             --ckpt-root "$CKPT" --shapes deepseek-v2-lite --batch-sizes 1,16,64,256 ${DECODE_ARGS:-}
      stage ds_offline "${T_DS_OFFLINE:-300}" python3 benchmarks/offline_throughput.py --out "$RES/deepseek" \
             --ckpt-root "$CKPT" --shape deepseek-v2-lite --peer-time-limit "${PEER_S:-40}" ;;
    structured) stage structured_outputs "${T_STRUCTURED:-240}" python3 benchmarks/structured_outputs.py --out "$RES" \
             --ckpt-root "$CKPT" --batch 64 ${STRUCTURED_ARGS:-} ;;
  esac
done
echo "=== done $(date +%T)"
