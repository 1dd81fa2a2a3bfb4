"""Proves that tools/demo_model.py computes what Hugging Face transformers' DeepseekV3 computes: loads the
fixtures tests/data/models/tiny-deepseek-v3{,-fp8} into it (float64 on the CPU) and compares its logits with
the fixtures' reference.safetensors (transformers 5.17, float64): relative error <= 1e-4 at every stored
position and identical argmax, as tests/unit/model_exactness_test.cpp asks of the engine.

The MTP layer has no external reference (transformers does not run MTP layers); the check runs it once to
prove the fixture's MTP weights load into it with the release names.

  /usr/bin/python3 tools/check_demo_model_arch.py   (Debian's python3-torch 1.13 and python3-numpy suffice)
"""
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo_model  # noqa: E402
import safetensors_io  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def check(fixture):
    d = os.path.join(ROOT, "tests/data/models", fixture)
    config = json.load(open(os.path.join(d, "config.json")))
    model = demo_model.DeepSeekV3(config).double().eval()
    weights = safetensors_io.read_f32(os.path.join(d, "model.safetensors"))
    model.load_checkpoint_state({k: torch.from_numpy(np.array(v, dtype=np.float64)) for k, v in weights.items()})
    for layer in list(model.layers) + list(model.mtp):
        if isinstance(layer.mlp, demo_model.Moe):
            layer.mlp.gate.e_score_correction_bias = layer.mlp.gate.e_score_correction_bias.double()
    _, ref = safetensors_io.read_raw(os.path.join(d, "reference.safetensors"))
    worst = 0.0
    ok = True
    i = 0
    while "prompt_%d.input_ids" % i in ref:
        ids = torch.from_numpy(ref["prompt_%d.input_ids" % i][2].astype(np.int64))[None]
        positions = ref["prompt_%d.positions" % i][2].astype(np.int64)
        expected = ref["prompt_%d.logits" % i][2].astype(np.float64)
        with torch.no_grad():
            h = model.hidden(ids)
            logits = model.lm_head(h)[0].numpy()[positions]
            if len(model.mtp) and ids.shape[1] > 1:
                mtp = model.lm_head(model.mtp_hidden(h[:, :-1], ids[:, 1:]))
                assert torch.isfinite(mtp).all()
        error = np.linalg.norm(logits - expected) / np.linalg.norm(expected)
        agree = int((logits.argmax(-1) == expected.argmax(-1)).sum())
        print("%s prompt_%d (%d tokens): relative error %.3g, argmax %d/%d" % (
            fixture, i, ids.shape[1], error, agree, len(positions)))
        ok = ok and error <= 1e-4 and agree == len(positions)
        worst = max(worst, error)
        i += 1
    return ok, worst


def main():
    results = [check(f) for f in ("tiny-deepseek-v3", "tiny-deepseek-v3-fp8")]
    ok = all(r[0] for r in results)
    print("PASS" if ok else "FAIL", "worst relative error %.3g" % max(r[1] for r in results))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
