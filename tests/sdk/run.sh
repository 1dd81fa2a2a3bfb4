#!/usr/bin/env bash
# Starts `deepinfer serve` on the built-in demo model (models/demo, unpacked by setup) on a loopback port, runs the official openai and
# @anthropic-ai/sdk clients' tests against it (node --test), and stops the server. Used by `make test`.
# Also starts two scripted_server test doubles (build/tests/scripted) for the tool-call/reasoning tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
PORT=${DEEPINFER_TEST_PORT:-18123}
(cd tests/sdk && npm ci --silent --no-audit --no-fund)
log=$(mktemp)
times=$(mktemp -d)
# With DSpark (speculative decoding, issue 17): greedy output must not change, so every exact transcript below (the
# Tokyo tool call of demo_tools.test.mjs among them) also checks that its drafts are verified exactly. The step
# times are measured at startup (~5 s) into a scratch file.
"$BUILD/apps/deepinfer" serve --model-path models/demo --device cpu --host 127.0.0.1 --port "$PORT" \
  --dspark-enable --dspark-step-time-table "$times/step-times.json" >"$log" 2>&1 &
server=$!
# The test-only scripted engine double behind the real server, for tools.test.mjs (V3.1 and V4.1 formats).
V31_PORT=${DEEPINFER_SCRIPTED_PORT_V31:-18124}; V41_PORT=${DEEPINFER_SCRIPTED_PORT_V41:-18125}
"$BUILD/tests/scripted/scripted_server" --port "$V31_PORT" --chat-format deepseek-v3.1 >>"$log" 2>&1 & scripted31=$!
"$BUILD/tests/scripted/scripted_server" --port "$V41_PORT" --chat-format deepseek-v4.1 >>"$log" 2>&1 & scripted41=$!
trap 'kill "$server" "$scripted31" "$scripted41" 2>/dev/null || true; wait "$server" "$scripted31" "$scripted41" 2>/dev/null || true; rm -rf "$log" "$times"' EXIT
# Wait for /health (at most 60 s).
node -e '
  const url = process.argv[1];
  const deadline = Date.now() + 60000;
  (async () => {
    while (Date.now() < deadline) {
      try { if ((await fetch(url)).ok) process.exit(0); } catch {}
      await new Promise((r) => setTimeout(r, 250));
    }
    process.exit(1);
  })();' "http://127.0.0.1:$PORT/health" || { echo "server did not become healthy:"; cat "$log"; exit 1; }
for p in "$V31_PORT" "$V41_PORT"; do
  node -e 'const u = process.argv[1], end = Date.now() + 30000; (async () => { while (Date.now() < end) {
    try { if ((await fetch(u)).ok) process.exit(0); } catch {} await new Promise((r) => setTimeout(r, 250)); }
    process.exit(1); })();' "http://127.0.0.1:$p/health" || { echo "scripted_server did not become healthy:"; cat "$log"; exit 1; }
done
export DEEPINFER_SCRIPTED_URL_V31="http://127.0.0.1:$V31_PORT" DEEPINFER_SCRIPTED_URL_V41="http://127.0.0.1:$V41_PORT"
DEEPINFER_URL="http://127.0.0.1:$PORT" node --test --test-reporter=spec tests/sdk/ || { echo "--- server log"; tail -50 "$log"; exit 1; }

# Again through `deepinfer router` (kv-aware) in front of two workers: the clients cannot tell the difference.
kill "$server"; wait "$server" 2>/dev/null || true
W0=$((PORT + 10)); W1=$((PORT + 11)); ROUTER=$((PORT + 12))
for i in 0 1; do
  "$BUILD/apps/deepinfer" serve --model-path models/demo --device cpu --host 127.0.0.1 --port $((W0 + i)) \
    --kv-events-endpoint "tcp://127.0.0.1:$((PORT + 20 + 2 * i))" \
    --kv-events-replay-endpoint "tcp://127.0.0.1:$((PORT + 21 + 2 * i))" >>"$log" 2>&1 &
  eval "worker$i=\$!"
done
"$BUILD/apps/deepinfer" router --worker "http://127.0.0.1:$W0" --worker "http://127.0.0.1:$W1" --model-path models/demo \
  --host 127.0.0.1 --port "$ROUTER" --health-check-interval-ms 200 >>"$log" 2>&1 &
router=$!
trap 'kill "$server" "$scripted31" "$scripted41" "$worker0" "$worker1" "$router" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$log" "$times"' EXIT
node -e '
  const url = process.argv[1];
  const deadline = Date.now() + 60000;
  (async () => {
    while (Date.now() < deadline) {
      try { const r = await fetch(url); if (r.ok && (await r.json()).healthy_workers === 2) process.exit(0); } catch {}
      await new Promise((r) => setTimeout(r, 250));
    }
    process.exit(1);
  })();' "http://127.0.0.1:$ROUTER/health" || { echo "the router's two workers did not become healthy:"; tail -30 "$log"; exit 1; }
DEEPINFER_URL="http://127.0.0.1:$ROUTER" node --test --test-reporter=spec tests/sdk/ || { echo "--- log"; tail -50 "$log"; exit 1; }

