"""Quantized HF checkpoints end to end: a tiny llama / qwen3 written in each format by the
test (tests/helpers/hf_quant_ckpt.py, the producers' layouts) -> kvstrata's logits against
transformers on the float checkpoint holding the same dequantized weights (float32).

FP8 (block-scaled e4m3, weight_scale_inv) is dequantized at load: the model's weights are
the reference's exactly, so the prefill logits match as the float tiny models do (1e-4)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import hf_quant_ckpt as hq
from helpers.runner import forward_logits, make_runner

ARCHS = ("llama", "qwen3")
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [32, 32]}  # 128 in releases; 32 tiles the tiny shapes
PREFILL_ATOL = 1e-4


def _fp8_linear(w: np.ndarray):
    q, scale = hq.fp8_block_quantize(w, (32, 32))
    return {"weight": q, "weight_scale_inv": scale}, hq.fp8_reference_dequant(q, scale,
                                                                              (32, 32))


@pytest.fixture(scope="module")
def fp8_checkpoints(tiny_checkpoints, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fp8_ckpts")
    return {a: hq.write_quantized(tiny_checkpoints[a], str(root / a), FP8_CONFIG, _fp8_linear)
            for a in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_block_checkpoint_matches_transformers(arch, fp8_checkpoints, tiny_prompts):
    from transformers import AutoModelForCausalLM

    path = fp8_checkpoints[arch]
    hf = AutoModelForCausalLM.from_pretrained(path + "-ref", dtype=torch.float32).eval()
    runner = make_runner(path, dtype="float32", max_total_tokens=1024, context_length=256,
                         max_running_requests=4, quantization="fp8")
    assert runner.quantization_info["quantization"] == "fp8"
    for prompt in tiny_prompts[:4]:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(forward_logits(runner, prompt), ref, atol=PREFILL_ATOL,
                                   rtol=0)


def test_conflicting_flag_names_both(fp8_checkpoints):
    with pytest.raises(ValueError, match=r"model config \(fp8\).*argument \(gptq\)"):
        make_runner(fp8_checkpoints["llama"], dtype="float32", max_total_tokens=256,
                    quantization="gptq")
