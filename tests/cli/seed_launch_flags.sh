#!/usr/bin/env bash
# The seed's launch scripts run as written (ports and paths changed): every flag in them is accepted by
# `deepinfer serve`, and each is honoured or refused at startup with a message naming what this build or machine
# lacks (never accepted and ignored). Today the seed's prefill and decode command lines stop at what they and the demo
# model lack (a rendezvous for eight hosts; heads that split eight ways); each refusable flag is also checked on its
# own, and the same lines with those flags at what this build and machine have (ucx and tcp, one device) serve.
# Usage: seed_launch_flags.sh DEEPINFER_BINARY MODEL_DIR (the demo model)
set -uo pipefail
bin=$1 model=$2
tier=$(mktemp -d)
trap 'rm -rf "$tier"' EXIT
failures=0
expect_refused() {
  local want=$1; shift
  local out
  if out=$(timeout 30 "$bin" serve --device cpu "$@" 2>&1); then
    echo "FAIL: accepted: serve $*"; failures=$((failures + 1)); return
  fi
  if grep -q "The following argument was not expected\|unrecognized\|not expected" <<<"$out"; then
    echo "FAIL: a flag is unknown: serve $*"; echo "$out" | tail -3; failures=$((failures + 1)); return
  fi
  if ! grep -qF -- "$want" <<<"$out"; then
    echo "FAIL: serve $* -> no '$want' in:"; echo "$out" | tail -3; failures=$((failures + 1)); return
  fi
  echo "ok: $(grep -F -- "$want" <<<"$out" | head -1 | cut -c1-200)"
}
# The seed's decode worker, as its script spells it (python -m ... server -> deepinfer serve; port, model and tier
# path changed).
decode=(--model-path "$model" --role decode --host 127.0.0.1 --port 0 --cluster-nodes 8 --tensor-parallel-size 8
        --expert-parallel-size 8 --max-model-len 131072 --max-num-seqs 128 --gpu-memory-utilization 0.92
        --dspark-enable --dspark-confidence-threshold 0.85 --dspark-max-draft-tokens 6 --swa-bounded-replay
        --kv-cache-ttl-hours 72 --tiered-kv-storage-path "$tier")
prefill=(--model-path "$model" --role prefill --host 127.0.0.1 --port 0 --cluster-nodes 8 --tensor-parallel-size 8
         --pipeline-parallel-size 1 --expert-parallel-size 8 --max-model-len 131072 --max-num-seqs 64
         --gpu-memory-utilization 0.90 --kv-transfer-protocol rdma --rdma-device-names mlx5_0,mlx5_1
         --kv-transfer-timeout-ms 30000 --swa-bounded-replay --kv-cache-ttl-hours 72 --tiered-kv-storage-path "$tier")
# As written they name no rendezvous for their 8 hosts; given one, the demo model's 4 heads do not split 8 ways (tensor
# parallel itself runs with either role: tests/cluster/tp_serve_e2e.py).
expect_refused "--nnodes/--cluster-nodes 8 needs an explicit --master-port" "${decode[@]}"
expect_refused "--nnodes/--cluster-nodes 8 needs an explicit --master-port" "${prefill[@]}"
expect_refused "--tensor-parallel-size 8 does not divide the model's num_attention_heads (4)" "${decode[@]}" --master-port 29555
expect_refused "--tensor-parallel-size 8 does not divide the model's num_attention_heads (4)" "${prefill[@]}" --master-port 29555
# Each refusable flag on its own.
expect_refused "--kv-transfer-protocol applies to --role prefill / decode" --model-path "$model" --kv-transfer-protocol tcp
if [ -z "$(ls -A /sys/class/infiniband 2>/dev/null)" ]; then
  expect_refused "--kv-transfer-protocol rdma: this machine has no RDMA device" --model-path "$model" --role prefill --kv-transfer-protocol rdma --rdma-device-names mlx5_0:1 --kv-transfer-port 0