# Once more disaggregated: the router over two --role prefill and two --role decode workers, every prompt with a
# whole block prefilled on a prefill worker (--max-local-prefill-tokens 0) and its KV moved to the decode worker.
kill "$worker0" "$worker1" "$router"; wait "$worker0" "$worker1" "$router" 2>/dev/null || true
P0=$((PORT + 30)); D0=$((PORT + 32)); PDROUTER=$((PORT + 34))
for i in 0 1; do
  "$BUILD/apps/deepinfer" serve --model-path models/demo --device cpu --host 127.0.0.1 --port $((P0 + i)) \
    --role prefill --kv-transfer-port $((PORT + 40 + i)) --kv-events-endpoint "tcp://127.0.0.1:$((PORT + 50 + 2 * i))" \
    --kv-events-replay-endpoint "tcp://127.0.0.1:$((PORT + 51 + 2 * i))" >>"$log" 2>&1 &
  eval "prefill$i=\$!"
  "$BUILD/apps/deepinfer" serve --model-path models/demo --device cpu --host 127.0.0.1 --port $((D0 + i)) \
    --role decode --kv-events-endpoint "tcp://127.0.0.1:$((PORT + 60 + 2 * i))" \
    --kv-events-replay-endpoint "tcp://127.0.0.1:$((PORT + 61 + 2 * i))" >>"$log" 2>&1 &
  eval "decode$i=\$!"
done
"$BUILD/apps/deepinfer" router --prefill "http://127.0.0.1:$P0,http://127.0.0.1:$((P0 + 1))" \
  --decode "http://127.0.0.1:$D0,http://127.0.0.1:$((D0 + 1))" --model-path models/demo --max-local-prefill-tokens 0 \
  --host 127.0.0.1 --port "$PDROUTER" --health-check-interval-ms 200 >>"$log" 2>&1 &
pdrouter=$!
trap 'kill "$server" "$scripted31" "$scripted41" "$prefill0" "$prefill1" "$decode0" "$decode1" "$pdrouter" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$log" "$times"' EXIT
node -e '
  const url = process.argv[1];
  const deadline = Date.now() + 60000;
  (async () => {
    while (Date.now() < deadline) {
      try { const r = await fetch(url); if (r.ok && (await r.json()).healthy_workers === 4) process.exit(0); } catch {}
      await new Promise((r) => setTimeout(r, 250));
    }
    process.exit(1);
  })();' "http://127.0.0.1:$PDROUTER/health" || { echo "the router's four workers did not become healthy:"; tail -30 "$log"; exit 1; }
sleep 0.5  # the prefill workers' transfer ports, from /worker/info
DEEPINFER_URL="http://127.0.0.1:$PDROUTER" node --test --test-reporter=spec tests/sdk/ || { echo "--- log"; tail -50 "$log"; exit 1; }
received=0
for i in 0 1; do
  n=$(curl -s "http://127.0.0.1:$((D0 + i))/metrics" | awk '/^deepinfer_kv_transfer_blocks_total\{direction="received"\}/ {print $2}')
  received=$((received + ${n%.*}))
done
failed=$(curl -s "http://127.0.0.1:$D0/metrics" "http://127.0.0.1:$((D0 + 1))/metrics" | grep -c '^deepinfer_kv_transfer_failures_total' || true)
echo "disaggregated pass: the decode workers received $received KV blocks from the prefill workers; transfer failures: $failed"
[ "$received" -gt 0 ] && [ "$failed" = 0 ] || { echo "the disaggregated pass moved no KV (or a transfer failed)"; tail -30 "$log"; exit 1; }

# Last, one server with --tensor-parallel-size 2: two processes (rank 0 serves and starts rank 1), every layer's heads,
# intermediate and vocabulary split between them, partial sums all-reduced over Gloo on loopback.
kill "$prefill0" "$prefill1" "$decode0" "$decode1" "$pdrouter"; wait "$prefill0" "$prefill1" "$decode0" "$decode1" "$pdrouter" 2>/dev/null || true
TP=$((PORT + 70))
"$BUILD/apps/deepinfer" serve --model-path models/demo --device cpu --host 127.0.0.1 --port "$TP" \
  --tensor-parallel-size 2 >>"$log" 2>&1 &
tpserver=$!
trap 'kill "$server" "$scripted31" "$scripted41" "$tpserver" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$log" "$times"' EXIT
node -e 'const u = process.argv[1], end = Date.now() + 60000; (async () => { while (Date.now() < end) {
  try { if ((await fetch(u)).ok) process.exit(0); } catch {} await new Promise((r) => setTimeout(r, 250)); }
  process.exit(1); })();' "http://127.0.0.1:$TP/health" || { echo "the TP=2 server did not become healthy:"; tail -30 "$log"; exit 1; }
pgrep -f -- "--port $TP .*--internal-tp-rank 1" >/dev/null || { echo "the TP=2 server has no rank 1 process"; exit 1; }
DEEPINFER_URL="http://127.0.0.1:$TP" node --test --test-reporter=spec tests/sdk/ || { echo "--- log"; tail -50 "$log"; exit 1; }
echo "tensor-parallel pass: the SDK suite against --tensor-parallel-size 2"
