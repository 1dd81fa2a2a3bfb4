#!/usr/bin/env bash
# gpu-check: the CUDA backend and kernels checked and timed on an NVIDIA Hopper GPU, in one call there.
#
#   here:  bash scripts/gpu-check.sh prepare   CMake build (DEEPINFER_CUDA=ON) of the GPU programs and the test
#                                             binaries, bundled with the shared libraries the GPU machine lacks
#                                             (OpenBLAS, Boost.JSON, ...) and the DeepSeek-V3 tokenizer into
#                                             .device-gpu/bundle.tar.xz (git-ignored, ~9 MB)
#   there: bash scripts/gpu-check.sh           with .device-gpu carried; STAGES="backend model serve" runs a subset
#
# Stages (each runs even if an earlier one failed; the exit status is 0 only when all passed):
#   mla      tests/gpu/gpu_check_mla: MLA decode kernel vs float64 and the CPU backend, ceilings, timings; memcheck
#   gemm     tests/gpu/gpu_check_gemm: bf16 cuBLAS and FP8 block-scaled GEMMs, checks and DeepSeek-V3 shapes
#   ops      tests/gpu/gpu_check_ops: fused rms_norm/silu_mul/rope, MoE routing and permutation; memcheck
#   prefill  tests/gpu/gpu_check_prefill: MLA prefill attention (expanded, varlen, causal) vs float64, timings
#   backend  tests/gpu/gpu_check_backend: every Backend op on CUDA vs the CPU backend; memcheck
#   model    model_tests' CUDA cases: the three fixtures end to end vs transformers' reference logits (bf16 bound,
#            argmax and greedy agreement), the V4 fixture vs DeepSeek's reference the same way, and CUDA vs CPU on V3
#            attention dims (every attention path); memcheck
#   serve    deepinfer serve --device cuda --gpu-memory-utilization 0.5 on the demo model: a chat completion through
#            the OpenAI API
#   pd       tests/cluster/pd_e2e.py with --device cuda: a --role prefill and two --role decode workers behind the
#            router, greedy identity against a --role both worker, the KV transfer faults (four workers share the GPU)
#   tp       with two or more GPUs: deepinfer serve --device cuda --tensor-parallel-size 2 (NCCL) on the demo model,
#            then TP=2 with --expert-parallel-size 2 and EPLB, then two --data-parallel-size 2 ranks (one GPU each,
#            expert parallel over NCCL): greedy text against one GPU (skipped with one GPU; the backend stage checks
#            NCCL with one rank, and model_tests' CudaBackendTest.ExpertParallel* expert parallel with one rank)
#   moe      bench/gpu/bench_model --moe-sweep: one MoE layer (V2-Lite bf16, V3 FP8) at 1..16384 tokens on every
#            expert GEMM path (auto, streaming, tiled, per-expert) against its byte and FLOP limits
#   bench    bench/gpu/bench_model: V2-Lite bf16 and a 4-layer V3 slice FP8 on random weights, decode and prefill
#            (BENCH_ARGS: extra bench_model flags, e.g. "--profile --prefill 4096")
#   v4       tests/cli/v4_serve.sh with the server on CUDA (a random V4 at demo size: completions, prefix cache, disk
#            tier, bounded replay), and bench/gpu/bench_model --model v4-flash-slice: 4 layers of DeepSeek-V4-Flash's shapes (random weights;
#            bf16, then --fp8: FP8 where the release has it) on the V4 path, decode at batch 1, 8, 32 (context 4096)
#            and a 4,096-token prefill (V4_ARGS: more flags)
#   router   bench/router/replay_policies.sh with DEVICE=cuda: the routing policies on the Mooncake conversation trace
#            (4 demo-model workers sharing the GPU behind deepinfer router, against one with 4x the KV; ROUTER_ENV:
#            its settings, e.g. "REQUESTS=800 WORKER_KV=9MiB BIG_KV=36MiB"); JSON lines in $OUT/router_policies.jsonl
#   spec     bench/bench_speculative --device cuda: the demo model off / MTP K=1..3 / DSpark at batch 1, 8, 32 (each
#            run's greedy tokens against the plain run's), and the planner's measured step times for V2-Lite and the
#            V3 slice with an MTP layer (random weights) with the tokens/s they project at given acceptance rates
#            (SPEC_SHAPES=0 leaves those out)
# Everything lands under $OUT (default /tmp/gpu-check/out); a short table is printed last.
set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUNDLE=$ROOT/.device-gpu/bundle.tar.xz

