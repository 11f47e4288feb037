"""runner/models/gguf_index.py reads a GGUF file's tensors as gguf.GGUFReader does (names,
types, shapes, the same bytes) without parsing the metadata values: on a file written by
gguf.GGUFWriter with every kind of metadata value (a long string array among them) and
plain and quantised tensors, and on the SmolLM2 GGUF's tensor table."""
from __future__ import annotations

import numpy as np
import pytest

from kvstrata.runner.models.gguf_index import read_gguf_tensors

gguf = pytest.importorskip("gguf")


def _write(path, alignment=None):
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_string("general.name", "tiny")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("some.flag", True)
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" * (i % 5 + 1) for i in range(3000)])
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(3000)])
    w.add_array("nested.ints", [1, 2, 3])
    rng = np.random.default_rng(0)
    plain = rng.standard_normal((6, 64)).astype(np.float32)
    w.add_tensor("token_embd.weight", plain)
    w.add_tensor("output_norm.weight", rng.standard_normal(64).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32),
                             gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q, raw_shape=q.shape,
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _same_as_reader(path):
    ours = read_gguf_tensors(str(path))
    theirs = gguf.GGUFReader(str(path)).tensors
    assert [t.name for t in ours] == [t.name for t in theirs]
    for a, b in zip(ours, theirs):
        assert a.tensor_type == int(b.tensor_type)
        assert a.shape == tuple(int(d) for d in b.shape)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data)
        np.testing.assert_array_equal(gguf.quants.dequantize(a.data, b.tensor_type),
                                      gguf.quants.dequantize(b.data, b.tensor_type))


@pytest.mark.parametrize("alignment", [None, 64])
def test_written_file_reads_as_gguf_reader_reads_it(tmp_path, alignment):
    path = tmp_path / "tiny.gguf"
    _write(path, alignment)
    _same_as_reader(path)


def test_metadata_values_read_as_gguf_reader_reads_them(tmp_path):
    """config/gguf_header.py decodes the keys asked for (numbers, bools, strings, arrays of
    both) as GGUFReader does, and only those."""
    from kvstrata.config.gguf_header import read_metadata

    path = tmp_path / "tiny.gguf"
    _write(path, alignment=64)
    keys = ("general.name", "llama.block_count", "llama.rope.freq_base", "some.flag",
            "tokenizer.ggml.tokens", "nested.ints", "general.alignment")
    ours = read_metadata(str(path), keys + ("absent.key",))
    fields = gguf.GGUFReader(str(path)).fields
    assert set(ours) == set(keys)
    for key in keys:
        assert ours[key] == fields[key].contents(), key
    assert read_metadata(str(path), ()) == {"general.alignment": 64}


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_tensors(str(path))


def test_q4_1_and_q8_0_dequantization_equal_ggufs():
    """Our whole-tensor Q4_1 and Q8_0 paths give gguf's values bit for bit (random blocks, finite
    fp16 scales and minimums), and other types go through gguf itself."""
    import gguf
    import numpy as np

    from kvstrata.runner.models.gguf_weights import Q4_1_BLOCK_BYTES, dequantize
    rng = np.random.default_rng(0)
    rows, blocks = 6, 5
    raw = rng.integers(0, 256, size=(rows * blocks, Q4_1_BLOCK_BYTES), dtype=np.uint8)
    raw[:, 0:2] = rng.normal(0, 0.1, rows * blocks).astype(np.float16).view(np.uint8).reshape(-1, 2)
    raw[:, 2:4] = rng.normal(0, 0.5, rows * blocks).astype(np.float16).view(np.uint8).reshape(-1, 2)
    data = raw.reshape(rows, blocks * Q4_1_BLOCK_BYTES)
    ours = dequantize(data, gguf.GGMLQuantizationType.Q4_1)
    theirs = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q4_1)
    assert ours.shape == theirs.shape == (rows, blocks * 32)
    np.testing.assert_array_equal(ours, theirs)
    q8 = rng.integers(0, 256, size=(rows * blocks, 34), dtype=np.uint8)
    q8[:, 0:2] = rng.normal(0, 0.1, rows * blocks).astype(np.float16).view(np.uint8).reshape(-1, 2)
    q8 = q8.reshape(rows, blocks * 34)
    np.testing.assert_array_equal(dequantize(q8, gguf.GGMLQuantizationType.Q8_0),
                                  gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0))
    f32 = rng.normal(size=(3, 8)).astype(np.float32)
    np.testing.assert_array_equal(dequantize(f32, gguf.GGMLQuantizationType.F32), f32)
