#!/usr/bin/env bash
# The KV transfer's rates on loopback, both transports, beside their ceilings, in one run (JSON lines):
# bench_kv_transfer (the product's two sides in one process: TCP, and UCX with one worker serving both ends on its
# progress thread) and ucx_perftest's stream bandwidth between two processes (UCX's own ceiling here).
# Usage: bash bench/cluster/kv_transfer_rates.sh BUILD_DIR [BLOCK_BYTES]
set -u
build=${1:-build}
size=${2:-1990656}
"$build/bench/bench_kv_transfer" --blocks 64 --reps 3 --block-bytes "$size" --protocol both
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
ucx_perftest -t stream_bw -s "$size" -n 200 -p "$port" >/dev/null 2>&1 &
server=$!
sleep 0.5
line=$(timeout 60 ucx_perftest 127.0.0.1 -t stream_bw -s "$size" -n 200 -p "$port" 2>&1 | grep '^Final:')
wait $server 2>/dev/null
# Final: iterations, latency 50%/avg/overall (us), bandwidth average/overall (MB/s), message rate average/overall
mbps=$(awk '{print $7}' <<<"$line")
echo "{\"bench\": \"ucx_perftest\", \"test\": \"stream_bw\", \"block_bytes\": $size, \"processes\": 2, \"gb_per_s\": $(python3 -c "print(round(${mbps:-0} * 1048576 / 1e9, 3))")}"
