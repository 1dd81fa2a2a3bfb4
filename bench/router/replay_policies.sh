#!/usr/bin/env bash
# Routing policies on a live Mooncake trace replay (issue 19, item 5): `deepinfer router` over 4 `deepinfer serve`
# workers (the demo model on the CPU, a small device KV each, KV events on), once per policy, against one worker
# with 4x the KV (the ideal a router can reach: one cache holding what the 4 hold together). Every run starts
# fresh workers. The prompts are `bench_replay --live`'s: token-id prompts that share prefixes as the trace's hash
# ids do; each trace block of 512 tokens becomes BLOCK_TOKENS tokens.
#
# The seed's gateway hashes the first 2,048 characters of system + user text, about one trace block (512 tokens)
# of real text. The replay shrinks a trace block to BLOCK_TOKENS tokens, so the same gateway at 2,048 characters
# sees several trace blocks; `consistent-hash-scaled` runs it at 2048 * BLOCK_TOKENS / 512 characters, what the
# seed's gateway sees of the real trace (every conversation request there starts with the same block).
#
#   bash bench/router/replay_policies.sh [OUT.jsonl]
#
# Settings (environment): BUILD_DIR (build; or DEEPINFER_BIN and REPLAY_BIN, the two binaries), DEVICE (cpu; cuda:
# the workers share one GPU, and a CUDA block holds half the bytes of a CPU one, bf16 against float32, so the
# same KV sizes hold twice the blocks), MODEL (models/demo), TRACE (conversation trace), REQUESTS (200),
# BLOCK_TOKENS (64), MAX_PROMPT_TOKENS (512), MAX_TOKENS (4), CONCURRENCY (4), WORKER_KV (9MiB: 96 blocks of the
# demo model), BIG_KV (36MiB), WORKER_THREADS (CPU threads per worker of the 4: max(1, nproc / 4); the single
# worker gets nproc, so every setup has the machine's cores), PORT (18600..), RUNS (default "kv-aware round-robin least-load consistent-hash
# consistent-hash-scaled single-4x"; also kv-aware-decode-weight-1 and
# kv-aware-queue-weight-W).
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT=${1:-bench/results/$(date +%F)-dev-cpu-router-policies.jsonl}
BUILD_DIR=${BUILD_DIR:-build}
MODEL=${MODEL:-models/demo}
TRACE=${TRACE:-tests/data/traces/mooncake/conversation_trace.jsonl}
REQUESTS=${REQUESTS:-200}
BLOCK_TOKENS=${BLOCK_TOKENS:-64}
MAX_PROMPT_TOKENS=${MAX_PROMPT_TOKENS:-512}
MAX_TOKENS=${MAX_TOKENS:-4}
CONCURRENCY=${CONCURRENCY:-4}
WORKER_KV=${WORKER_KV:-9MiB}
BIG_KV=${BIG_KV:-36MiB}
PORT=${PORT:-18600}
WORKER_THREADS=${WORKER_THREADS:-$(( $(nproc) / 4 > 1 ? $(nproc) / 4 : 1 ))}
RUNS=${RUNS:-"kv-aware round-robin least-load consistent-hash consistent-hash-scaled single-4x"}

DEVICE=${DEVICE:-cpu}
BIN=${DEEPINFER_BIN:-$BUILD_DIR/apps/deepinfer}
REPLAY_BIN=${REPLAY_BIN:-$BUILD_DIR/bench/bench_replay}
for bin in "$BIN" "$REPLAY_BIN"; do
  [[ -x $bin ]] || { echo "replay_policies.sh: $bin is missing; build deepinfer and bench_replay" >&2; exit 1; }
done

PIDS=()
stop_all() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  PIDS=()
}
trap stop_all EXIT

wait_health() {  # URL [healthy workers]
  for _ in $(seq 1 300); do
    body=$(curl -sf "$1/health" 2>/dev/null || true)
    if [[ -n $body ]] && { [[ -z ${2:-} ]] || [[ $body == *"\"healthy_workers\":$2"* ]]; }; then return 0; fi
    sleep 0.2
  done
  echo "replay_policies.sh: $1 did not become healthy" >&2
  return 1
}

