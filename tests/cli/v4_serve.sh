#!/usr/bin/env bash
# DeepSeek-V4 through `deepinfer serve` (on the CPU: the float32 reference path): a random-weight V4 checkpoint at demo size with
# the real vocabulary (`deepinfer random-model --architecture deepseek-v4`) is served with the deepseek-v4 chat
# format by default, with the prefix cache and a disk tier; a chat completion and a streamed one come back (random
# tokens: the numbers are checked against DeepSeek's own code in model_tests/engine_e2e_tests, not here); greedy
# output is the same twice, the second time from the prefix cache; and what V4 does not run yet is refused at
# startup naming the flag (never accepted and ignored).
# Usage: v4_serve.sh DEEPINFER_BINARY TOKENIZER_DIR [DEVICE] (the demo model's tokenizer: DeepSeek-V3's with V4's
# tokens; DEVICE cpu (default) or cuda: the server's, the GPU stage's run; the fixture's generate checks stay on the CPU)
set -uo pipefail
bin=$1 tokenizer=$2 device=${3:-cpu}
dir=$(mktemp -d)
server=
cleanup() { [ -n "$server" ] && kill "$server" 2>/dev/null; wait 2>/dev/null; rm -rf "$dir"; }
trap cleanup EXIT
"$bin" random-model --architecture deepseek-v4 --tokenizer "$tokenizer" --out "$dir/v4" >/dev/null ||
  { echo "FAIL: random-model --architecture deepseek-v4"; exit 1; }
failures=0
# generate on the exactness fixture: DeepSeek's own code's 16 greedy tokens for its prompt 1.
fixture=$(dirname "$0")/../data/models/tiny-deepseek-v4-official
got=$("$bin" generate --device cpu --model "$fixture" --prompt-ids 531,311,304,64,540 --max-tokens 16 2>/dev/null)
if [ "$got" = "816,513,861,103,865,373,418,816,110,831,942,636,972,961,404,1013" ]; then
  echo "ok: generate on the V4 fixture gives the reference's 16 greedy tokens"
else
  echo "FAIL: generate on the V4 fixture: '$got'"; failures=$((failures + 1))
fi
# --bf16 keeps the weights in bf16 on the CPU: the fixture's are bf16 already, so the same 16 tokens.
got=$("$bin" generate --bf16 --device cpu --model "$fixture" --prompt-ids 531,311,304,64,540 --max-tokens 16 2>/dev/null)
if [ "$got" = "816,513,861,103,865,373,418,816,110,831,942,636,972,961,404,1013" ]; then
  echo "ok: generate --bf16 on the V4 fixture gives the reference's 16 greedy tokens"
else
  echo "FAIL: generate --bf16 on the V4 fixture: '$got'"; failures=$((failures + 1))
fi
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
expect_refused "--swa-bounded-replay reuses cached prefixes, but --no-prefix-caching" --swa-bounded-replay --no-prefix-caching
expect_refused "--role prefill: DeepSeek-V4" --role prefill
expect_refused "window rings of max_num_seqs (--max-num-seqs) 64" --kv-cache-memory 1MiB --max-num-seqs 64

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# Starts the server with the disk tier, logging to $1 (more flags after it), and waits for /health.
start_server() {
  local log=$1; shift
  "$bin" serve --device "$device" --model "$dir/v4" --port "$port" --tiered-kv-storage-path "$dir/kv" "$@" >"$log" 2>&1 &
  server=$!
  for _ in $(seq 1 120); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    kill -0 "$server" 2>/dev/null || break
    sleep 0.5
  done
}
start_server "$dir/log"
grep -q "deepseek_v4, chat format deepseek-v4" "$dir/log" || { echo "FAIL: no deepseek-v4 default format:"; cat "$dir/log"; exit 1; }
echo "ok: $(grep -F 'deepseek_v4, chat format' "$dir/log" | cut -c1-140)"
ask() {
  curl -s "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' -d "$1"
}
# A prompt of more than two 64-token blocks: the second request reuses them from the prefix cache.
text=$(printf 'the quick brown fox jumps over the lazy dog %.0s' $(seq 1 20))
body='{"model":"v4","messages":[{"role":"user","content":"'"$text"'"}],"max_tokens":8,"temperature":0}'
first=$(ask "$body") second=$(ask "$body")
python3 - "$first" "$second" <<'PY' || failures=$((failures + 1))
import json, sys
a, b = (json.loads(x) for x in sys.argv[1:3])
assert a["choices"][0]["finish_reason"] == "length", a
assert a["usage"]["completion_tokens"] == 8, a
assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"], (a, b)
assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, a
cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
assert cached >= 128 and cached % 64 == 0, b
print("ok: greedy chat completion, 8 tokens, the same twice, the second with", cached, "of",
      b["usage"]["prompt_tokens"], "prompt tokens from the prefix cache:", repr(a["choices"][0]["message"]["content"])[:50])
