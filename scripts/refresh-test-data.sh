#!/usr/bin/env bash
# Copies the reference data the tests use from the shared folder beside the checkout into tests/data/.
# The files are produced by public references (HF tokenizers, official templates, DeepSeek's encoders).
set -euo pipefail
cd "$(dirname "$0")/.."
shared=${SHARED:-../shared}
install -D -m 644 "$shared/data/tokenizers/deepseek-v3/corpus.json" tests/data/tokenizer/corpus.json
install -D -m 644 "$shared/data/tokenizers/deepseek-v3/reference-ids.json" tests/data/tokenizer/reference-ids.json
for f in "$shared"/data/chat-templates/goldens/*.json; do
  install -D -m 644 "$f" "tests/data/chat-templates/goldens/$(basename "$f")"
done
install -D -m 644 "$shared/data/conversations/agent-session.json" tests/data/conversations/agent-session.json
