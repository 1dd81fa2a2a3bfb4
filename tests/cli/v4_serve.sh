#!/usr/bin/env bash
# DeepSeek-V4 through `deepinfer serve` (the CPU reference path): a random-weight V4 checkpoint at demo size with
# the real vocabulary (`deepinfer random-model --architecture deepseek-v4`) is served with the deepseek-v4 chat
# format by default; a chat completion and a streamed one come back (random tokens: the numbers are checked
# against DeepSeek's own code in model_tests/engine_e2e_tests, not here); greedy output is the same twice; and what
# V4 does not run yet is refused at startup naming the flag (never accepted and ignored).
# Usage: v4_serve.sh DEEPINFER_BINARY TOKENIZER_DIR (the demo model's: DeepSeek-V3's tokenizer with V4's tokens)
set -uo pipefail
bin=$1 tokenizer=$2
dir=$(mktemp -d)
server=
cleanup() { [ -n "$server" ] && kill "$server" 2>/dev/null; wait 2>/dev/null; rm -rf "$dir"; }
trap cleanup EXIT
"$bin" random-model --architecture deepseek-v4 --tokenizer "$tokenizer" --out "$dir/v4" >/dev/null ||
  { echo "FAIL: random-model --architecture deepseek-v4"; exit 1; }
failures=0
expect_refused() {
  local want=$1; shift
  local out
  if out=$(timeout 60 "$bin" serve --port 0 --model "$dir/v4" "$@" 2>&1); then
    echo "FAIL: accepted: serve $*"; failures=$((failures + 1)); return
  fi
  if ! grep -qF -- "$want" <<<"$out"; then
    echo "FAIL: serve $* -> no '$want' in:"; echo "$out" | tail -3; failures=$((failures + 1)); return
  fi
  echo "ok: serve $* -> $(grep -F -- "$want" <<<"$out" | head -1 | cut -c1-160)"
}
expect_refused "--tensor-parallel-size / --expert-parallel-size / --nnodes > 1: DeepSeek-V4" --tensor-parallel-size 2
expect_refused "--dspark-enable: DeepSeek-V4" --dspark-enable
expect_refused "--speculative-algorithm mtp: DeepSeek-V4" --speculative-algorithm mtp
expect_refused "the host/disk KV tiers" --tiered-kv-storage-path "$dir/kv"
expect_refused "--swa-bounded-replay (it needs V4's paged cache)" --swa-bounded-replay
expect_refused "--role prefill: DeepSeek-V4" --role prefill
expect_refused "--device cuda: DeepSeek-V4" --device cuda

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$bin" serve --device cpu --model "$dir/v4" --port "$port" >"$dir/log" 2>&1 &
server=$!
for _ in $(seq 1 120); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  kill -0 "$server" 2>/dev/null || break
  sleep 0.5
done
grep -q "deepseek_v4, chat format deepseek-v4" "$dir/log" || { echo "FAIL: no deepseek-v4 default format:"; cat "$dir/log"; exit 1; }
echo "ok: $(grep -F 'deepseek_v4, chat format' "$dir/log" | cut -c1-140)"
ask() {
  curl -s "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' -d "$1"
}
body='{"model":"v4","messages":[{"role":"user","content":"Hello, V4"}],"max_tokens":8,"temperature":0}'
first=$(ask "$body") second=$(ask "$body")
python3 - "$first" "$second" <<'PY' || failures=$((failures + 1))
import json, sys
a, b = (json.loads(x) for x in sys.argv[1:3])
assert a["choices"][0]["finish_reason"] == "length", a
assert a["usage"]["completion_tokens"] == 8, a
assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"], (a, b)
print("ok: greedy chat completion, 8 tokens, the same twice:", repr(a["choices"][0]["message"]["content"])[:60])
PY
stream=$(ask '{"model":"v4","messages":[{"role":"user","content":"Hi"}],"max_tokens":5,"stream":true,"temperature":0.8,"seed":7}')
if grep -q '"finish_reason":"length"' <<<"$stream" && grep -q 'data: \[DONE\]' <<<"$stream"; then
  echo "ok: streamed completion ends with finish_reason length and [DONE]"
else
  echo "FAIL: stream:"; echo "$stream" | tail -3; failures=$((failures + 1))
fi
exit $((failures > 0))
