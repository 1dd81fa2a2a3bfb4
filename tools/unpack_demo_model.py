"""Turns the packed demo model (assets/demo-model/: config.json + demo-model.xz.NN, written by
tools/train_demo_model.py) into checkpoint directories in the release layout, deterministically (same bytes
every run; Python stdlib only, so scripts/setup.sh can run it on a fresh machine):

  DIR/      config.json, model.safetensors (bf16; e_score_correction_bias float32), tokenizer files (V3's; with
            V4's added tokens, tools/make_v4_tokenizer.py, when config.json's chat_format is a V4 format)
  DIR-fp8/  the same with the linear layers in DeepSeek's block-scaled FP8 (float8_e4m3fn + 128x128
            weight_scale_inv) and quantization_config in config.json

The MTP layer's embed_tokens and shared_head.head are written as copies of model.embed_tokens and lm_head,
as DeepSeek's checkpoints store them (the model shares them, DeepSeek-V3 §2.2).

When --src also holds dspark-draft.xz and dspark-config.json (tools/train_dspark_draft.py), the DSpark draft
module is merged into both directories: the dspark_* keys into config.json, its mtp.* tensors (bf16 in both), and
its dspark.noise_embedding as row dspark_noise_token_id of model.embed_tokens.weight (and so of the MTP layer's
copy); that tensor itself is not written. Without those files the output is what it was before.

  python3 tools/unpack_demo_model.py --src assets/demo-model --tokenizer models/deepseek-v3 --out models/demo
"""
import argparse
import glob
import json
import lzma
import os
import shutil
import struct
import sys


def read_container(blob):
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8: 8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    return meta, {name: (info["dtype"], info["shape"], blob[base + info["data_offsets"][0]: base + info["data_offsets"][1]])
                  for name, info in header.items()}


def unplane(planes):
    """[high bytes][low bytes] -> little-endian bf16 pairs."""
    half = len(planes) // 2
    out = bytearray(len(planes))
    out[1::2] = planes[:half]
    out[0::2] = planes[half:]
    return bytes(out)