if [ "${1:-}" = prepare ]; then
  CMAKE_BUILD=${CMAKE_BUILD:-build}  # a configured build with DEEPINFER_CUDA=ON
  cmake --build "$CMAKE_BUILD" --target gpu_check_mla gpu_check_gemm gpu_check_ops gpu_check_prefill \
    gpu_check_backend model_tests bench_model bench_speculative bench_replay deepinfer || exit 1
  stage=$(mktemp -d) && mkdir -p "$stage/bin" "$stage/lib" "$stage/tokenizer"
  bins="tests/gpu/gpu_check_mla tests/gpu/gpu_check_gemm tests/gpu/gpu_check_ops tests/gpu/gpu_check_prefill
        tests/gpu/gpu_check_backend tests/model_tests bench/gpu/bench_model bench/bench_speculative bench/bench_replay
        apps/deepinfer"
  for b in $bins; do cp "$CMAKE_BUILD/$b" "$stage/bin/"; done
  strip "$stage"/bin/*
  # Every shared library they link but CUDA's and the C/C++ runtime's (the GPU machine has those).
  for b in "$stage"/bin/*; do ldd "$b"; done | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u \
    | grep -vE '/(libc|libm|libdl|libpthread|librt|libgcc_s|libstdc\+\+|libcuda|libcudart|libcublas|libcublasLt|libnccl)\.so' \
    | xargs -r cp -L -t "$stage/lib/"
  cp models/deepseek-v3/tokenizer.json models/deepseek-v3/tokenizer_config.json "$stage/tokenizer/"
  # The demo model's tokenizer (DeepSeek-V3's with V4's tokens: the v4 stage's random V4 model), from `make setup`.
  mkdir -p "$stage/tokenizer-demo" && cp models/demo/tokenizer.json models/demo/tokenizer_config.json "$stage/tokenizer-demo/"
  mkdir -p .device-gpu && tar -C "$stage" -cJf "$BUNDLE" bin lib tokenizer tokenizer-demo && rm -rf "$stage"
  grep -qx '/.device-gpu/' .git/info/exclude || echo '/.device-gpu/' >>.git/info/exclude
  ls -la "$BUNDLE"
  exit 0
fi

WORK=${GPU_WORK:-/tmp/gpu-check}
OUT=${OUT:-$WORK/out}
STAGES=${STAGES:-"mla gemm ops prefill backend model serve pd moe bench spec"}
mkdir -p "$WORK" "$OUT"
status=0
log() { echo "[gpu-check $(date +%T)] $*" | tee -a "$OUT/gpu-check.log"; }
want() { [[ " $STAGES " == *" $1 "* ]]; }
if [ ! -f "$BUNDLE" ]; then
  log "no $BUNDLE: run 'bash scripts/gpu-check.sh prepare' on a build machine and carry .device-gpu"
  exit 1
fi
tar -C "$WORK" -xJf "$BUNDLE"
BIN=$WORK/bin
export LD_LIBRARY_PATH="$WORK/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export DEEPINFER_SOURCE_DIR=$ROOT  # test data of the checkout, not of the build machine's path
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)

log "nvidia-smi"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
  2>&1 | tee -a "$OUT/gpu-check.log"

# run NAME TIMEOUT CMD...: stdout to $OUT/NAME.jsonl (or .txt), stderr to $OUT/NAME.stderr; failure marks the run.
run() {
  local name=$1 limit=$2; shift 2
  log "running $name: $*"
  timeout "$limit" "$@" >"$OUT/$name.out" 2>"$OUT/$name.stderr"
  local rc=$?
  log "$name exit $rc"
  if [ $rc -ne 0 ]; then
    status=1
    grep -E '"ok":false|error|FAILED|fatal' "$OUT/$name.out" | cut -c1-300 | head -20
    tail -n 8 "$OUT/$name.stderr"
  fi
}
# memcheck NAME TIMEOUT CMD...: compute-sanitizer's memcheck; any error fails the run.
memcheck() {
  local name=$1 limit=$2; shift 2
  [ -z "$SAN" ] && { log "compute-sanitizer not found"; status=1; return; }
  log "compute-sanitizer memcheck $name"
  timeout "$limit" "$SAN" --tool memcheck --error-exitcode 3 ${MEMCHECK_ARGS:-} "$@" >"$OUT/memcheck-$name.txt" 2>&1
  local rc=$?
  log "memcheck $name exit $rc: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck-$name.txt" | tail -1)"
  [ $rc -ne 0 ] && { status=1; grep -m5 -A8 "Invalid\|Error" "$OUT/memcheck-$name.txt"; tail -n 5 "$OUT/memcheck-$name.txt"; }
}

want mla && { run gpu_check_mla 240 "$BIN/gpu_check_mla"; memcheck mla 120 "$BIN/gpu_check_mla" --quick; }
want gemm && run gpu_check_gemm 150 "$BIN/gpu_check_gemm"
want ops && { run gpu_check_ops 150 "$BIN/gpu_check_ops"; memcheck ops 100 "$BIN/gpu_check_ops" --quick; }
want prefill && run gpu_check_prefill 90 "$BIN/gpu_check_prefill"
want backend && { run gpu_check_backend 120 "$BIN/gpu_check_backend"; memcheck backend 200 "$BIN/gpu_check_backend" --no-nccl; }
if want model; then
  run model_tests 200 "$BIN/model_tests" --gtest_filter='*Cuda*'
  memcheck model 400 "$BIN/model_tests" --gtest_filter='*Cuda*:-*ExpertParallel*'
  # Expert parallel makes an NCCL group, whose init probes kernels of other architectures (API errors that memcheck
  # counts by default: cudaErrorNoKernelImageForDevice inside ncclCommInitRank); memory errors still fail it.
  MEMCHECK_ARGS="--report-api-errors no" memcheck model-expert-parallel 200 "$BIN/model_tests" \
    --gtest_filter='*ExpertParallel*'
fi
unpack_demo() {
  [ -f "$WORK/models/demo/model.safetensors" ] && return 0
  mkdir -p "$WORK/models/deepseek-v3" && cp "$WORK"/tokenizer/* "$WORK/models/deepseek-v3/"
  python3 tools/unpack_demo_model.py --src assets/demo-model --tokenizer "$WORK/models/deepseek-v3" \
    --out "$WORK/models/demo" >"$OUT/unpack.txt" 2>&1 || { log "unpacking the demo model failed"; status=1; }
}
if want serve; then
  unpack_demo
  # --gpu-memory-utilization sizes the KV cache from the GPU's memory (vLLM's meaning); the log says how much.
  "$BIN/deepinfer" serve "$WORK/models/demo" --device cuda --port 8123 --gpu-memory-utilization 0.5 \
    >"$OUT/serve.stderr" 2>&1 &
  server=$!
  for _ in $(seq 1 60); do curl -sf localhost:8123/health >/dev/null 2>&1 && break; sleep 1; done
  curl -s localhost:8123/v1/chat/completions -H 'content-type: application/json' -d '{"model": "demo",
    "messages": [{"role": "user", "content": "What is a Python list?"}], "max_tokens": 48, "temperature": 0}' \
    >"$OUT/serve.json" 2>&1
  log "$(grep -h 'gpu-memory-utilization\|KV cache (blocks' "$OUT/serve.stderr" | cut -c1-300)"
  if grep -q '"finish_reason"' "$OUT/serve.json"; then log "serve --device cuda: $(cut -c1-400 "$OUT/serve.json")"
  else log "serve --device cuda FAILED: $(cut -c1-300 "$OUT/serve.json")"; tail -n 20 "$OUT/serve.stderr"; status=1; fi
  kill $server 2>/dev/null; wait $server 2>/dev/null
fi
if want pd; then
  unpack_demo
  PD_E2E_DEVICE=cuda PD_E2E_ARGS="--kv-cache-memory 1GiB" timeout 300 python3 tests/cluster/pd_e2e.py "$BIN/deepinfer" \
    "$WORK/models/demo" >"$OUT/pd_e2e.out" 2>&1
  pd_status=$?
  log "pd (prefill/decode on cuda): exit $pd_status; $(grep -c '^ok:' "$OUT/pd_e2e.out") ok, $(grep -c '^FAIL' "$OUT/pd_e2e.out") failed"
  grep -E '^(FAIL|info)' "$OUT/pd_e2e.out" | head -20
  [ $pd_status = 0 ] || status=1
fi
# tp: tensor parallel on GPUs (NCCL; rank r on GPU r), on a machine with two or more: the demo model's greedy text
# through --tensor-parallel-size 2 (and experts spread over the ranks) against one GPU. NVLink multicast stays off.
if want tp; then
  gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
  if [ "$gpus" -lt 2 ]; then
    log "tp: skipped ($gpus GPU; tensor parallel needs two)"
  else
    unpack_demo
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    tp_ok=1
    ask() {
      curl -s "localhost:$1/v1/chat/completions" -H 'content-type: application/json' -d '{"model": "demo",
        "messages": [{"role": "user", "content": "What is a Python list?"}], "max_tokens": 48, "temperature": 0}' \
        | python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"])'
    }
    for args in "--tensor-parallel-size 1" "--tensor-parallel-size 2"; do
      "$BIN/deepinfer" serve "$WORK/models/demo" --device cuda --port 8124 --kv-cache-memory 1GiB $args \
        >"$OUT/tp-serve.stderr" 2>&1 &
      server=$!
      for _ in $(seq 1 90); do curl -sf localhost:8124/health >/dev/null 2>&1 && break; sleep 1; done
      ask 8124 >"$OUT/tp-$(echo $args | tr -dc 0-9).txt" 2>&1 || tp_ok=0
      kill $server 2>/dev/null; wait $server 2>/dev/null
    done
    if cmp -s "$OUT/tp-1.txt" "$OUT/tp-2.txt" && [ -s "$OUT/tp-1.txt" ]; then log "tp: TP=2 on two GPUs gives one GPU's text"
    else log "tp: TP=2 text differs from one GPU's (bf16: a near-tie may flip; see $OUT/tp-*.txt)"; tp_ok=0; fi
    # Expert parallel over the two tensor-parallel ranks (NCCL), with EPLB moving experts every 4 passes.
    "$BIN/deepinfer" serve "$WORK/models/demo" --device cuda --port 8124 --kv-cache-memory 1GiB --tensor-parallel-size 2 \
      --expert-parallel-size 2 --num-redundant-experts 2 --enable-eplb --eplb-rebalance-num-iterations 4 \
      >"$OUT/tp-ep-serve.stderr" 2>&1 &
    server=$!
    for _ in $(seq 1 90); do curl -sf localhost:8124/health >/dev/null 2>&1 && break; sleep 1; done
    ask 8124 >"$OUT/tp-ep.txt" 2>&1 || tp_ok=0
    kill $server 2>/dev/null; wait $server 2>/dev/null
    # Two data-parallel ranks, one GPU each (rank r takes GPU r: no CUDA_VISIBLE_DEVICES), the experts' rows over
    # NCCL, counts and routing over Gloo.
    for r in 0 1; do
      "$BIN/deepinfer" serve "$WORK/models/demo" --device cuda --port $((8130 + r)) \
        --kv-cache-memory 1GiB --data-parallel-size 2 --data-parallel-rank $r --expert-parallel-size 2 \
        --master-addr 127.0.0.1 --master-port 8140 >"$OUT/dp-serve-$r.stderr" 2>&1 &
      dp_pids[$r]=$!
    done
    for _ in $(seq 1 120); do curl -sf localhost:8131/health >/dev/null 2>&1 && curl -sf localhost:8130/health >/dev/null 2>&1 && break; sleep 1; done
    ask 8130 >"$OUT/dp-0.txt" 2>&1 || tp_ok=0
    ask 8131 >"$OUT/dp-1.txt" 2>&1 || tp_ok=0
    kill "${dp_pids[@]}" 2>/dev/null; wait "${dp_pids[@]}" 2>/dev/null
    for f in tp-ep dp-0 dp-1; do
      if cmp -s "$OUT/tp-1.txt" "$OUT/$f.txt"; then log "tp: $f gives one GPU's text"
      else log "tp: $f text differs from one GPU's (see $OUT/$f.txt; bf16 near-ties may flip)"; tp_ok=0; fi
    done
    [ $tp_ok = 1 ] || status=1
  fi
fi
want moe && run bench_moe_sweep 300 "$BIN/bench_model" --moe-sweep ${MOE_TOKENS:-1,8,64,512,4096,16384} ${MOE_ARGS:-}
want bench && run bench_model 330 "$BIN/bench_model" ${BENCH_ARGS:-}
if want v4; then
  run v4_serve 240 bash tests/cli/v4_serve.sh "$BIN/deepinfer" "$WORK/tokenizer-demo" cuda
  run bench_v4 300 "$BIN/bench_model" --model v4-flash-slice --batches 1,8,32 --prefill 4096 ${V4_ARGS:-}
  run bench_v4_fp8 300 "$BIN/bench_model" --model v4-flash-slice --fp8 --batches 1,8,32 --prefill 4096 ${V4_ARGS:-}
fi
if want router; then
  unpack_demo
  log "router (policies on the trace replay, workers on cuda): ${ROUTER_ENV:-defaults}"
  env ${ROUTER_ENV:-} DEVICE=cuda DEEPINFER_BIN="$BIN/deepinfer" REPLAY_BIN="$BIN/bench_replay" MODEL="$WORK/models/demo" \
    timeout 560 bash bench/router/replay_policies.sh "$OUT/router_policies.jsonl" >"$OUT/router_policies.stderr" 2>&1
  log "router: exit $?; $(grep -c '"bench":"live_replay"' "$OUT/router_policies.jsonl" 2>/dev/null) runs"
fi
if want spec; then
  unpack_demo
  run spec_demo 300 "$BIN/bench_speculative" --device cuda --model "$WORK/models/demo" --draft-tokens 0,1,2,3 \
    --batches 1,8,32 --max-tokens 64 --reps 3 --dspark-max-draft-tokens 4
  # Acceptance: the demo's (K=3, batch 8 on the CPU: drafts 1..k all accepted at 0.65, 0.40, 0.27), and DeepSeek-V3's
  # published 85-90% for its first MTP draft (0.88) with the later positions decaying as the demo's.
  # Batch-invariant mode (DEEPINFER_BATCH_INVARIANT=1): every MTP and DSpark run identical to off at every batch.
  [ "${SPEC_INVARIANT:-1}" = 1 ] && run spec_demo_invariant 300 env DEEPINFER_BATCH_INVARIANT=1 "$BIN/bench_speculative" \
    --device cuda --model "$WORK/models/demo" --draft-tokens 0,1,2,3 --batches 1,8,32 --max-tokens 64 --reps 3 \
    --dspark-max-draft-tokens 4
  [ "${SPEC_SHAPES:-1}" = 1 ] && run spec_shapes_demo_acceptance 240 "$BIN/bench_speculative" --device cuda --draft-tokens 0,1,2,3 --batches 1,8,32 \
    --step-times bench/gpu/configs/v2-lite,bench/gpu/configs/v3-slice --acceptance 0.65,0.40,0.27
  [ "${SPEC_SHAPES:-1}" = 1 ] && run spec_shapes_v3_acceptance 240 "$BIN/bench_speculative" --device cuda --draft-tokens 0,1,2,3 --batches 1,8,32 \
    --step-times bench/gpu/configs/v2-lite,bench/gpu/configs/v3-slice --acceptance 0.88,0.54,0.37
fi

echo
echo "== gpu-check: full output in $OUT =="
grep -h '"kind":"bench"' "$OUT/gpu_check_mla.out" 2>/dev/null \
  | sed -E 's/.*"case":"([^"]*)","variant":"([^"]*)".*"splits":([0-9]+),"median_us":([0-9.]+),"min_us":([0-9.]+),"max_us":([0-9.]+),"gbps":([0-9.]+),"pct_copy":([0-9.]+),"tflops":([0-9.]+),"pct_gemm":([0-9.]+),"max_row_rel_err":([^,]*),.*"ok":([a-z]+).*/\1 \2 s=\3 med=\4 [\5..\6]us \7GB\/s \8% \9TF/'