fi
expect_refused "--kv-transfer-port applies to --role prefill" --model-path "$model" --role decode --kv-transfer-port 9000
expect_refused "--role decode needs the prefix cache" --model-path "$model" --role decode --no-prefix-caching
expect_refused "--kv-transfer-timeout-ms must be at least 1" --model-path "$model" --role prefill --kv-transfer-timeout-ms 0
expect_refused "--kv-transfer-protocol carrier-pigeon: one of tcp, ucx, rdma" --model-path "$model" --kv-transfer-protocol carrier-pigeon
expect_refused "--rdma-device-names applies to --kv-transfer-protocol rdma" --model-path "$model" --rdma-device-names mlx5_0
expect_refused "--kv-transfer-timeout-ms applies to --role prefill / decode" --model-path "$model" --kv-transfer-timeout-ms 1000
expect_refused "--kv-transfer-deadline-ms applies to --role decode" --model-path "$model" --role prefill --kv-transfer-deadline-ms 1000
expect_refused "--kv-transfer-deadline-ms must be at least 1" --model-path "$model" --role decode --kv-transfer-deadline-ms 0
expect_refused "--tensor-parallel-size 8 does not divide the model's num_attention_heads" --model-path "$model" --tensor-parallel-size 8
expect_refused "--pipeline-parallel-size 2: this build splits a model over devices by tensor and expert parallel" --model-path "$model" --pipeline-parallel-size 2
expect_refused "--expert-parallel-size 8 with --tensor-parallel-size 1: the experts spread over the tensor-parallel ranks" --model-path "$model" --expert-parallel-size 8
expect_refused "--enable-eplb needs expert parallel" --model-path "$model" --enable-eplb
# A break-it pass (2026-12-07): an empty disk path ran without a disk tier, an infinite TTL overflowed its clock.
expect_refused "--tiered-kv-storage-path: must not be empty" --model-path "$model" --tiered-kv-storage-path ""
expect_refused "--kv-cache-ttl-hours must be positive and at most 87600" --model-path "$model" --kv-cache-ttl-hours inf
expect_refused "--kv-cache-ttl-hours must be positive and at most 87600" --model-path "$model" --kv-cache-ttl-hours 1e300
expect_refused "--num-redundant-experts needs expert parallel" --model-path "$model" --num-redundant-experts 2
expect_refused "--nnodes/--cluster-nodes 8: the hosts hold the --tensor-parallel-size 1 ranks evenly" --model-path "$model" --cluster-nodes 8
expect_refused "--nnodes 0: must be at least 1" --model-path "$model" --cluster-nodes 0
expect_refused "--gpu-memory-utilization: the cpu backend has no device memory" --model-path "$model" --gpu-memory-utilization 0.9
expect_refused "--gpu-memory-utilization 1.5: a fraction in (0, 1]" --model-path "$model" --gpu-memory-utilization 1.5
expect_refused "--gpu-memory-utilization and --kv-cache-memory both size the KV cache" --model-path "$model" --gpu-memory-utilization 0.5 --kv-cache-memory 1GiB
expect_refused "--swa-bounded-replay: deepseek_v3 has no sliding-window attention layers" --model-path "$model" --swa-bounded-replay
# An empty value (a deployment script's unset variable) is refused, never taken as "not given" (a user's findings).
expect_refused "--kv-transfer-timeout-ms needs a value" --model-path "$model" --kv-transfer-timeout-ms ""
expect_refused "--gpu-memory-utilization needs a value" --model-path "$model" --gpu-memory-utilization "" --kv-cache-memory 2GiB
expect_refused "--cluster-nodes needs a value" --model-path "$model" --cluster-nodes ""
expect_refused "--gpu-memory-utilization 0: a fraction in (0, 1]" --model-path "$model" --gpu-memory-utilization 0
# Limits that cannot hold (a breaker's findings): 0 was taken as "the default", and a max_model_len larger than the
# KV cache was accepted, its long requests failing after they had generated.
expect_refused "--max-model-len: must be a whole number from 2 to" --model-path "$model" --max-model-len 0
expect_refused "--max-model-len: must be a whole number from 2 to" --model-path "$model" --max-model-len 0x10
expect_refused "max_model_len (--max-model-len) 2048 does not fit the KV cache: kv_cache_bytes (--kv-cache-memory) 1048576 holds 10 blocks = 640 tokens" --model-path "$model" --max-model-len 2048 --kv-cache-memory 1MiB
expect_refused "--max-num-batched-tokens: must be a whole number from 1 to 2147483647, got '0'" --model-path "$model" --max-num-batched-tokens 0
expect_refused "--max-num-seqs: must be a whole number from 1 to 2147483647, got '99999999999999999999'" --model-path "$model" --max-num-seqs 99999999999999999999
expect_refused "--health-max-step-seconds: must be a whole number from 0 to 86400, got 'abc'" --model-path "$model" --health-max-step-seconds abc
expect_refused "--shutdown-timeout-s: must be a whole number from 0 to 86400, got '-1'" --model-path "$model" --shutdown-timeout-s -1
# The flags that are 1 (or both) are honoured: a server with all of them answers /health.
log=$(mktemp)
"$bin" serve --device cpu --host 127.0.0.1 --port 0 --model-path "$model" --role both --tensor-parallel-size 1 \
  --pipeline-parallel-size 1 --expert-parallel-size 1 --cluster-nodes 1 --max-model-len 02000 --max-num-seqs 08 \
  --kv-cache-ttl-hours 72 --tiered-kv-storage-path "$tier" >"$log" 2>&1 &