start_worker() {  # INDEX KV THREADS; sets URL (no command substitution: PIDS must be this shell's)
  local port=$((PORT + 1 + $1))
  URL="http://127.0.0.1:$port"
  OMP_NUM_THREADS=$3 OPENBLAS_NUM_THREADS=$3 "$BIN" serve --device "$DEVICE" --model-path "$MODEL" --host 127.0.0.1 --port "$port" --kv-cache-memory "$2" \
    --kv-events-endpoint "tcp://127.0.0.1:$((PORT + 20 + 2 * $1))" \
    --kv-events-replay-endpoint "tcp://127.0.0.1:$((PORT + 21 + 2 * $1))" >"$LOGDIR/worker$1.log" 2>&1 &
  PIDS+=($!)
}

LOGDIR=$(mktemp -d)
mkdir -p "$(dirname "$OUT")"
printf '{"bench":"router_policies_setup","command":"bash bench/router/replay_policies.sh %s","device":"'"$DEVICE"'","date":"%s","host":"%s","cpus":%s,"model":"%s","trace":"%s","requests":%s,"block_tokens":%s,"max_prompt_tokens":%s,"max_tokens":%s,"concurrency":%s,"worker_kv":"%s","big_kv":"%s","worker_threads":%s,"runs":"%s"}\n' \
  "${1:-}" "$(date -u +%FT%TZ)" "$(uname -n)" "$(nproc)" "$MODEL" "$(basename "$TRACE" .jsonl)" "$REQUESTS" \
  "$BLOCK_TOKENS" "$MAX_PROMPT_TOKENS" "$MAX_TOKENS" "$CONCURRENCY" "$WORKER_KV" "$BIG_KV" "$WORKER_THREADS" "$RUNS" >"$OUT"

for run in $RUNS; do
  stop_all
  if [[ $run == single-4x ]]; then
    start_worker 0 "$BIG_KV" "$(nproc)"
    url=$URL
    wait_health "$url"
    label="single worker, --kv-cache-memory $BIG_KV"
  else
    policy=$run
    extra=()
    if [[ $run == consistent-hash-scaled ]]; then
      policy=consistent-hash
      extra=(--affinity-chars $((2048 * BLOCK_TOKENS / 512)))
    elif [[ $run == kv-aware-decode-weight-1 ]]; then  # decode load weighed as Dynamo's router does
      policy=kv-aware
      extra=(--decode-weight 1)
    elif [[ $run == kv-aware-queue-weight-* ]]; then
      policy=kv-aware
      extra=(--queue-weight "${run#kv-aware-queue-weight-}")
    fi
    workers=()
    for i in 0 1 2 3; do
      start_worker "$i" "$WORKER_KV" "$WORKER_THREADS"
      workers+=(--worker "$URL")
    done
    url="http://127.0.0.1:$PORT"
    "$BIN" router "${workers[@]}" --model-path "$MODEL" --policy "$policy" "${extra[@]}" --host 127.0.0.1 \
      --port "$PORT" --health-check-interval-ms 200 >"$LOGDIR/router.log" 2>&1 &
    PIDS+=($!)
    wait_health "$url" 4
    sleep 1  # every worker's KV events subscribed
    label="router --policy $policy ${extra[*]} over 4 workers, --kv-cache-memory $WORKER_KV each"
  fi
  echo "replay_policies.sh: $run" >&2
  "$REPLAY_BIN" --live "$url" --trace "$TRACE" --requests "$REQUESTS" --block-tokens "$BLOCK_TOKENS" \
    --max-prompt-tokens "$MAX_PROMPT_TOKENS" --max-tokens "$MAX_TOKENS" --concurrency "$CONCURRENCY" \
    --label "$run: $label" >>"$OUT"
done
stop_all
rm -rf "$LOGDIR"
echo "replay_policies.sh: wrote $OUT" >&2
