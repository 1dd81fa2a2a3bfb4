"""Minimal safetensors reader/writer (stdlib + numpy): an 8-byte little-endian header length, a JSON header
{name: {dtype, shape, data_offsets}}, then the raw little-endian data. Used where the `safetensors` package is
absent (Debian's python) and by the demo model's tools, so that written files are byte-for-byte deterministic
(sorted names, 8-byte aligned header, as the safetensors package writes)."""
import json
import struct

import numpy as np

_NUMPY = {"F32": np.float32, "F64": np.float64, "I32": np.int32, "I64": np.int64, "U8": np.uint8,
          "BF16": np.uint16, "F16": np.float16, "F8_E4M3": np.uint8, "U16": np.uint16, "U32": np.uint32}


def read_raw(path):
    """-> (metadata dict, {name: (dtype string, shape list, numpy array of the raw element type)})."""
    with open(path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8: 8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        arr = np.frombuffer(blob, dtype=_NUMPY[info["dtype"]], count=(end - begin) // np.dtype(_NUMPY[info["dtype"]]).itemsize,
                            offset=base + begin)
        out[name] = (info["dtype"], info["shape"], arr.reshape(info["shape"]))
    return meta, out


def bf16_to_f32(raw_u16):
    return (raw_u16.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values):
    """Round to nearest even, as torch's .to(torch.bfloat16) (finite inputs)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).astype(np.uint16)


def e4m3_to_f32(raw_u8):
    b = raw_u8.astype(np.int32)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = b & 0x7
    value = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    value = np.where((exp == 0xF) & (man == 0x7), np.nan, value)
    return (sign * value).astype(np.float32)


def read_f32(path, block=(128, 128)):
    """-> {name: float32 numpy array}, FP8 weights dequantized with their `_scale_inv` blocks."""
    meta, raw = read_raw(path)
    out = {}
    for name, (dtype, shape, arr) in raw.items():
        if name.endswith("_scale_inv"):
            continue
        if dtype == "BF16":
            out[name] = bf16_to_f32(arr)
        elif dtype == "F8_E4M3":
            scale = raw[name + "_scale_inv"][2].astype(np.float32)
            if raw[name + "_scale_inv"][0] == "BF16":
                scale = bf16_to_f32(raw[name + "_scale_inv"][2])
            full = np.repeat(np.repeat(scale, block[0], axis=0), block[1], axis=1)[: shape[0], : shape[1]]
            out[name] = e4m3_to_f32(arr) * full
        else:
            out[name] = arr.astype(np.float32) if arr.dtype.kind == "f" else arr
    return out


def write(path, tensors, metadata=None):
    """tensors: {name: (dtype string, shape, bytes-like)} written in sorted name order."""
    header = {}
    offset = 0
    names = sorted(tensors)
    for name in names:
        dtype, shape, data = tensors[name]
        size = len(data)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in names:
            f.write(tensors[name][2])