server=$!
port=""
for _ in $(seq 1 600); do
  port=$(grep -oE ' on http://127\.0\.0\.1:[0-9]+' "$log" | grep -oE '[0-9]+$' | head -1)
  [ -n "$port" ] && break
  kill -0 $server 2>/dev/null || break
  sleep 0.1
done
# (02000 and 08 are decimal: CLI11 alone read a leading 0 as octal, so 010 meant 8 and 08 was refused.)
if [ -n "$port" ] && curl -sf "http://127.0.0.1:$port/health" >/dev/null &&
   curl -sf "http://127.0.0.1:$port/v1/models" | grep -q '"max_model_len":2000'; then
  echo "ok: --role both with every size 1 serves (port $port), --max-model-len 02000 read as 2000"
else
  echo "FAIL: the --role both server did not come up:"; tail -5 "$log"; failures=$((failures + 1))
fi
kill $server 2>/dev/null; wait $server 2>/dev/null
rm -f "$log"
# The seed's prefill and decode lines with what this build has in place of what it lacks (ucx for rdma, one device,
# no GPU memory fraction on the CPU, no sliding-window replay for a V3-architecture model): both serve in their role.
kvport=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
decode_here=(--model-path "$model" --role decode --host 127.0.0.1 --port 0 --cluster-nodes 1 --tensor-parallel-size 1
             --expert-parallel-size 1 --max-model-len 2048 --max-num-seqs 16 --dspark-enable
             --dspark-confidence-threshold 0.85 --dspark-max-draft-tokens 6 --kv-cache-ttl-hours 72
             --tiered-kv-storage-path "$tier/decode")
prefill_here=(--model-path "$model" --role prefill --host 127.0.0.1 --port 0 --cluster-nodes 1 --tensor-parallel-size 1
              --pipeline-parallel-size 1 --expert-parallel-size 1 --max-model-len 2048 --max-num-seqs 8
              --kv-transfer-protocol ucx --kv-transfer-port "$kvport" --kv-transfer-timeout-ms 30000
              --kv-cache-ttl-hours 72 --tiered-kv-storage-path "$tier/prefill")
for role in decode prefill; do
  log=$(mktemp)
  if [ $role = decode ]; then args=("${decode_here[@]}"); else args=("${prefill_here[@]}"); fi
  "$bin" serve --device cpu "${args[@]}" >"$log" 2>&1 &
  server=$!
  port=""
  for _ in $(seq 1 600); do
    port=$(grep -oE ' on http://127\.0\.0\.1:[0-9]+' "$log" | grep -oE '[0-9]+$' | head -1)
    [ -n "$port" ] && break
    kill -0 $server 2>/dev/null || break
    sleep 0.1
  done
  if [ -n "$port" ] && curl -sf "http://127.0.0.1:$port/worker/info" | grep -q "\"role\":\"$role\""; then
    echo "ok: the seed's $role line (ucx, one device) serves as --role $role (port $port)"
  else
    echo "FAIL: the seed's $role line did not come up as --role $role:"; tail -5 "$log"; failures=$((failures + 1))
  fi
  kill $server 2>/dev/null; wait $server 2>/dev/null
  rm -f "$log"
done
exit $((failures > 0))
