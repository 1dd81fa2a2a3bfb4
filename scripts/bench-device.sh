#!/usr/bin/env bash
# One call on the GPU machine (its CPU): our recipe benchmark and the peer's (HF tokenizers + transformers'
# apply_chat_template, bench-peers/peer_recipe_bench.py) on the same machine, JSON results under $OUT; and a
# check that our ids for the agent session equal apply_chat_template(tokenize=True)'s.
#
# Here:   scripts/bench-device.sh prepare   (static bench binary + data into .device/, git-ignored)
# There:  bash scripts/bench-device.sh run   (with carry: [".device"])
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  prepare)
    cmake -S . -B build-static -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_EXE_LINKER_FLAGS=-static \
      -DBoost_USE_STATIC_LIBS=ON -DPCRE2_LIBRARY="$(dirname "$(gcc -print-file-name=libpcre2-8.a)")/libpcre2-8.a" >/dev/null
    cmake --build build-static --target bench_recipe deepinfer
    rm -rf .device && mkdir -p .device/shared/data/tokenizers .device/shared/data/conversations
    cp build-static/bench/bench_recipe build-static/apps/deepinfer scripts/check_agent_session_ids.py .device/
    cp -r models/deepseek-v3 .device/shared/data/tokenizers/deepseek-v3
    cp tests/data/tokenizer/corpus.json .device/shared/data/tokenizers/deepseek-v3/
    cp tests/data/conversations/agent-session.json .device/shared/data/conversations/
    cp "${SHARED:-../shared}/bench-peers/peer_recipe_bench.py" .device/
    grep -qx '/.device/' .git/info/exclude || echo '/.device/' >> .git/info/exclude
    du -sh .device
    ;;
  run)
    cd .device
    lscpu | grep -E "Model name|^CPU\(s\)" | tee "$OUT/cpu.txt"
    ./bench_recipe --tokenizer shared/data/tokenizers/deepseek-v3 --corpus shared/data/tokenizers/deepseek-v3/corpus.json \
      --conversation shared/data/conversations/agent-session.json --reps 10 | tee "$OUT/ours.jsonl"
    OUT="$OUT" PYTHONUNBUFFERED=1 python3 peer_recipe_bench.py
    ./deepinfer render --format deepseek-v3 --tokenizer shared/data/tokenizers/deepseek-v3 --ids \
      < shared/data/conversations/agent-session.json > "$OUT/ours_agent_ids.json"
    python3 check_agent_session_ids.py shared/data/tokenizers/deepseek-v3 shared/data/conversations/agent-session.json \
      "$OUT/ours_agent_ids.json" | tee "$OUT/check.jsonl"
    ;;
  *)
    echo "usage: $0 prepare|run" >&2
    exit 2
    ;;
esac