PY
stream=$(ask '{"model":"v4","messages":[{"role":"user","content":"Hi"}],"max_tokens":5,"stream":true,"temperature":0.8,"seed":7}')
if grep -q '"finish_reason":"length"' <<<"$stream" && grep -q 'data: \[DONE\]' <<<"$stream"; then
  echo "ok: streamed completion ends with finish_reason length and [DONE]"
else
  echo "FAIL: stream:"; echo "$stream" | tail -3; failures=$((failures + 1))
fi
# A seeded sampled request with logprobs, twice: the same tokens and logprobs (on CUDA drawn where the logits are).
sampled='{"model":"v4","messages":[{"role":"user","content":"Hi there"}],"max_tokens":6,"temperature":0.9,"top_p":0.9,"seed":11,"logprobs":true,"top_logprobs":3}'
s1=$(ask "$sampled") s2=$(ask "$sampled")
python3 - "$s1" "$s2" <<'PY' || failures=$((failures + 1))
import json, sys
a, b = (json.loads(x) for x in sys.argv[1:3])
assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"], (a, b)
lp = a["choices"][0]["logprobs"]["content"]
assert len(lp) == a["usage"]["completion_tokens"] == 6, a
assert all(len(t["top_logprobs"]) == 3 and t["logprob"] <= 0 for t in lp), lp
assert [t["logprob"] for t in lp] == [t["logprob"] for t in b["choices"][0]["logprobs"]["content"]], (a, b)
print("ok: a seeded sampled request with 3 logprobs per token, the same twice:", repr(a["choices"][0]["message"]["content"])[:40])
PY
# A prompt of more than three windows (~400 tokens), answered before the restart: after it, its window rows (device
# only) are gone.
long_text=$(printf 'a slow green turtle walks under the tall old tree %.0s' $(seq 1 40))
long_body='{"model":"v4","messages":[{"role":"user","content":"'"$long_text"'"}],"max_tokens":8,"temperature":0}'
long_first=$(ask "$long_body")
# A restart keeps the disk tier: the same prompt after SIGTERM and a new server comes from disk.
kill -TERM "$server"; wait "$server" 2>/dev/null
start_server "$dir/log2"
third=$(ask "$body")
python3 - "$first" "$third" <<'PY' || failures=$((failures + 1))
import json, sys
a, c = (json.loads(x) for x in sys.argv[1:3])
assert a["choices"][0]["message"]["content"] == c["choices"][0]["message"]["content"], (a, c)
cached = c["usage"]["prompt_tokens_details"]["cached_tokens"]
# Its 2 cached blocks are one window whose rows did not survive the restart: fed again from position 0, exactly,
# and not counted as cached.
assert cached == 0, c
print("ok: after a restart the same answer (its one cached window without rows fed again: 0 cached tokens)")
PY
# The long prompt after the restart: its blocks come from the disk tier without window rows; bounded replay (the
# default) recomputes its last 128 tokens only (an approximation: the answer is not compared).
long_second=$(ask "$long_body")
replayed=$(curl -s "http://127.0.0.1:$port/metrics" | awk '/^deepinfer_swa_replayed_tokens_total/ {print $2}')
python3 - "$long_second" "$replayed" <<'PY' || failures=$((failures + 1))
import json, sys
b = json.loads(sys.argv[1])
cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
assert b["usage"]["completion_tokens"] == 8, b
# Every whole block but the last came from the disk tier; the last window's 128 tokens were replayed.
assert cached >= 192 and cached == (b["usage"]["prompt_tokens"] - 1) // 64 * 64 - 128, b
# 128 for the 185-token prompt above (its 2 cached blocks, one window: fed again from 0) + 128 replayed here.
assert sys.argv[2] == "256", f"deepinfer_swa_replayed_tokens_total {sys.argv[2]!r}, expected 128 + 128"
print("ok: bounded replay after the restart:", cached + 128, "of", b["usage"]["prompt_tokens"], "prompt tokens from the disk tier, 128 of them replayed")
PY
# Without bounded replay the prefix is recomputed from position 0 (no window rows anywhere): the exact answer.
kill -TERM "$server"; wait "$server" 2>/dev/null
start_server "$dir/log3" --no-swa-bounded-replay
long_third=$(ask "$long_body")
python3 - "$long_first" "$long_third" <<'PY' || failures=$((failures + 1))
import json, sys
a, c = (json.loads(x) for x in sys.argv[1:3])
assert a["choices"][0]["message"]["content"] == c["choices"][0]["message"]["content"], (a, c)
assert c["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, c
print("ok: --no-swa-bounded-replay after a restart: 0 cached tokens, the exact answer again")
PY
exit $((failures > 0))