def write_safetensors(path, tensors):
    names = sorted(tensors)
    header, offset = {}, 0
    for name in names:
        dtype, shape, data = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    partial = path + ".partial"
    with open(partial, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in names:
            f.write(tensors[name][2])
    os.replace(partial, path)  # a killed setup never leaves a truncated checkpoint


def write_v4_tokenizer(source_dir, directory):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import make_v4_tokenizer
    tokenizer = json.load(open(os.path.join(source_dir, "tokenizer.json"), encoding="utf-8"))
    source_config = json.load(open(os.path.join(source_dir, "tokenizer_config.json"), encoding="utf-8"))
    for name, value, indent in (("tokenizer.json", make_v4_tokenizer.with_v4_tokens(tokenizer), None),
                                ("tokenizer_config.json", make_v4_tokenizer.config_for(source_config), 2)):
        with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
            json.dump(value, f, ensure_ascii=False, indent=indent)
            f.write("\n")


def merge_dspark(src, config, bf16):
    """Adds the DSpark draft module of SRC (if any) to config and bf16 (name -> (dtype, shape, bytes)).
    -> the number of tensors added (0: none there), None on an error."""
    draft_path, config_path = os.path.join(src, "dspark-draft.xz"), os.path.join(src, "dspark-config.json")
    if not os.path.exists(draft_path) and not os.path.exists(config_path):
        return 0
    if not (os.path.exists(draft_path) and os.path.exists(config_path)):
        print("unpack_demo_model: %s needs both dspark-draft.xz and dspark-config.json" % src, file=sys.stderr)
        return None
    keys = json.load(open(config_path))
    meta, packed = read_container(lzma.decompress(open(draft_path, "rb").read()))
    if meta.get("layout") != "bf16-byte-planes":
        print("unpack_demo_model: dspark-draft.xz: unknown layout %r" % meta.get("layout"), file=sys.stderr)
        return None
    noise = packed.pop("dspark.noise_embedding", None)
    hidden, token = config["hidden_size"], keys.get("dspark_noise_token_id")
    if noise is None or noise[0] != "BF16" or noise[1] != [hidden] or not isinstance(token, int) or \
            not 0 <= token < config["vocab_size"]:
        print("unpack_demo_model: dspark-draft.xz needs dspark.noise_embedding [%d] (bf16) and dspark-config.json a "
              "dspark_noise_token_id below the vocabulary" % hidden, file=sys.stderr)
        return None
    for name, (dtype, shape, data) in packed.items():
        if not name.startswith("mtp.") or name in bf16 or dtype != "BF16":
            print("unpack_demo_model: dspark-draft.xz: unexpected tensor %s (%s)" % (name, dtype), file=sys.stderr)
            return None
        bf16[name] = (dtype, shape, unplane(data))
    name = "model.embed_tokens.weight"
    dtype, shape, data = bf16[name]
    row = hidden * 2  # bytes of one bf16 row
    bf16[name] = (dtype, shape, data[: token * row] + unplane(noise[2]) + data[(token + 1) * row:])
    config.update(keys)
    return len(packed)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default="assets/demo-model", help="config.json and demo-model.xz.NN")
    ap.add_argument("--tokenizer", default="models/deepseek-v3", help="directory with tokenizer.json")
    ap.add_argument("--out", default="models/demo")
    ap.add_argument("--fp8-out", default=None, help="default: OUT-fp8")
    args = ap.parse_args()
    fp8_out = args.fp8_out or args.out.rstrip("/") + "-fp8"
    parts = sorted(glob.glob(os.path.join(args.src, "demo-model.xz.[0-9][0-9]")))
    if not parts:
        print("unpack_demo_model: no %s/demo-model.xz.NN" % args.src, file=sys.stderr)
        return 1
    meta, packed = read_container(lzma.decompress(b"".join(open(p, "rb").read() for p in parts)))
    if meta.get("layout") != "bf16-byte-planes":
        print("unpack_demo_model: unknown layout %r" % meta.get("layout"), file=sys.stderr)
        return 1
    config = json.load(open(os.path.join(args.src, "config.json")))
    bf16 = {}
    fp8 = {}
    for name, (dtype, shape, data) in packed.items():
        if name.startswith("fp8."):
            fp8[name[4:]] = (dtype, shape, data)
        else:
            bf16[name] = (dtype, shape, unplane(data) if dtype == "BF16" else data)
    draft = merge_dspark(args.src, config, bf16)
    if draft is None:
        return 1
    if draft:
        print("unpack_demo_model: merging the DSpark draft module (%d tensors, dspark_* config keys)" % draft)
    for i in range(config.get("num_nextn_predict_layers", 0)):
        p = "model.layers.%d." % (config["num_hidden_layers"] + i)
        bf16[p + "embed_tokens.weight"] = bf16["model.embed_tokens.weight"]
        bf16[p + "shared_head.head.weight"] = bf16["lm_head.weight"]
    fp8_tensors = dict(bf16)
    fp8_tensors.update(fp8)
    fp8_config = dict(config, quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3",
                                                   "quant_method": "fp8", "weight_block_size": [128, 128]})
    for directory, tensors, cfg in ((args.out, bf16, config), (fp8_out, fp8_tensors, fp8_config)):
        os.makedirs(directory, exist_ok=True)
        if config.get("chat_format") in ("deepseek-v4", "deepseek-v4.1"):
            # A demo trained on a V4 format has V4's tokenizer: V3's plus the added tokens at their ids
            # (<think>, </think>, ｜DSML｜, <｜latest_reminder｜>; tools/make_v4_tokenizer.py).
            write_v4_tokenizer(args.tokenizer, directory)
        else:
            for file in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copyfile(os.path.join(args.tokenizer, file), os.path.join(directory, file))
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")
        write_safetensors(os.path.join(directory, "model.safetensors"), tensors)
        print("unpack_demo_model: wrote %s (%d tensors)" % (directory, len(tensors)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