for f in gpu_check_mla gpu_check_gemm gpu_check_ops gpu_check_prefill; do
  [ -f "$OUT/$f.out" ] && { echo "-- $f"; sed -n '/^case /,$p' "$OUT/$f.out" | grep -v '^check '; }
done
grep -h "ERROR SUMMARY" "$OUT"/memcheck-*.txt 2>/dev/null | sed 's/^/memcheck: /'
grep -h '^\[ .*cuda\|\[  PASSED\|\[  FAILED' "$OUT/model_tests.out" 2>/dev/null | grep -v "chunk [07] prompt" | head -40
tail -n 3 "$OUT/gpu_check_backend.out" 2>/dev/null
echo
echo "== model (random weights; decode at ctx 4096, % of roofline = bytes a step must read / this run's copy rate;"
echo "   prefill one sequence, % of this run's peak in the weights' precision: bf16 cuBLAS or FP8 run_fp8_gemm 8192^3) =="
grep -h '"kind":"ceiling"\|"kind":"model"\|"error"' "$OUT/bench_model.out" 2>/dev/null | cut -c1-200
jf() { sed -nE "s/.*\"$1\":\"?([^,\"}]*).*/\1/p" <<<"$2"; }  # one field of one JSON line
grep -h '"kind":"decode".*"median_ms"' "$OUT/bench_model.out" 2>/dev/null | while read -r l; do
  printf "%-9s decode  B=%-5s %10s tok/s  step %9s ms  roofline %8s ms  %5s%% of roofline\n" "$(jf model "$l")" \
    "$(jf batch "$l")" "$(jf tokens_per_s "$l")" "$(jf median_ms "$l")" "$(jf roofline_ms "$l")" "$(jf pct_roofline "$l")"
