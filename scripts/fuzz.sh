#!/usr/bin/env bash
# Runs every libFuzzer target of build-fuzz/fuzz for SECONDS each (default 30), from its committed seeds in
# fuzz/seeds/<name>/ plus a scratch corpus, under ASan + UBSan. Prints one JSON line per target
# ({"target", "seconds", "execs", "execs_per_s", "corpus", "status"}) and fails on the first crash, leak or
# timeout, leaving the reproducer (crash-*, leak-*, timeout-*) in build-fuzz/fuzz-artifacts/.
#   scripts/fuzz.sh [SECONDS] [TARGET...]
set -uo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
shift || true
build=${BUILD_FUZZ:-build-fuzz}
targets=("$@")
if ((${#targets[@]} == 0)); then
  targets=(fuzz_http_framing fuzz_api_chat fuzz_api_completions fuzz_api_anthropic fuzz_api_responses
           fuzz_render_request fuzz_stream_parser fuzz_tokenizer_roundtrip fuzz_safetensors fuzz_safetensors_index
           fuzz_model_config fuzz_tokenizer_json fuzz_disk_block)
fi
artifacts=$build/fuzz-artifacts
mkdir -p "$artifacts"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
failed=0
for target in "${targets[@]}"; do
  name=${target#fuzz_}
  seeds=fuzz/seeds/$name
  [ "$target" = fuzz_render_request ] && seeds=fuzz/seeds/render_request
  corpus=$build/fuzz-corpus/$name
  mkdir -p "$corpus"
  log=$artifacts/$name.log
  max_len=65536
  [ "$target" = fuzz_http_framing ] && max_len=140000  # fields past Beast's 65,534-byte limit
  "$build/fuzz/$target" "$corpus" "$seeds" -max_total_time="$seconds" -timeout=60 -rss_limit_mb=3072 \
    -max_len=$max_len -print_final_stats=1 -artifact_prefix="$artifacts/$name-" >"$log" 2>&1
  rc=$?
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  units=$(ls "$corpus" | wc -l)
  status=ok
  if ((rc != 0)); then status=failed; failed=1; fi
  echo "{\"target\": \"$target\", \"seconds\": $seconds, \"execs\": ${execs:-0}, \"execs_per_s\": $(( ${execs:-0} / (seconds > 0 ? seconds : 1) )), \"corpus\": $units, \"status\": \"$status\"}"
  if ((rc != 0)); then
    echo "scripts/fuzz.sh: $target failed (exit $rc); its log: $log" >&2
    tail -40 "$log" >&2
  fi
done
exit $failed
