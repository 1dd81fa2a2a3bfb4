#!/usr/bin/env bash
# Starts `deepinfer serve` on the built-in default model on a loopback port, runs the official openai and
# @anthropic-ai/sdk clients' tests against it (node --test), and stops the server. Used by `make test`.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
PORT=${DEEPINFER_TEST_PORT:-18123}
[ -f models/default/model.safetensors ] || "$BUILD/apps/deepinfer" default-model --out models/default
(cd tests/sdk && npm ci --silent --no-audit --no-fund)
log=$(mktemp)
"$BUILD/apps/deepinfer" serve --model-path models/default --host 127.0.0.1 --port "$PORT" >"$log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; rm -f "$log"' EXIT
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
DEEPINFER_URL="http://127.0.0.1:$PORT" node --test --test-reporter=spec tests/sdk/ || { echo "--- server log"; tail -50 "$log"; exit 1; }
