"""Quantized HF checkpoints end to end: GPTQ / AWQ / compressed-tensors served with their
weights kept in GGUF blocks, FP8 block-scaled dequantized at load.

A tiny random llama (tied) and qwen3 (q/k norms; tests/helpers/hf_quant_ckpt.py's shapes:
every input width a multiple of 128) are quantized by the test (round-to-nearest) and written
in each producer's published layout; kvstrata loads them as Q4_1 / Q8_0 block rows
(runner/quant/hf_int.py) in GgufLinear layers. Two references:
- transformers on a float checkpoint holding the quantized checkpoint's own values
  (scale * (q - zero)): logits within LOGITS_ATOL, the bound the packed GGUF tests use (the
  portable matmul meets it by ~1e-5; the packed kernels may quantize activations to 8 bits);
- transformers on the float model the test quantized from: the quantization's own error,
  bounded by FLOAT_MODEL_RTOL (relative L2 error of the logits) for 4 and 8 bits.
The act-order case also decodes greedily against transformers on the reference.
Asymmetric zero points round into Q4_1's fp16 minimum: the load says so (a warning naming
the largest error per weight in quantization steps); symmetric ones load exactly, silently.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from helpers import hf_quant_ckpt as hq
from helpers.runner import forward_logits, make_runner

LOGITS_ATOL = 5e-2
# ||logits - float model's|| / ||float model's logits - their mean||: round-to-nearest int4
# of random weights measures 0.23-0.41 here, int8 0.018-0.025; a scrambled layout ~1.4.
FLOAT_MODEL_RTOL = {4: 0.5, 8: 0.05}
NEW_TOKENS = 6
FP8_ATOL = 1e-4
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}
PROMPTS = ([5, 17, 99, 250, 3, 42, 7, 8, 200, 101, 64, 33, 12], [9, 120, 4])


def _gptq(bits: int, group: int, sym: bool, desc_act: bool):
    cfg = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act,
           "sym": sym, "checkpoint_format": "gptq"}
    rng = np.random.default_rng(1)

    def linear(w):
        g_idx = hq.act_order_g_idx(w.shape[1], group, rng) if desc_act else None
        codes, scales, zeros, g_idx = hq.quantize(w, bits, group, sym, g_idx)
        return (hq.pack_gptq(codes, scales, zeros, g_idx, bits, v1=True),
                hq.reference_dequant(codes, scales, zeros, g_idx))
    return cfg, linear


def _awq(group: int):
    cfg = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
           "version": "gemm"}

    def linear(w):
        codes, scales, zeros, g_idx = hq.quantize(w, 4, group, False)
        return hq.pack_awq(codes, scales, zeros), hq.reference_dequant(codes, scales, zeros,
                                                                       g_idx)
    return cfg, linear


def _compressed_tensors(bits: int, group: int, sym: bool, actorder: bool, packed: bool):
    strategy = {"strategy": "channel"} if group == -1 else {"strategy": "group",
                                                            "group_size": group}
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False,
               "actorder": "group" if actorder else None, **strategy}
    cfg = {"quant_method": "compressed-tensors", "ignore": ["lm_head"],
           "format": "pack-quantized" if packed else "int-quantized",
           "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                         "input_activations": None}}}
    rng = np.random.default_rng(2)

    def linear(w):
        g_idx = hq.act_order_g_idx(w.shape[1], group, rng) if actorder else None
        codes, scales, zeros, g_idx = hq.quantize(w, bits, group, sym, g_idx)
        parts = hq.pack_compressed_tensors(codes, scales, zeros, g_idx, bits, sym, packed,
                                           actorder=actorder)
        bf16 = parts["weight_scale"].float().numpy()  # stored in bf16: the values served
        return parts, hq.reference_dequant(codes, bf16, zeros, g_idx)
    return cfg, linear


# id: (arch, (quantization_config, per-linear quantizer), --quantization, bits, asymmetric)
CASES = {
    "gptq-int4-actorder-g32": ("llama", _gptq(4, 32, True, True), "marlin", 4, False),
    "gptq-int4-asym-g64": ("qwen3", _gptq(4, 64, False, False), "gptq_marlin", 4, True),
    "gptq-int8-channel": ("llama", _gptq(8, -1, True, False), None, 8, False),
    "awq-int4-g128": ("qwen3", _awq(128), "awq_marlin", 4, True),
    "ct-w4a16-asym-actorder-g32": ("llama", _compressed_tensors(4, 32, False, True, True),
                                   "compressed-tensors", 4, True),
    "ct-w8a16-channel-int": ("qwen3", _compressed_tensors(8, -1, True, False, False), None, 8,
                             False),
}


@pytest.fixture(scope="module")
def float_models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("hf_int_float")
    out = {}
    for arch in ("llama", "qwen3"):
        path = hq.float_checkpoint(arch, str(root / arch))
        out[arch] = (path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    return out


def _logits(hf, prompt):
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0]


@pytest.mark.parametrize("case", list(CASES))
def test_int_checkpoint_matches_transformers(case, float_models, tmp_path, caplog):
    from transformers import AutoModelForCausalLM

    from kvstrata.runner.quant.gguf_linear import GgufLinear

    arch, (cfg, linear), flag, bits, asym = CASES[case]
    float_path, float_hf = float_models[arch]
    path = hq.write_quantized(float_path, str(tmp_path / case), cfg, linear)
    ref = AutoModelForCausalLM.from_pretrained(path + "-ref", dtype=torch.float32).eval()
    with caplog.at_level(logging.WARNING, logger="kvstrata.runner.quant.hf_checkpoint"):
        runner = make_runner(path, dtype="float32", max_total_tokens=256, context_length=128,
                             max_running_requests=2, quantization=flag)
    info = runner.quantization_info
    assert info["quantization"] == cfg["quant_method"] and info["checkpoint_scheme"]
    assert ("kept in GGUF blocks" in caplog.text) == asym, caplog.text
    for layer in runner.model.layers:  # every linear packed: no float copy left behind
        for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"):
            assert type(getattr(layer, name)) is GgufLinear, name
    for prompt in PROMPTS:
        got = forward_logits(runner, prompt)
        torch.testing.assert_close(got, _logits(ref, prompt), atol=LOGITS_ATOL, rtol=0)
        want = _logits(float_hf, prompt)
        err = float((got - want).norm() / (want - want.mean(-1, keepdim=True)).norm())
        assert err <= FLOAT_MODEL_RTOL[bits], f"{case}: relative logit error {err:.3g}"
    if case == "gptq-int4-actorder-g32":  # decode steps too (input_perm on 1-row batches)
        _greedy_matches(runner, ref)
        _refusals(path)


def _refusals(path: str) -> None:
    from kvstrata.config.hf_quant import checkpoint_scheme
    from kvstrata.runner.models.loader import refuse_packed_model

    with pytest.raises(ValueError, match=r"model config \(gptq\).*argument \(awq\)"):
        make_runner(path, dtype="float32", max_total_tokens=256, quantization="awq")
    with pytest.raises(ValueError, match="llama-family decoder only, not object"):
        refuse_packed_model(object(), checkpoint_scheme(path), path)


def _greedy_matches(runner, ref) -> None:
    from helpers.compare import assert_tokens_match
    from helpers.driver import greedy_generate

    outs = greedy_generate(runner, [list(p) for p in PROMPTS], NEW_TOKENS)
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), do_sample=False,
                                max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                output_logits=True, return_dict_in_generate=True,
                                pad_token_id=0)
        assert_tokens_match(out, want.sequences[0, len(prompt):].tolist(),
                            [s[0] for s in want.logits], tie_tol=LOGITS_ATOL)


def _fp8_linear(w: np.ndarray):
    q, scale = hq.fp8_block_quantize(w, (128, 128))
    return ({"weight": q, "weight_scale_inv": scale},
            hq.fp8_reference_dequant(q, scale, (128, 128)))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fp8_block_checkpoint_matches_transformers(arch, float_models, tmp_path):
    from transformers import AutoModelForCausalLM

    path = hq.write_quantized(float_models[arch][0], str(tmp_path / arch), FP8_CONFIG,
                              _fp8_linear)
    ref = AutoModelForCausalLM.from_pretrained(path + "-ref", dtype=torch.float32).eval()
    runner = make_runner(path, dtype="float32", max_total_tokens=256, context_length=128,
                         max_running_requests=2, quantization="fp8" if arch == "llama" else None)
    assert runner.quantization_info["quantization"] == "fp8"
    for prompt in PROMPTS:
        torch.testing.assert_close(forward_logits(runner, prompt), _logits(ref, prompt),
                                   atol=FP8_ATOL, rtol=0)
    if arch == "llama":
        with pytest.raises(ValueError, match=r"model config \(fp8\).*argument \(gptq\)"):
            make_runner(path, dtype="float32", max_total_tokens=256, quantization="gptq")