done
grep -h '"kind":"prefill".*"median_ms"' "$OUT/bench_model.out" 2>/dev/null | while read -r l; do
  printf "%-9s prefill T=%-5s %10s tok/s  pass %9s ms  %8s TFLOPS  %5s%% of peak\n" "$(jf model "$l")" \
    "$(jf tokens "$l")" "$(jf tokens_per_s "$l")" "$(jf median_ms "$l")" "$(jf tflops "$l")" "$(jf pct_peak "$l")"
done
grep -h '"kind":"chunk".*"median_ms"' "$OUT/bench_model.out" 2>/dev/null | while read -r l; do
  printf "%-9s chunk   %s rows after %s (%s)  %10s tok/s  pass %9s ms  %8s TFLOPS  %5s%% of peak\n" "$(jf model "$l")" \
    "$(jf tokens "$l")" "$(jf prefix "$l")" "$(jf mla_form "$l")" "$(jf tokens_per_s "$l")" "$(jf median_ms "$l")" \
    "$(jf tflops "$l")" "$(jf pct_peak "$l")"
done
if [ -f "$OUT/bench_moe_sweep.out" ]; then
  echo
  echo "== one MoE layer per expert GEMM path (limit: experts read once at the copy rate, or FLOPs at peak) =="
  grep -h '"kind":"moe_sweep"' "$OUT/bench_moe_sweep.out" | while read -r l; do
    printf "%-9s %-10s T=%-6s rows/expert %-7s %10s us  bytes %9s us  flops %9s us  %5s%% of limit %s\n" \
      "$(jf model "$l")" "$(jf path "$l")" "$(jf tokens "$l")" "$(jf rows_per_expert "$l")" "$(jf us "$l")" \
      "$(jf bytes_limit_us "$l")" "$(jf flops_limit_us "$l")" "$(jf pct_of_limit "$l")" "$(jf error "$l")"
  done
fi
if [ -f "$OUT/spec_demo.out" ]; then
  echo
  echo "== speculative decoding on the demo model (greedy; identical_to_off: the tokens equal the plain run's) =="
  grep -h '"bench":"speculative"' "$OUT/spec_demo.out" | while read -r l; do
    printf "B=%-3s %-6s K=%-2s %9s tok/s  x%-6s accepted length %-6s identical %s\n" "$(jf batch "$l")" \
      "$(jf algorithm "$l")" "$(jf draft_tokens "$l")" "$(jf tokens_per_s "$l")" "$(jf speedup_vs_off "$l")" \
      "$(jf mean_accepted_length "$l")" "$(jf identical_to_off "$l")"
  done
  grep -h '"bench":"speculative_projection"' "$OUT"/spec_shapes_*.out 2>/dev/null | cut -c1-220
fi
echo "gpu-check: $([ $status -eq 0 ] && echo PASS || echo FAIL)"
exit $status
