#!/usr/bin/env bash
# Live replay of a Mooncake trace slice against `deepinfer serve` (the demo model on the CPU) under four KV
# cache setups: prefix caching on (default 1 GiB device KV), off, a
# small device KV alone, and the same small device KV with a host-RAM tier. The servers run side by side on
# loopback ports and every request goes to each of them in turn; each server gets one JSON line from
# `bench_replay --live`; the file starts with a line holding this script's command line and settings.
#
#   bash bench/replay/live_replay.sh [OUT.jsonl]
#
# Settings (environment): BUILD_DIR (build), MODEL (models/demo), TRACE (conversation trace), REQUESTS (200),
# BLOCK_TOKENS (64), MAX_PROMPT_TOKENS (512), MAX_TOKENS (4), CONCURRENCY (1), SMALL_KV (9MiB: 96 blocks of
# the demo model's 98,304-byte KV blocks), HOST_KV (1GiB), PORT (18500, then +1 per server), RUNS (the setups
# to run, in order; default "cache no-cache small-device small-device-host").
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT=${1:-bench/results/$(date +%F)-dev-cpu-live-replay.jsonl}
BUILD_DIR=${BUILD_DIR:-build}
MODEL=${MODEL:-models/demo}
TRACE=${TRACE:-tests/data/traces/mooncake/conversation_trace.jsonl}
REQUESTS=${REQUESTS:-200}
BLOCK_TOKENS=${BLOCK_TOKENS:-64}
MAX_PROMPT_TOKENS=${MAX_PROMPT_TOKENS:-512}
MAX_TOKENS=${MAX_TOKENS:-4}
CONCURRENCY=${CONCURRENCY:-1}
SMALL_KV=${SMALL_KV:-9MiB}
HOST_KV=${HOST_KV:-1GiB}
PORT=${PORT:-18500}
RUNS=${RUNS:-"cache no-cache small-device small-device-host"}

SERVER_BIN=$BUILD_DIR/apps/deepinfer
REPLAY_BIN=$BUILD_DIR/bench/bench_replay
for bin in "$SERVER_BIN" "$REPLAY_BIN"; do
  [[ -x $bin ]] || { echo "live_replay.sh: $bin is missing; build the deepinfer and bench_replay targets" >&2; exit 1; }
done
[[ -f $MODEL/config.json ]] || { echo "live_replay.sh: no model at $MODEL (run scripts/setup.sh)" >&2; exit 1; }

server_flags() {
  case $1 in
    cache) echo "" ;;
    no-cache) echo "--no-prefix-caching" ;;
    small-device) echo "--kv-cache-memory $SMALL_KV" ;;
    small-device-host) echo "--kv-cache-memory $SMALL_KV --kv-host-cache-memory $HOST_KV" ;;
    *) echo "live_replay.sh: unknown run '$1'" >&2; return 1 ;;
  esac
}

SERVER_PIDS=()
stop_servers() {
  for pid in "${SERVER_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${SERVER_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  SERVER_PIDS=()
}
trap stop_servers EXIT

mkdir -p "$(dirname "$OUT")"
{
  printf '{"bench":"live_replay_setup","command":"bash bench/replay/live_replay.sh %s","date":"%s","host":"%s","cpus":%s,' \
    "${1:-}" "$(date -u +%FT%TZ)" "$(uname -n)" "$(nproc)"
  printf '"model":"%s","trace":"%s","requests":%s,"block_tokens":%s,"max_prompt_tokens":%s,"max_tokens":%s,' \
    "$MODEL" "$TRACE" "$REQUESTS" "$BLOCK_TOKENS" "$MAX_PROMPT_TOKENS" "$MAX_TOKENS"
  printf '"concurrency":%s,"small_kv":"%s","host_kv":"%s","runs":"%s"}\n' "$CONCURRENCY" "$SMALL_KV" "$HOST_KV" "$RUNS"
} > "$OUT"

# All servers run at once and every request goes to each in turn (bench_replay --live URL,URL,...), so the
# other work on a shared machine slows them alike; an idle server waits on its sockets and costs no CPU.
port=$PORT
urls=""
labels=""
logs=()
for run in $RUNS; do
  flags=$(server_flags "$run")
  log=$(mktemp -t live-replay-server.XXXXXX)
  logs+=("$log")
  # shellcheck disable=SC2086  # flags are words
  "$SERVER_BIN" serve --model-path "$MODEL" --host 127.0.0.1 --port "$port" $flags > "$log" 2>&1 &
  SERVER_PIDS+=($!)
  echo "live_replay.sh: $run: deepinfer serve $flags (port $port)" >&2
  urls+="${urls:+,}http://127.0.0.1:$port"
  labels+="${labels:+|}$run: deepinfer serve --model-path $MODEL${flags:+ $flags}"
  port=$((port + 1))
done
port=$PORT
for i in "${!SERVER_PIDS[@]}"; do
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null 2>&1 && break
    kill -0 "${SERVER_PIDS[$i]}" 2>/dev/null || { cat "${logs[$i]}" >&2; echo "live_replay.sh: server on port $port exited" >&2; exit 1; }
    sleep 0.2
  done
  port=$((port + 1))
done
"$REPLAY_BIN" --live "$urls" --trace "$TRACE" --requests "$REQUESTS" \
  --block-tokens "$BLOCK_TOKENS" --max-prompt-tokens "$MAX_PROMPT_TOKENS" --max-tokens "$MAX_TOKENS" \
  --concurrency "$CONCURRENCY" --label "$labels" | tee -a "$OUT"
stop_servers
rm -f "${logs[@]}"
echo "live_replay.sh: wrote $OUT" >&2
