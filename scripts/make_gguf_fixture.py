#!/usr/bin/env python3
"""GGUF fixtures for the reader in src/formats/gguf.rs.

Writes two tiny GGUF files with the `gguf` package (the writer llama.cpp's converters use), so the
reader is tested against files laid out the way real ones are, not against our own idea of the
format:

- fixture.gguf: metadata of every value type (each integer width, f32, f64, bool, strings,
  arrays of ints, floats, bools and strings, nested arrays) and tensors in F32, F16, BF16 and Q8_0,
  plus one Q4_0 tensor, a type the reader refuses to decode. The Q4_0 tensor is written last and
  its 288 bytes are a multiple of the alignment, so the file has no trailing padding: any
  truncation of it cuts into data the reader needs.
- aligned64.gguf: `general.alignment` = 64 and two small tensors, for a non-default alignment.

expected.json records, for each file, every metadata key with its GGUF type and value, and for
each tensor its ggml type, its shape in PyTorch order and the f32 bit patterns of its values as
gguf's own `gguf.quants.dequantize` gives them (bit patterns keep -0.0 and infinities exact).

    python scripts/make_gguf_fixture.py [OUT_DIR]      (default tests/fixtures/gguf)

Needs gguf==0.19.0 and numpy (the environment of ../shared/tools/golden-env.sh). Deterministic:
re-running rewrites identical files.
"""
import json
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q, GGUFValueType as V
from gguf.quants import dequantize, quantize

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "gguf")

TYPE_NAMES = {
    V.UINT8: "u8", V.INT8: "i8", V.UINT16: "u16", V.INT16: "i16", V.UINT32: "u32", V.INT32: "i32",
    V.FLOAT32: "f32", V.BOOL: "bool", V.STRING: "string", V.ARRAY: "array", V.UINT64: "u64",
    V.INT64: "i64", V.FLOAT64: "f64",
}


def as_json(value, vtype, sub_type=None):
    """The value as the Rust test spells it: {"type": ..., "value": ...}; arrays name their element
    type, "array[u8]", and nested arrays nest."""
    if vtype == V.ARRAY:
        elem = sub_type if sub_type is not None else (V.UINT8 if isinstance(value, bytes) else V.get_type(value[0]))
        items = [as_json(v, elem) for v in value]
        if elem == V.ARRAY:
            return {"type": "array[array]", "value": items}
        return {"type": f"array[{TYPE_NAMES[elem]}]", "value": [i["value"] for i in items]}
    if vtype == V.FLOAT32:
        value = float(np.float32(value))
    return {"type": TYPE_NAMES[vtype], "value": value}


def bits(a):
    return [int(b) for b in np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).ravel()]


class Fixture:
    def __init__(self, name, arch, alignment=None):
        self.path = os.path.join(OUT, name)
        self.w = gguf.GGUFWriter(self.path, arch)
        self.meta = {"general.architecture": as_json(arch, V.STRING)}
        self.tensors = {}
        if alignment is not None:
            self.w.add_custom_alignment(alignment)
            self.meta["general.alignment"] = as_json(alignment, V.UINT32)

    def kv(self, key, value, vtype, sub_type=None):
        self.w.add_key_value(key, value, vtype, sub_type=sub_type)
        self.meta[key] = as_json(value, vtype, sub_type)

    def tensor(self, name, data, qtype, expected):
        """`data` is what goes in the file (float arrays, or the uint8 bytes of a block type)."""
        raw_dtype = None if data.dtype in (np.float32, np.float16) else qtype
        self.w.add_tensor(name, data, raw_dtype=raw_dtype)
        self.tensors[name] = {"ggml_type": qtype.name, "shape": list(expected.shape), "bits": bits(expected)}

    def finish(self):
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()
        return {"size": os.path.getsize(self.path), "metadata": self.meta, "tensors": self.tensors}


