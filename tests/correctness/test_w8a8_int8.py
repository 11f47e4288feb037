"""`--quantization w8a8_int8`: quality guards against the same model in float32.

Rules, and what was measured when they were set (torch 2.13, fbgemm, AVX512-VNNI):
- SmolLM2-135M (Q4_1 GGUF, dequantised, then int8): perplexity of the first 1100 tokens of
  docs/architecture.md, from the engine's prompt logprobs, within 3% of float32's.
  Measured 104.9 -> 106.8 (+1.8%); without SmoothQuant (runner/quant/smoothing.py) it was +4.4%.
- The capital question (greedy, 32 tokens): float32 answers "Paris"; int8 answers the same or
  first differs where float32 is at a near-tie (its first token is one: top three within
  0.38 nats).
- A tiny random llama (hidden 64, 3 layers, tied embeddings, init std 0.05), 16 prompts of
  1..80 tokens, 32 greedy tokens: at least 12 of the 16 sequences identical to float32's, and
  each other sequence first differs where float32's logit of the int8 token is within 0.05
  of its top (a near-tie within the int8 logit error, measured <= 0.04). Measured 15/16
  identical (over three seeds 14-15/16); the divergence gaps were <= 0.005.
  (The shared tiny fixtures, init std 0.2, amplify the ~8% int8 logit error through their
  layers: there 0-1 of 8 sequences stay identical over 32 tokens, so they are not used.)
- Smoothing alone (no int8) leaves every tiny architecture's logits unchanged: it only moves
  a per-channel factor from activations into weights.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from tests.conftest import TINY_ARCHS
from helpers.driver import greedy_generate
from helpers.runner import forward_logits, make_runner

# 8-bit activations (VNNI): +1.8% measured. Without VNNI kvstrata's AVX2 tile keeps 8 bits
# with fp32 activations (w8a8 + fp32 activations measured +2.1% on the VNNI box too): +3.0%
# on an AVX2-only EPYC (fp32 101.8 -> 104.8, 2026-12-04; fbgemm's 7 bits +3.9% there the same
# hour); the guard measures the dtype auto picks there, bf16 since session 30 (+1.1%).
# fbgemm's layer (no AVX2, or KVSTRATA_CPU_INT8_GEMM=onednn) keeps 7 bits (its int16
# saturation): a looser bound there, not a skip. On an AVX2-only EPYC the 7-bit result
# moves with float summation order alone: +4.8% to +7.2% for the same weights with two
# equally exact fp32 RMSNorm kernels, one in the calibration forward and the other serving,
# or both (2026-12-03); without smoothing it is +22%, which the bound must still catch.
PPL_MAX_RATIO = 1.03
PPL_MAX_RATIO_AVX2 = 1.05
PPL_MAX_RATIO_7BIT = 1.09
TIE_TOL = 0.05
ANSWER_TIE = 0.5  # nats; SmolLM2's answer opens at a measured 0.38-nat three-way tie
MIN_IDENTICAL = 12
# Under emulated AVX-512 (tests/helpers/emulated_isa.py) the VNNI flag is kvstrata's alone:
# fbgemm's and oneDNN's int8 code is this CPU's own, whose u8 x s8 pairs saturate at 8 bits.
LIBRARY_VNNI = not os.environ.get("KVSTRATA_EMULATED_ISA_DIR")


@pytest.fixture(scope="module")
def calm_tiny_llama(tmp_path_factory) -> str:
    import transformers as tf

    torch.manual_seed(1234)
    cfg = tf.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=88,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.05, rms_norm_eps=1e-6,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         tie_word_embeddings=True)
    path = str(tmp_path_factory.mktemp("calm_tiny_llama"))
    tf.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.parametrize("levels", [127, 63])  # 8-bit activations (VNNI) and the 7-bit fallback
def test_int8_linear_is_per_token_and_batch_independent(levels):
    """The fbgemm call equals int8 arithmetic done by hand (symmetric per-channel weights,
    symmetric per-token activations), and a row's result does not change when a row with
    100x larger values joins its batch."""
    from kvstrata.runner.quant.w8a8 import W8A8Int8Linear, cpu_has_vnni, quantized_linear

    if levels == 127 and not (cpu_has_vnni() and LIBRARY_VNNI):
        # Without VNNI fbgemm's u8*s8 pairs saturate int16 at 8 bits: the layer never picks
        # 127 there (W8A8Int8Linear.levels), so there is nothing to compare on this CPU.
        pytest.skip("8-bit activations need AVX512-VNNI / AVX-VNNI in fbgemm (this CPU has "
                    "neither, or only emulated)")
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 80), torch.randn(96)
    x = torch.randn(5, 80)
    layer = W8A8Int8Linear(weight, bias)
    layer.levels = levels
    w_scale = weight.abs().amax(1, keepdim=True) / 127
    x_scale = x.abs().amax(1, keepdim=True) / levels
    expected = ((x / x_scale).round() * x_scale) @ ((weight / w_scale).round() * w_scale).T
    got = quantized_linear(x, layer)
    torch.testing.assert_close(got, expected + bias, atol=1e-4, rtol=1e-4)
    loud = torch.cat([x, 100 * torch.randn(1, 80)])
    torch.testing.assert_close(quantized_linear(loud, layer)[:5], got, atol=1e-5, rtol=0)
    # Non-2-D and non-float32 inputs take the general path, same numbers.
    torch.testing.assert_close(layer(x[None]).squeeze(0), got)
    assert layer(x.double()).dtype == torch.float64


def _tiny_runner(path: str, quantization: str | None):
    return make_runner(path, page_size=16, max_total_tokens=8192, context_length=512,
                       max_running_requests=16, quantization=quantization)


def test_tiny_greedy_tokens_match_float32(calm_tiny_llama):
    from kvstrata.runner.quant.w8a8 import cpu_has_vnni

    if cpu_has_vnni() and not LIBRARY_VNNI:  # its layers (intermediate 88) are oneDNN's
        pytest.skip("emulated VNNI: the tiny model's int8 layers run oneDNN's AVX2 code")
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(1, 80))] for _ in range(16)]
    fp32, int8 = _tiny_runner(calm_tiny_llama, None), _tiny_runner(calm_tiny_llama, "w8a8_int8")
    ref = greedy_generate(fp32, prompts, 32)
    ours = greedy_generate(int8, prompts, 32)
    identical = 0
    for prompt, a, b in zip(prompts, ref, ours):
        if a == b:
            identical += 1
            continue
        step = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        logits = forward_logits(fp32, prompt + a[:step])[-1]
        gap = float(logits.max() - logits[b[step]])
        assert gap <= TIE_TOL, f"diverged at step {step} with a logit gap of {gap:.3g}"
    assert identical >= MIN_IDENTICAL, f"only {identical}/16 sequences identical"


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_smoothing_alone_keeps_the_logits(arch, tiny_checkpoints, tiny_prompts, monkeypatch):
    """Exact in float: qwen2's q/k/v biases, qwen3's q/k norms and untied heads included."""
    from kvstrata.runner.quant.smoothing import smooth_model

    # Smoothing rewrites plain float weights (as --quantization does, before packing them).
    monkeypatch.setenv("KVSTRATA_CPU_PACKED_LINEAR", "0")
    runner = _tiny_runner(tiny_checkpoints[arch], None)
    before = [forward_logits(runner, p) for p in tiny_prompts]
    model = runner.model
    head_scale = smooth_model(model, tiny_prompts[-1])
    assert not torch.allclose(head_scale, torch.ones_like(head_scale))  # it did something
    if model.lm_head is model.embed:
        delattr(model, "lm_head")
        model.lm_head = model.embed * head_scale
    else:
        model.lm_head.data.mul_(head_scale)
    for prompt, ref in zip(tiny_prompts, before):
        torch.testing.assert_close(forward_logits(runner, prompt), ref, atol=2e-4, rtol=1e-4)


def test_server_info_says_what_ran_and_weights_shrink(calm_tiny_llama):
    from kvstrata import LLM
    from kvstrata.runner.quant.w8a8 import int8_kernel

    # oneDNN's int8 linear or kvstrata's GEMM with VNNI; without, kvstrata's AVX2 tile where a
    # weight fits it (a per-weight choice, fbgemm's layer for the rest); else fbgemm
    layer_cls, kernel = int8_kernel()
    if not isinstance(layer_cls, type):
        from kvstrata.runner.quant.w8a8 import Int8MatmulLinear, W8A8Int8Linear
        layer_cls = (Int8MatmulLinear, W8A8Int8Linear)

    with LLM(model_path=calm_tiny_llama, skip_tokenizer_init=True, max_total_tokens=1024,
             quantization="w8a8_int8") as llm:
        info = llm.server_info()
        model = llm.engine.runner.model
        out = llm.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4,
                                                                 "temperature": 0})
    assert info["quantization"] == "w8a8_int8"
    q = info["quantization_info"]
    assert q["kernel"] == kernel
    # 8 bits with VNNI; without, kvstrata's AVX2 tile takes the layers (8 bits) and the
    # 300-row output head too (300 % 16: padded with zero rows to 304), else fbgemm's (7 bits)
    from kvstrata.runner.cpu import int8_linear
    from kvstrata.runner.quant.w8a8 import cpu_has_vnni
    own = cpu_has_vnni() or int8_linear.avx2_gemm_available()
    assert q["activation_bits"] == (8 if own else 7)
    if not cpu_has_vnni() and int8_linear.avx2_gemm_available():
        assert model.lm_head.own and model.lm_head.pad == 4
        assert all(getattr(layer, name).own for layer in model.layers
                   for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"))
    assert q["smoothing"].startswith("none")  # a bare checkpoint has no tokenizer
    assert q["weight_bytes"] < q["weight_bytes_float"]
    # Every linear layer is int8, the output projection included; the lookup stays float.
    assert all(isinstance(getattr(layer, name), layer_cls) for layer in model.layers
               for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"))
    assert isinstance(model.lm_head, layer_cls)
    assert model.embed.dtype == torch.float32 and len(out["output_ids"]) == 4
    from kvstrata.runner.cpu import packed_linear
    with LLM(model_path=calm_tiny_llama, skip_tokenizer_init=True, max_total_tokens=1024) as llm:
        info = llm.server_info()
        # Without --quantization: float32 weights, prepacked for oneDNN (runner/cpu/packed_linear.py)
        assert llm.engine.runner.model.linear is packed_linear.packed_linear
    assert info["quantization"] is None
    assert info["quantization_info"]["quantization"] is None
    assert info["quantization_info"]["kernel"] == packed_linear.KERNEL


def _auto_dtype_here(**server_args) -> str:
    """What `--dtype auto` picks on this CPU (the suite pins auto to float32 for its fp32
    references; the w8a8 guard measures what a user of this machine gets: bf16 activations
    on AVX512-BF16 / AMX and on AVX2 without AVX-512 up to 2 threads, where w8a8 in bf16
    measured +1.1% on an AVX2-only EPYC, 2026-12-04)."""
    from kvstrata import envs
    from kvstrata.config import ServerArgs, resolve
    from kvstrata.platform import detect_platform

    env = {**envs.snapshot(), "KVSTRATA_CPU_AUTO_DTYPE": ""}
    return resolve(ServerArgs(device="cpu", **server_args), detect_platform(), env=env)[0].dtype


@pytest.mark.slow
def test_smollm2_perplexity_and_paris(smollm2_gguf_path, shared_tmp_dir):
    from helpers.smollm2_quality import first_difference, float32_reference, measure

    fp32 = float32_reference(smollm2_gguf_path, shared_tmp_dir)
    dtype = _auto_dtype_here(quantization="w8a8_int8")
    int8 = measure(smollm2_gguf_path, answers=1, quantization="w8a8_int8", dtype=dtype)
    print(f"w8a8 in {dtype} (auto's choice here): perplexity {int8['ppl']:.2f} against "
          f"float32's {fp32['ppl']:.2f}")
    assert fp32["n"] == int8["n"] >= 1024
    from kvstrata.runner.quant.w8a8 import cpu_has_vnni
    ratio = int8["ppl"] / fp32["ppl"]
    bits = int8["info"]["quantization_info"]["activation_bits"]
    bound = (PPL_MAX_RATIO if cpu_has_vnni() else PPL_MAX_RATIO_AVX2 if bits == 8
             else PPL_MAX_RATIO_7BIT)
    assert ratio <= bound, (fp32["ppl"], int8["ppl"])
    ref, got = fp32["answers"][0], int8["answers"][0]  # "What is the capital of France?"
    assert "Paris" in ref["text"], ref["text"]
    # The answer's first token is a near-tie in float32 itself (top three within 0.38 nats:
    # "The" -1.88, -1.96, "La" -2.27), so int8 -- or any change of float summation order,
    # e.g. the attention kernel's ISA -- may open the answer differently ("La femme de
    # France ..." on an AMX Xeon, "L'Alcazebula ..." with 7-bit activations on an AVX2
    # EPYC). Asserted: int8 answers like float32, or its first different token is within
    # ANSWER_TIE nats of float32's top there.
    diff = first_difference(got, ref)
    if diff is not None:
        print(f"w8a8 answer {got['text']!r} differs at token {diff[0]}, fp32 gap {diff[1]:.3f}")
        assert diff[1] < ANSWER_TIE, (ref["text"], got["text"], diff[1])
    q = int8["info"]["quantization_info"]
    assert q["smoothing"].startswith("SmoothQuant")
    assert q["weight_bytes"] < 0.75 * q["weight_bytes_float"]
