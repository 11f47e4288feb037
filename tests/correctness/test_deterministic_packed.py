"""--enable-deterministic-inference with weights kept packed (runner/quant/gguf_pinned.py): GGUF
files kept quantized (`--quantization gguf`), GPTQ checkpoints kept in GGUF block rows, and
FP8 checkpoints dequantized at load.

- The layer: a GgufLinear whose fused output mixes packed segments (Q4_0, Q8_0) with a float
  one (an F32 tensor of a q|k|v, as tests/helpers/decoder_gguf.py's layer 1 holds) gives each
  row the same bits whatever the row count (1..64 and beyond), on float or 8-bit activations
  -- its float segment on the fixed GEMM, no longer F.linear -- and still the layer's product.
- The engine: each request (greedy and seeded) of the tiny GGUF llama (tied, Q4_0 embedding
  as its head) and qwen3 (Q6_K head) and a GPTQ int4 act-order llama (its float lm_head
  pinned whole), at bf16 and at float32 (--dtype auto's choice for packed weights), and an
  FP8 qwen3 at bf16, equals its cold run alone when it runs beside others arriving at other
  steps, its prompt chunked in 7s, the shared prefix a radix hit, and again with every prompt
  a whole radix hit. On this project's AVX-512 box the float32 cases fail with the float
  parts left on F.linear (measured); bf16's F.linear happened to be row-count-invariant there.
The bundled SmolLM2 Q4_1 kept packed: test_smollm2_gguf_packed.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import hf_quant_ckpt as hq
from helpers.decoder_gguf import ARCHS, write_decoder_gguf
from kvstrata.runner.cpu.fixed_linear import fixed_unsupported
from kvstrata.runner.quant.gguf_linear import GgufLinear
from kvstrata.runner.quant.packed_rows import PackedRows
from tests.correctness.test_batch_invariance import ROW_COUNTS
from tests.correctness.test_deterministic_inference import (cold_runs, drive, make_llm, params,
                                                            prompts_with_prefix)

IN = 256


def _packed(kind: str, rows: int, rng: np.random.Generator) -> PackedRows:
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    w = rng.standard_normal((rows, IN)).astype(np.float32) * 0.05
    return PackedRows(int(qtype), torch.from_numpy(gguf.quants.quantize(w, qtype)), IN)


@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_segments_do_not_depend_on_the_row_count(dtype, int8_activations):
    rng = np.random.default_rng(5)
    float_rows = torch.from_numpy(rng.standard_normal((40, IN)).astype(np.float32) * 0.05)
    if fixed_unsupported(float_rows.to(dtype)) is not None:
        pytest.skip(fixed_unsupported(float_rows.to(dtype)))
    segments = [(0, 64, _packed("Q4_0", 64, rng)), (64, 104, float_rows.to(dtype)),
                (104, 168, _packed("Q8_0", 64, rng))]
    bias = torch.from_numpy(rng.standard_normal(168).astype(np.float32))
    layer = GgufLinear(168, IN, segments, bias.to(dtype), int8_activations=int8_activations)
    assert layer.pin_float_segments() == 1
    x = torch.from_numpy(rng.standard_normal((max(ROW_COUNTS), IN)).astype(np.float32)).to(dtype)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(x.shape[0])])
    assert alone.dtype == dtype
    for m in ROW_COUNTS:
        assert torch.equal(layer(x[:m]), alone[:m]), f"{m} rows differ from one at a time"
    # and it is the layer's product: the packed rows' values, the float rows, the bias
    full = torch.cat([segments[0][2].dequantize(), float_rows.to(dtype).float(),
                      segments[2][2].dequantize()])
    ref = x.double() @ full.double().T + bias.to(dtype).double()
    err = (alone.double() - ref).abs().max().item()
    assert err <= 0.02 * ref.abs().max().item(), err


def test_a_float_weight_left_unpinned_is_refused():
    """pinned_linear (the model's linear once pinned) never falls back to F.linear."""
    from kvstrata.runner.quant.gguf_pinned import pinned_linear

    with pytest.raises(RuntimeError, match="was not pinned on the fixed GEMM"):
        pinned_linear(torch.ones(2, 4), torch.ones(3, 4))


def _gptq_int4_actorder(w: np.ndarray):
    rng = np.random.default_rng(1)
    g_idx = hq.act_order_g_idx(w.shape[1], 32, rng)
    codes, scales, zeros, g_idx = hq.quantize(w, 4, 32, True, g_idx)
    return (hq.pack_gptq(codes, scales, zeros, g_idx, 4, v1=True),
            hq.reference_dequant(codes, scales, zeros, g_idx))


def _fp8_block(w: np.ndarray):
    q, scale = hq.fp8_block_quantize(w, (128, 128))
    return {"weight": q, "weight_scale_inv": scale}, w


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": True,
        "checkpoint_format": "gptq"}
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
       "weight_block_size": [128, 128]}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (model path, LLM keyword arguments)."""
    root = tmp_path_factory.mktemp("det_packed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(root / "cache"))  # config/model_source.py's cache
        out = {}
        for arch in ARCHS:
            path = str(root / f"{arch}.gguf")
            write_decoder_gguf(arch, path)
            out[f"gguf-{arch}"] = (path, {"quantization": "gguf"})
        for arch, name, cfg, linear in (("llama", "gptq", GPTQ, _gptq_int4_actorder),
                                        ("qwen3", "fp8", FP8, _fp8_block)):
            float_path = hq.float_checkpoint(arch, str(root / f"{name}-float"))
            out[name] = (hq.write_quantized(float_path, str(root / name), cfg, linear), {})
        yield out


@pytest.mark.parametrize("case,dtype", [(case, dtype) for case in ("gguf-llama", "gguf-qwen3",
                                                                    "gptq")
                                          for dtype in ("bfloat16", "float32")]
                         + [("fp8", "bfloat16")])
def test_every_request_equals_its_cold_run_alone(checkpoints, case, dtype):
    path, kw = checkpoints[case]
    llm = make_llm(path, chunked_prefill_size=7, max_total_tokens=4096, dtype=dtype, **kw)
    try:
        info = llm.server_info()["quantization_info"]
        model = llm.engine.runner.model
        if case == "fp8":  # dequantized at load: a float model's fixed GEMM
            assert model.layers[0].qkv_weight.fixed
        else:
            assert info["batch_invariant"]
            # the tiny GGUF's layer-1 q|k|v holds an F32 k; the GPTQ llama's tied float head
            assert info["pinned_float_segments"] == (1 if case.startswith("gguf") else 0)
            assert info["pinned_float_linears"] == (1 if case == "gptq" else 0)
        prompts = prompts_with_prefix(4, 18, [3, 12, 25, 6])
        work = [(i, p, params(8, None if i % 2 else 31 + i)) for i, p in enumerate(prompts)]
        cold = cold_runs(llm, work)
        assert drive(llm, work) == cold  # mixed, chunked, the prefix a radix hit
        assert drive(llm, [(0, p, sp) for _, p, sp in work]) == cold  # whole-prompt hits
    finally:
        llm.shutdown()
