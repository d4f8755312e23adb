"""``splitspec.models.gguf_file``'s own GGUF parser against ``gguf.GGUFReader``, the reference: the
same metadata and the same tensor views, for every value type, tensor type, alignment and both
byte orders; GGUFReader itself is used only for the files the parser does not take."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from splitspec.models import gguf_file
from splitspec.models.gguf_file import GGUFFile, ModelFileError, read_metadata
from splitspec.text.tokenizer import Tokenizer, byte_level_vocab
from tests.kquants import quantize_k

METADATA = {  # key: (value, its GGUF type)
    "general.architecture": ("qwen3", GGUFValueType.STRING),
    "t.u8": (200, GGUFValueType.UINT8), "t.i8": (-100, GGUFValueType.INT8),
    "t.u16": (60000, GGUFValueType.UINT16), "t.i16": (-30000, GGUFValueType.INT16),
    "t.u32": (4_000_000_000, GGUFValueType.UINT32), "t.i32": (-2_000_000_000, GGUFValueType.INT32),
    "t.u64": (1 << 60, GGUFValueType.UINT64), "t.i64": (-(1 << 60), GGUFValueType.INT64),
    "t.f32": (0.25, GGUFValueType.FLOAT32), "t.f64": (1e-300, GGUFValueType.FLOAT64),
    "t.bool": (True, GGUFValueType.BOOL), "t.unicode": ("ÿ€ 中文 \U0001f600", GGUFValueType.STRING),
    "t.ints": ([1, -2, 3], GGUFValueType.ARRAY), "t.floats": ([0.5, 1.5], GGUFValueType.ARRAY),
    "t.strings": (["a", "", "Ġb", "\n"], GGUFValueType.ARRAY),
}


def _tensors(rng, blocks: bool = True) -> dict[str, tuple[np.ndarray, Q]]:
    """Name: (what the writer stores, its type): element types as arrays, block types (``blocks``;
    gguf's writer stores none in a big-endian file) as bytes."""
    w = rng.standard_normal((8, 512)).astype(np.float32)
    tensors = {
        "f32": (w, Q.F32), "f16": (w.astype(np.float16), Q.F16), "vector": (w[0], Q.F32),
        "i32": (np.arange(12, dtype=np.int32).reshape(3, 4), Q.I32),
        "three_d": (rng.standard_normal((2, 3, 32)).astype(np.float32), Q.F32),
    }
    if blocks:
        tensors.update({
            "bf16": (quantize(w, Q.BF16), Q.BF16), "q8_0": (quantize(w, Q.Q8_0), Q.Q8_0),
            "q4_k": (quantize_k(w, Q.Q4_K), Q.Q4_K), "q6_k": (quantize_k(w, Q.Q6_K), Q.Q6_K),
        })
    return tensors


def _write(path, alignment: int | None = None, endian: GGUFEndian = GGUFEndian.LITTLE) -> None:
    writer = GGUFWriter(path, "qwen3", endianess=endian)
    if alignment:
        writer.add_custom_alignment(alignment)
    for key, (value, kind) in METADATA.items():
        if key != "general.architecture":
            writer.add_key_value(key, value, kind)
    for name, (array, qtype) in _tensors(np.random.default_rng(0), blocks=endian is GGUFEndian.LITTLE).items():
        writer.add_tensor(name, array, raw_dtype=None if qtype in (Q.F32, Q.F16, Q.I32) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _assert_as_reader(path) -> GGUFFile:
    f, reference = GGUFFile(path), GGUFReader(path)
    for key, field in reference.fields.items():
        if not key.startswith("GGUF."):
            assert f.get(key) == field.contents(), key
    assert f.tensor_names() == [t.name for t in reference.tensors]
    for t in reference.tensors:
        assert f.tensor_type(t.name) == t.tensor_type
        assert f.tensor_shape(t.name) == tuple(int(d) for d in reversed(t.shape.tolist()))
        data, _ = f.raw(t.name) if t.tensor_type != Q.I32 else (f._tensors[t.name].data, None)
        assert data.dtype == t.data.dtype and data.shape == t.data.shape and not data.flags.writeable
        assert np.array_equal(data, t.data), t.name
    return f


@pytest.mark.parametrize("alignment", [None, 64, 256])
def test_metadata_and_tensors_as_ggufs_reader_gives_them(tmp_path, alignment):
    path = tmp_path / "m.gguf"
    _write(path, alignment)
    f = _assert_as_reader(path)
    for key, (value, _) in METADATA.items():
        expected = pytest.approx(value) if isinstance(value, float) or key == "t.floats" else value
        assert f.get(key) == expected, key
    reference = {t.name: t for t in GGUFReader(path).tensors}
    for name in ("q8_0", "q4_k"):  # dequantized as gguf's own dequantizer does
        assert np.array_equal(f.tensor(name), dequantize(reference[name].data, reference[name].tensor_type))
    assert f.tensor("f32").shape == (8, 512) and f.tensor("three_d").shape == (2, 3, 32)


def test_little_endian_files_never_go_through_ggufs_reader(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    _write(path)
    monkeypatch.setattr(gguf_file, "GGUFReader", None)  # any call would raise TypeError
    assert GGUFFile(path).tensor_shape("q4_k") == (8, 512)
    assert read_metadata(path)["t.strings"] == ["a", "", "Ġb", "\n"]


def test_big_endian_files_go_through_ggufs_reader(tmp_path):
    path = tmp_path / "big.gguf"
    _write(path, endian=GGUFEndian.BIG)
    f = _assert_as_reader(path)
    assert f.get("t.u32") == 4_000_000_000 and f.get("t.strings") == ["a", "", "Ġb", "\n"]


def test_a_large_vocabulary_reads_as_ggufs_reader_does(tmp_path):
    # A 20K-token vocabulary with merges (a real Qwen3.5 file has 248K of each): the gateway's
    # tokenizer and the loaders read the same metadata.
    path = tmp_path / "vocab.gguf"
    alphabet = byte_level_vocab(special_tokens=()).tokens  # the 256 byte tokens
    pairs = [(a, b) for a in alphabet for b in alphabet][:20_000]
    tokens = alphabet + [a + b for a, b in pairs]
    writer = GGUFWriter(path, "qwen3")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges([f"{a} {b}" for a, b in pairs])
    writer.add_tensor("w", np.zeros((2, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f = _assert_as_reader(path)
    assert read_metadata(path)["tokenizer.ggml.tokens"] == f.get("tokenizer.ggml.tokens") == tokens
    assert Tokenizer.from_gguf(path).token_to_id(tokens[-1]) == len(tokens) - 1


@pytest.mark.parametrize("cut", [10, 30, 200, -100, -1])
def test_truncated_files_are_named_and_refused(tmp_path, cut):
    path = tmp_path / "m.gguf"
    _write(path)
    data = path.read_bytes()
    path.write_bytes(data[:cut])
    with pytest.raises(ModelFileError, match=f"{path}: not a readable GGUF file, truncated or corrupt"):
        GGUFFile(path)


def test_duplicate_tensor_names_are_refused(tmp_path):
    path = tmp_path / "m.gguf"
    writer = GGUFWriter(path, "qwen3")
    writer.add_tensor("aaaa", np.zeros(32, np.float32))
    writer.add_tensor("bbbb", np.zeros(32, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.write_bytes(path.read_bytes().replace(b"bbbb", b"aaaa"))
    with pytest.raises(ModelFileError, match="tensor 'aaaa' appears twice"):
        GGUFFile(path)