def q4_0_bytes(rng, rows, cols):
    """Q4_0 blocks by hand (gguf 0.19 can dequantize Q4_0 but not quantize it): f16 scale, then 16
    bytes of packed 4-bit quants."""
    n_blocks = rows * cols // 32
    d = (rng.random(n_blocks) * 0.1 + 0.01).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    qs = rng.integers(0, 256, size=(n_blocks, 16), dtype=np.uint8)
    return np.concatenate([d, qs], axis=1).reshape(rows, cols // 32 * 18)


def main():
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(20240611)
    expected = {}

    f = Fixture("fixture.gguf", "qwen35")
    f.kv("general.name", "tern GGUF fixture", V.STRING)
    f.kv("general.description", "héllo, 世界 \u2014 UTF-8 survives", V.STRING)
    f.kv("qwen35.block_count", 4, V.UINT32)
    f.kv("qwen35.context_length", 1 << 40, V.UINT64)
    f.kv("qwen35.rope.freq_base", 10000000.0, V.FLOAT32)
    f.kv("qwen35.attention.layer_norm_rms_epsilon", 1e-6, V.FLOAT32)
    f.kv("test.u8", 200, V.UINT8)
    f.kv("test.i8", -100, V.INT8)
    f.kv("test.u16", 60000, V.UINT16)
    f.kv("test.i16", -30000, V.INT16)
    f.kv("test.u32", 4000000000, V.UINT32)
    f.kv("test.i32", -2000000000, V.INT32)
    f.kv("test.i32_positive", 123456, V.INT32)
    f.kv("test.f32", 0.1, V.FLOAT32)
    f.kv("test.bool_true", True, V.BOOL)
    f.kv("test.bool_false", False, V.BOOL)
    f.kv("test.u64", 18446744073709551615, V.UINT64)
    f.kv("test.i64", -(1 << 62), V.INT64)
    f.kv("test.f64", 2.718281828459045, V.FLOAT64)
    f.kv("test.array_u8", bytes([0, 1, 127, 255]), V.ARRAY)
    f.kv("test.array_i16", [-1, 2, -300], V.ARRAY, sub_type=V.INT16)
    f.kv("test.array_u32", [1, 2, 4000000000], V.ARRAY, sub_type=V.UINT32)
    f.kv("test.array_u64", [0, 1 << 63], V.ARRAY, sub_type=V.UINT64)
    f.kv("test.array_i64", [-(1 << 40), 7], V.ARRAY, sub_type=V.INT64)
    f.kv("test.array_f32", [0.5, -1.25, 3.0e-8], V.ARRAY)
    f.kv("test.array_f64", [0.1, -2.5], V.ARRAY, sub_type=V.FLOAT64)
    f.kv("test.array_bool", [True, False, True], V.ARRAY)
    f.kv("test.nested_array", [[1, 2], [3, 4, 5], [-6]], V.ARRAY)
    f.kv("test.nested_strings", [["a", "bc"], ["ü"]], V.ARRAY)
    f.kv("test.nested_twice", [[[1.5], [2.5, 3.5]], [[4.5]]], V.ARRAY)
    tokens = ["<unk>", "<s>", "</s>", "", "Ġthe", "Ġ世界", "héllo", "\n", "a b", "<0x0A>"]
    f.kv("tokenizer.ggml.model", "gpt2", V.STRING)
    f.kv("tokenizer.ggml.tokens", tokens, V.ARRAY)
    f.kv("tokenizer.ggml.token_type", [2, 3, 3, 1, 1, 1, 1, 6, 1, 6], V.ARRAY)
    f.kv("tokenizer.ggml.merges", ["Ġ t", "Ġt he", "h é"], V.ARRAY)
    f.kv("tokenizer.ggml.bos_token_id", 1, V.UINT32)

    # F32, three dimensions so the GGUF dims (fastest first) and the PyTorch shape differ visibly.
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    x.flat[0], x.flat[1], x.flat[2] = -0.0, np.inf, -np.inf
    f.tensor("blk.0.f32", x, Q.F32, x)
    bias = rng.standard_normal(7).astype(np.float32)  # 28 bytes: padding follows
    f.tensor("blk.0.bias", bias, Q.F32, bias)
    h = (rng.standard_normal((4, 8)) * 4).astype(np.float16)
    h.flat[0], h.flat[1], h.flat[2], h.flat[3] = -0.0, np.inf, np.float16(6e-8), np.float16(65504)
    f.tensor("blk.0.f16", h, Q.F16, h.astype(np.float32))
    b = rng.standard_normal((3, 16)).astype(np.float32)
    b.flat[0], b.flat[1], b.flat[2] = -0.0, np.inf, 1.0e-40
    bq = quantize(b, Q.BF16)
    f.tensor("blk.0.bf16", bq, Q.BF16, dequantize(bq, Q.BF16))
    w = rng.standard_normal((4, 64)).astype(np.float32)
    w[1, :32] = 0.0  # a block whose scale is zero
    w[2, 5] = 40.0  # a block dominated by one value (it quantizes to exactly 127)
    wq = quantize(w, Q.Q8_0)
    f.tensor("blk.0.q8_0", wq, Q.Q8_0, dequantize(wq, Q.Q8_0))
    q4 = q4_0_bytes(rng, 4, 128)
    f.tensor("blk.0.q4_0", q4, Q.Q4_0, dequantize(q4, Q.Q4_0))
    expected["fixture.gguf"] = f.finish()

    g = Fixture("aligned64.gguf", "test", alignment=64)
    g.kv("test.note", "alignment 64", V.STRING)
    a = rng.standard_normal((2, 5)).astype(np.float32)
    g.tensor("a", a, Q.F32, a)
    c = (rng.standard_normal((3,))).astype(np.float16)
    g.tensor("c", c, Q.F16, c.astype(np.float32))
    expected["aligned64.gguf"] = g.finish()

    with open(os.path.join(OUT, "expected.json"), "w") as out:
        json.dump(expected, out, indent=1, ensure_ascii=False)
        out.write("\n")
    for name, e in expected.items():
        print(f"{name}: {e['size']} bytes, {len(e['metadata'])} keys, {len(e['tensors'])} tensors")


if __name__ == "__main__":
    main()
