#!/usr/bin/env bash
# The speculative-decoding flags of `deepinfer serve` are honoured or refused at startup with a message naming the
# flag (never accepted and ignored): DSpark's knobs without --dspark-enable, out-of-range values, MTP and DSpark
# together, a checkpoint without MTP layers or DSpark draft module, a broken module config, empty values. Each case
# must exit non-zero before any weight loads, except a step-time table path that is not a regular file (checked after).
# Usage: speculative_flags.sh DEEPINFER_BINARY MODEL_DIR (a checkpoint with an MTP layer: the demo model)
set -uo pipefail
bin=$1 model=$2
# The same config.json without next-n layers (the checks run before any weight or tokenizer loads).
no_mtp=$(mktemp -d)
trap 'rm -rf "$no_mtp"' EXIT
# (and without a DSpark draft module), then two with a broken module config.
mkdir -p "$no_mtp/partial" "$no_mtp/moe"
python3 - "$model/config.json" "$no_mtp" <<'PY' || { echo "FAIL: could not write the configs"; exit 1; }
import json, sys
config = json.load(open(sys.argv[1]))
config = {k: v for k, v in config.items() if not k.startswith("dspark_")}
config["num_nextn_predict_layers"] = 0
json.dump(config, open(sys.argv[2] + "/config.json", "w"))
json.dump(dict(config, dspark_block_size=5), open(sys.argv[2] + "/partial/config.json", "w"))
json.dump(dict(config, dspark_target_layer_ids=[0], dspark_block_size=4, dspark_markov_rank=8,
               dspark_noise_token_id=5, dspark_n_routed_experts=8), open(sys.argv[2] + "/moe/config.json", "w"))
PY
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
expect_refused "--dspark-max-draft-tokens: must be a whole number from 1 to 16, got '17'" --model-path "$model" --dspark-enable --dspark-max-draft-tokens 17
expect_refused "--speculative-num-draft-tokens does not apply with --dspark-enable" --model-path "$model" --dspark-enable --speculative-num-draft-tokens 2
expect_refused "choose one" --model-path "$model" --dspark-enable --speculative-algorithm mtp
expect_refused "choose one" --model-path "$model" --dspark-enable --speculative-algorithm none
expect_refused "--speculative-algorithm must be mtp or dspark" --model-path "$model" --speculative-algorithm eagle
expect_refused "num_nextn_predict_layers 0" --model-path "$no_mtp" --dspark-enable
expect_refused "num_nextn_predict_layers 0" --model-path "$no_mtp" --speculative-algorithm mtp
# DSpark draft module keys: all of them or an error naming the missing one; MoE stages (V4's) refused.
expect_refused "missing required field 'dspark_target_layer_ids'" --model-path "$no_mtp/partial" --dspark-enable
expect_refused "dense stages" --model-path "$no_mtp/moe" --dspark-enable
# An empty value is refused, not taken as the flag not given (break-it, 2026-12-07: each of these ran on defaults).
expect_refused "--speculative-algorithm: must not be empty" --model-path "$model" --speculative-algorithm ""
expect_refused "--speculative-num-draft-tokens: must be a whole number from 1 to 16, got ''" --model-path "$model" --speculative-algorithm mtp --speculative-num-draft-tokens ""
expect_refused "--dspark-max-draft-tokens: must be a whole number from 1 to 16, got ''" --model-path "$model" --dspark-enable --dspark-max-draft-tokens ""
expect_refused "--dspark-confidence-threshold: must not be empty" --model-path "$model" --dspark-enable --dspark-confidence-threshold ""
expect_refused "--dspark-abort-on-rollback-rate: must not be empty" --model-path "$model" --dspark-enable --dspark-abort-on-rollback-rate ""
expect_refused "--dspark-step-time-table: must not be empty" --model-path "$model" --dspark-enable --dspark-step-time-table ""
# A step-time table path that is not a regular file is refused (after the weights load): /dev/null was replaced by
# the table written there, a FIFO blocked startup, /dev/zero was read until memory ran out.
mkfifo "$no_mtp/fifo"
expect_refused "--dspark-step-time-table /dev/null: not a regular file" --model-path "$model" --dspark-enable --dspark-step-time-table /dev/null
expect_refused "--dspark-step-time-table $no_mtp/fifo: not a regular file" --model-path "$model" --dspark-enable --dspark-step-time-table "$no_mtp/fifo"
expect_refused "--dspark-step-time-table $no_mtp: not a regular file" --model-path "$model" --dspark-enable --dspark-step-time-table "$no_mtp"
[ -c /dev/null ] || { echo "FAIL: /dev/null is no longer a character device"; failures=$((failures + 1)); }
exit $((failures > 0))
