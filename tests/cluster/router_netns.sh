#!/usr/bin/env bash
# `deepinfer router` with its workers as separate hosts (issue 19, item 4): each worker in a network namespace of
# its own, reached over a veth pair at an address this test creates (10.231.N.2), its loopback down, binding its
# HTTP port and KV-event sockets to wildcards (tcp://*:5557), so that nothing silently relies on 127.0.0.1: the
# router must rewrite the wildcard endpoints to the worker's address to see its KV events.
# Checks: both workers healthy through the router; greedy identity through the router against a worker called
# directly at its address; a conversation's second turn routed by cache hit (KV events crossed the veth) and
# served from the worker's cache.
# Needs root and `ip netns` (CI's own sandbox has both); without them it exits 77 (CTest: skipped).
# Usage: router_netns.sh DEEPINFER_BINARY MODEL_DIR
set -uo pipefail
bin=$(realpath "$1")
model=$(realpath "$2")
tag=di$$
if [ "$(id -u)" != 0 ] || ! ip netns add "${tag}probe" 2>/dev/null; then
  echo "router_netns: needs root and ip netns: skipped"
  exit 77
fi
ip netns del "${tag}probe"
log=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null; done
  for i in 0 1; do
    ip netns del "${tag}w$i" 2>/dev/null
    ip link del "${tag}h$i" 2>/dev/null
  done
  rm -rf "$log"
}
trap cleanup EXIT
failures=0
check() {  # CONDITION-STATUS MESSAGE
  if [ "$1" = 0 ]; then echo "ok: $2"; else echo "FAIL: $2"; failures=$((failures + 1)); fi
}

for i in 0 1; do
  ns=${tag}w$i
  ip netns add "$ns"
  ip link add "${tag}h$i" type veth peer name "${tag}p$i"
  ip link set "${tag}p$i" netns "$ns"
  ip addr add "10.231.$i.1/24" dev "${tag}h$i"
  ip link set "${tag}h$i" up
  ip netns exec "$ns" ip addr add "10.231.$i.2/24" dev "${tag}p$i"
  ip netns exec "$ns" ip link set "${tag}p$i" up  # lo stays down: no 127.0.0.1 inside
  ip netns exec "$ns" "$bin" serve --device cpu --model-path "$model" --host 0.0.0.0 --port 8000 \
    --kv-events-endpoint 'tcp://*:5557' --kv-events-replay-endpoint 'tcp://*:5558' >"$log/worker$i.log" 2>&1 &
  pids+=($!)
done
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$bin" router --worker http://10.231.0.2:8000 --worker http://10.231.1.2:8000 --model-path "$model" \
  --host 127.0.0.1 --port "$port" --health-check-interval-ms 200 >"$log/router.log" 2>&1 &
pids+=($!)
router=http://127.0.0.1:$port

healthy=1
for _ in $(seq 1 300); do
  if curl -sf "$router/health" 2>/dev/null | grep -q '"healthy_workers":2'; then healthy=0; break; fi
  sleep 0.2
done
check $healthy "both workers, each in its own network namespace, healthy through the router"
sleep 1  # KV-event subscriptions settle

body='{"messages": [{"role": "user", "content": "What is a Debian package?"}], "max_tokens": 12, "temperature": 0}'
direct=$(curl -sf http://10.231.1.2:8000/v1/chat/completions -H 'Content-Type: application/json' -d "$body" |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"])')
routed=$(curl -sf "$router/v1/chat/completions" -H 'Content-Type: application/json' -d "$body" |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"])')
[ -n "$direct" ] && [ "$direct" = "$routed" ]
check $? "greedy identity: the router's answer equals a worker's own at 10.231.1.2 ('$routed')"

system=$(python3 -c 'print("You are the Debian documentation assistant. " * 40)')
turn() {
  curl -sf "$router/v1/chat/completions" -H 'Content-Type: application/json' \
    -d "{\"messages\": [{\"role\": \"system\", \"content\": \"$system\"}, {\"role\": \"user\", \"content\": \"$1\"}], \"max_tokens\": 4}" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["usage"]["prompt_tokens_details"]["cached_tokens"])'
}
turn "first question" >/dev/null
sleep 0.5
cached=$(turn "second question")
hits=$(curl -sf "$router/metrics" | grep '^deepinfer_router_requests_total{.*reason="cache_hit"}' | awk '{s += $2} END {print s + 0}')
events=$(curl -sf "$router/metrics" | grep '^deepinfer_router_kv_events_total' | awk '{s += $2} END {print s + 0}')
[ "${cached:-0}" -gt 0 ] && [ "${hits:-0}" -ge 1 ]
check $? "the second turn routed by cache hit ($hits) and served from cache ($cached tokens); $events KV event batches crossed the veths"

if [ "$failures" -gt 0 ]; then
  for f in router worker0 worker1; do echo "--- $f"; tail -20 "$log/$f.log"; done
  exit 1
fi
echo "router netns: all checks passed"
