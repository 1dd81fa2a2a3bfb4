#!/usr/bin/env bash
# The speculative-decoding flags of `deepinfer serve` are honoured or refused at startup with a message naming the
# flag (never accepted and ignored): DSpark's knobs without --dspark-enable, out-of-range values, MTP and DSpark
# together, a checkpoint without MTP layers. Each case must exit non-zero before any weight loads.
# Usage: speculative_flags.sh DEEPINFER_BINARY MODEL_DIR (a checkpoint with an MTP layer: the demo model)
set -uo pipefail
bin=$1 model=$2
# The same config.json without next-n layers (the checks run before any weight or tokenizer loads).
no_mtp=$(mktemp -d)
trap 'rm -rf "$no_mtp"' EXIT
sed 's/"num_nextn_predict_layers": *[0-9]*/"num_nextn_predict_layers": 0/' "$model/config.json" >"$no_mtp/config.json"
grep -q '"num_nextn_predict_layers": 0' "$no_mtp/config.json" || { echo "FAIL: could not write the no-MTP config"; exit 1; }
failures=0
expect_refused() {
  local want=$1; shift
  local out
  if out=$(timeout 30 "$bin" serve --device cpu --port 0 "$@" 2>&1); then
    echo "FAIL: accepted: serve $*"; failures=$((failures + 1)); return
  fi
  if ! grep -qF -- "$want" <<<"$out"; then
    echo "FAIL: serve $* -> no '$want' in:"; echo "$out" | tail -3; failures=$((failures + 1)); return
  fi
  echo "ok: serve $* -> $(grep -F -- "$want" <<<"$out" | head -1 | cut -c1-160)"
}
expect_refused "--dspark-confidence-threshold needs --dspark-enable" --model-path "$model" --dspark-confidence-threshold 0.5
expect_refused "--dspark-max-draft-tokens needs --dspark-enable" --model-path "$model" --dspark-max-draft-tokens 3
expect_refused "--dspark-abort-on-rollback-rate needs --dspark-enable" --model-path "$model" --dspark-abort-on-rollback-rate 0.5
expect_refused "--dspark-step-time-table needs --dspark-enable" --model-path "$model" --dspark-step-time-table const
expect_refused "--dspark-confidence-threshold must be in [0, 1]" --model-path "$model" --dspark-enable --dspark-confidence-threshold 1.5
expect_refused "--dspark-abort-on-rollback-rate must be in (0, 1]" --model-path "$model" --dspark-enable --dspark-abort-on-rollback-rate 0
expect_refused "--dspark-max-draft-tokens must be in [1, 16]" --model-path "$model" --dspark-enable --dspark-max-draft-tokens 17
expect_refused "--speculative-num-draft-tokens does not apply with --dspark-enable" --model-path "$model" --dspark-enable --speculative-num-draft-tokens 2
expect_refused "choose one" --model-path "$model" --dspark-enable --speculative-algorithm mtp
expect_refused "choose one" --model-path "$model" --dspark-enable --speculative-algorithm none
expect_refused "--speculative-algorithm must be mtp or dspark" --model-path "$model" --speculative-algorithm eagle
expect_refused "num_nextn_predict_layers 0" --model-path "$no_mtp" --dspark-enable
expect_refused "num_nextn_predict_layers 0" --model-path "$no_mtp" --speculative-algorithm mtp
# A checkpoint that ships a DSpark draft module: refused rather than served with its MTP layer silently.
mkdir -p "$no_mtp/dspark"
sed 's/"num_nextn_predict_layers"/"dspark_block_size": 5, "num_nextn_predict_layers"/' "$model/config.json" >"$no_mtp/dspark/config.json"
expect_refused "ships a DSpark draft module" --model-path "$no_mtp/dspark" --dspark-enable
exit $((failures > 0))
