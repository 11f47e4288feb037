"""GPTQ / AWQ / compressed-tensors integer weights -> GGUF block rows, bit for bit.

Each checkpoint layout is packed by tests/helpers/hf_quant_ckpt.py from its producer's
published loop; the converted PackedRows, dequantized by gguf's own dequantizer, must equal
the numpy reference value = scale * (q - zero): exactly for symmetric schemes (and int8),
within runner/quant/hf_int.py's stated bound |err| <= 2^-11 * |zero * scale| (fp16 rounding
of Q4_1's m) for asymmetric ones. Act-order columns: PackedRows.input_perm, checked through
the matmul too.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from helpers import hf_quant_ckpt as hq
from kvstrata.config.hf_quant import HfQuantScheme
from kvstrata.runner.cpu import gguf_matmul
from kvstrata.runner.quant import hf_int
from kvstrata.runner.quant.hf_checkpoint import convert, dequantize_fp8

N, K = 48, 256


def _t(parts: dict) -> dict:
    return {k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(v))
            for k, v in parts.items()}


def _weights(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 0.05, (N, K)).astype(np.float32)


def _check(rows, ref: np.ndarray, zeros_scales=None, exact: bool = True):
    got = rows.dequantize().numpy()
    assert got.shape == ref.shape
    if exact:
        np.testing.assert_array_equal(got, ref)
    else:  # the stated bound, plus float32 rounding of q * d + m
        zs = zeros_scales
        bound = 2.0 ** -11 * zs + 2.0 ** -23 * (np.abs(ref) + zs) + 2.0 ** -25
        assert np.all(np.abs(got - ref) <= bound), float(np.max(np.abs(got - ref) - bound))
    x = torch.randn(3, ref.shape[1])
    xs = x if rows.input_perm is None else x[:, rows.input_perm]
    y = gguf_matmul.matmul(xs.contiguous(), gguf_matmul.prepare(rows.qtype, rows.raw))
    # x meets the blocks through input_perm: the product is x @ W.T of the checkpoint's W
    torch.testing.assert_close(y, x @ torch.from_numpy(got).T, atol=1e-4, rtol=1e-4)


def test_block_type_ids_are_gguf_s():
    assert hf_int.Q4_1 == gguf.GGMLQuantizationType.Q4_1
    assert hf_int.Q8_0 == gguf.GGMLQuantizationType.Q8_0


@pytest.mark.parametrize("group", [32, 64, 128, -1])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("sym", [True, False])
def test_gptq_int4(group, fmt, sym):
    codes, scales, zeros, g_idx = hq.quantize(_weights(abs(group) + sym), 4, group, sym)
    parts = hq.pack_gptq(codes, scales, zeros, g_idx, 4, v1=fmt == "gptq")
    scheme = HfQuantScheme("gptq", 4, group, sym, False, fmt)
    rows = convert(scheme, _t(parts), "x.weight")
    assert rows.qtype == hf_int.Q4_1 and rows.input_perm is None
    ref = hq.reference_dequant(codes, scales, zeros, g_idx)
    zs = np.abs(zeros[:, g_idx] * scales.astype(np.float32)[:, g_idx])
    _check(rows, ref, zs, exact=sym)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group", [32, 128])
def test_gptq_act_order(group, sym):
    rng = np.random.default_rng(5)
    g_idx = hq.act_order_g_idx(K, group, rng)
    codes, scales, zeros, g_idx = hq.quantize(_weights(9), 4, group, sym, g_idx)
    parts = hq.pack_gptq(codes, scales, zeros, g_idx, 4, v1=True)
    rows = convert(HfQuantScheme("gptq", 4, group, sym, True, "gptq"), _t(parts), "x.weight")
    assert rows.input_perm is not None
    assert torch.equal(torch.from_numpy(g_idx[rows.input_perm.numpy()]),
                       torch.sort(torch.from_numpy(g_idx)).values)
    ref = hq.reference_dequant(codes, scales, zeros, g_idx)
    zs = np.abs(zeros[:, g_idx] * scales.astype(np.float32)[:, g_idx])
    _check(rows, ref, zs, exact=sym)


def test_gptq_v1_zero_stored_minus_one_matters():
    """The same packed words read as v1 and as v2 differ by one zero step: the format field
    is honoured (a v1 zero of 0 is stored as 15 and its kernels read 16)."""
    codes, scales, zeros, g_idx = hq.quantize(_weights(3), 4, 64, False)
    parts = _t(hq.pack_gptq(codes, scales, zeros, g_idx, 4, v1=True))
    v1 = convert(HfQuantScheme("gptq", 4, 64, False, False, "gptq"), parts, "w").dequantize()
    v2 = convert(HfQuantScheme("gptq", 4, 64, False, False, "gptq_v2"), parts, "w").dequantize()
    step = torch.from_numpy(scales.astype(np.float32)[:, g_idx])
    torch.testing.assert_close(v2 - v1, step, atol=1e-3, rtol=1e-3)


def test_gptq_int8_symmetric_is_q8_0():
    codes, scales, zeros, g_idx = hq.quantize(_weights(4), 8, 64, True)
    assert (zeros == 128).all()
    parts = hq.pack_gptq(codes, scales, zeros, g_idx, 8, v1=True)
    rows = convert(HfQuantScheme("gptq", 8, 64, True, False, "gptq"), _t(parts), "w")
    assert rows.qtype == hf_int.Q8_0
    _check(rows, hq.reference_dequant(codes, scales, zeros, g_idx))


def test_int8_zero_other_than_128_is_refused():
    codes, scales, zeros, g_idx = hq.quantize(_weights(4), 8, 64, False)
    parts = hq.pack_gptq(codes, scales, zeros, g_idx, 8, v1=False)
    with pytest.raises(ValueError, match="asymmetric int8"):
        convert(HfQuantScheme("gptq", 8, 64, True, False, "gptq_v2"), _t(parts), "w")


@pytest.mark.parametrize("group", [32, 64, 128])
def test_awq_gemm(group):
    codes, scales, zeros, g_idx = hq.quantize(_weights(group), 4, group, False)
    parts = hq.pack_awq(codes, scales, zeros)
    rows = convert(HfQuantScheme("awq", 4, group, False, False, "gemm"), _t(parts), "w")
    ref = hq.reference_dequant(codes, scales, zeros, g_idx)
    _check(rows, ref, np.abs(zeros[:, g_idx] * scales.astype(np.float32)[:, g_idx]),
           exact=False)


def test_awq_nibble_order_is_not_plain():
    """Reading AWQ's words in GPTQ's plain nibble order would scramble columns: the test's
    packing is not accidentally order-free."""
    codes, scales, zeros, _ = hq.quantize(_weights(1), 4, 32, False)
    words = hq.pack_awq(codes, scales, zeros)["qweight"]
    plain = hf_int.unpack_int32(torch.from_numpy(words), 4, 1).T.numpy()
    assert not np.array_equal(plain, codes)


@pytest.mark.parametrize("case", ["w4a16_group128_sym", "w4a16_group64_asym",
                                  "w4a16_actorder", "w8a16_channel_packed",
                                  "w8a16_channel_int", "w4a16_int_quantized"])
def test_compressed_tensors(case):
    bits = 8 if "w8" in case else 4
    group = -1 if "channel" in case else (64 if "64" in case else 128)
    sym = "asym" not in case
    packed = "int" not in case
    g_idx = hq.act_order_g_idx(K, group, np.random.default_rng(2)) if "actorder" in case \
        else None
    codes, scales, zeros, g_idx = hq.quantize(_weights(bits + abs(group)), bits, group, sym, g_idx)
    parts = hq.pack_compressed_tensors(codes, scales, zeros, g_idx, bits, sym, packed,
                                       actorder="actorder" in case)
    scheme = HfQuantScheme("compressed-tensors", bits, group, sym, "actorder" in case,
                           "pack-quantized" if packed else "int-quantized")
    rows = convert(scheme, _t(parts), "w")
    assert rows.qtype == (hf_int.Q8_0 if bits == 8 else hf_int.Q4_1)
    # the scales went through bf16 (compressed-tensors stores them in the model dtype)
    scales_bf16 = torch.from_numpy(scales.astype(np.float32)).bfloat16().float().numpy()
    ref = hq.reference_dequant(codes, scales_bf16, zeros, g_idx)
    _check(rows, ref, np.abs(zeros[:, g_idx] * scales_bf16[:, g_idx]), exact=sym)


def test_uneven_act_order_groups_are_refused():
    """Groups that do not fill whole blocks of 32 (here a group of 48 columns) cannot be
    kept in GGUF blocks: refused by tensor name."""
    g_idx = np.repeat(np.arange(K // 16), 16).astype(np.int32) // 3
    codes, scales, zeros, g_idx = hq.quantize(_weights(6), 4, 32, True, g_idx)
    parts = hq.pack_gptq(codes, scales, zeros, g_idx, 4, v1=True)
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.weight: its groups"):
        convert(HfQuantScheme("gptq", 4, 32, True, True, "gptq"), _t(parts),
                "model.layers.0.mlp.up_proj.weight")


@pytest.mark.parametrize("shape", [(256, 384), (200, 300)])
def test_fp8_block_dequantize(shape):
    w = np.random.default_rng(0).normal(0, 0.1, shape).astype(np.float32)
    q, scale = hq.fp8_block_quantize(w, (128, 128))
    got = dequantize_fp8({"weight": q, "weight_scale_inv": scale}, (128, 128), "w")
    np.testing.assert_array_equal(got.numpy(), hq.fp8_reference_dequant(q, scale, (128, 128)))
    assert np.abs(got.numpy() - w).max() <= np.abs(w).max() * 2 ** -3  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("sym", [True, False])
def test_step_error_says_what_the_blocks_round(sym):
    """The number the loader's warning reports: 0 where the blocks hold the checkpoint's
    values exactly (fp16 scales, symmetric zero 8), else Q4_1's fp16 m off by at most
    2^-11 * |z * s| <= 15 * 2^-11 quantization steps (zeros 0..15)."""
    codes, scales, zeros, g_idx = hq.quantize(_weights(8), 4, 32, sym)
    parts = hq.pack_gptq(codes, scales, zeros, g_idx, 4, v1=False)
    errors: dict = {}
    convert(HfQuantScheme("gptq", 4, 32, sym, False, "gptq_v2"), _t(parts), "w", errors)
    if sym:
        assert errors["step_error"] == 0.0
    else:
        assert 0.0 < errors["step_error"] <= 15 * 2.0 ** -11
    f32 = _t(hq.pack_compressed_tensors(codes, scales, zeros, g_idx, 4, True, True,
                                        scale_dtype=torch.float32))
    ct = HfQuantScheme("compressed-tensors", 4, 32, True, False, "pack-quantized")
    errors = {}
    convert(ct, f32, "w", errors)
    assert errors["step_error"] == 0.0  # fp16 values stored as float32 convert exactly
    f32["weight_scale"] = f32["weight_scale"] * (1 + 2.0 ** -14)  # not an fp16 value
    errors = {}
    convert(ct, f32, "w", errors)
    # d rounds to fp16 (q * |d - s| <= 15 * 2^-11 * s), m = -8 * s from the unrounded s:
    # at most 2^-11 * 8 s more
    assert 0.0 < errors["step_error"] <= 23 * 2.0 ** -11


def test_assemble_gathers_parts_across_shards_in_any_order():
    """A linear's parts may arrive far apart (sharded files): each becomes one P.weight once
    its last part is in; other tensors pass through in place; a part never read is an error."""
    from kvstrata.runner.quant.hf_checkpoint import assemble, quantized_parts

    scheme = HfQuantScheme("gptq", 4, 64, True, False, "gptq")
    layers = {}
    for i in range(2):
        codes, scales, zeros, g_idx = hq.quantize(_weights(20 + i), 4, 64, True)
        layers[f"l{i}"] = (_t(hq.pack_gptq(codes, scales, zeros, g_idx, 4, v1=True)),
                           hq.reference_dequant(codes, scales, zeros, g_idx))
    stream = [("l0.qweight", layers["l0"][0]["qweight"]), ("norm.weight", torch.ones(4)),
              ("l1.scales", layers["l1"][0]["scales"]), ("l1.qweight", layers["l1"][0]["qweight"]),
              ("l0.scales", layers["l0"][0]["scales"]), ("l0.qzeros", layers["l0"][0]["qzeros"]),
              ("l1.g_idx", layers["l1"][0]["g_idx"]), ("l1.qzeros", layers["l1"][0]["qzeros"]),
              ("l0.g_idx", layers["l0"][0]["g_idx"])]
    parts = quantized_parts(scheme, [n for n, _ in stream])
    out = list(assemble(scheme, parts, iter(stream)))
    assert [n for n, _ in out] == ["norm.weight", "l1.weight", "l0.weight"]
    for name, rows in out[1:]:
        np.testing.assert_array_equal(rows.dequantize().numpy(), layers[name[:2]][1])
    with pytest.raises(ValueError, match="parts unread: \\['l0'\\]"):
        list(assemble(scheme, parts, iter(stream[:-1])))
