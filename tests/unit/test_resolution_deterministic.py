"""Step 8: deterministic inference (config/rules/deterministic.py): the kernels it pins are
Resolutions (what `kvstrata config --explain` lists), and what it cannot honour is refused by
name rather than served non-deterministically."""
from __future__ import annotations

import pytest

from kvstrata.config import ModelInfo, ServerArgs, resolve
from kvstrata.config.rules import deterministic
from kvstrata.platform import simulated


def run(platform: str = "cpu", model_info: ModelInfo | None = None, **kwargs):
    resolved, res = resolve(ServerArgs(**kwargs), simulated(platform), model_info or ModelInfo(),
                            env={})
    return resolved, {r.field: r for r in res}


def test_the_flag_records_the_pinned_kernels():
    resolved, res = run(enable_deterministic_inference=True)
    assert resolved.deterministic_linear_kernel == deterministic.LINEAR_KERNEL
    assert resolved.deterministic_attention_kernel == deterministic.ATTENTION_KERNEL
    for field in ("deterministic_linear_kernel", "deterministic_attention_kernel"):
        assert res[field].rule == "deterministic.kernels" and res[field].reason


def test_off_by_default_changes_nothing():
    resolved, res = run()
    assert resolved.deterministic_linear_kernel is None
    assert not [f for f in res if f.startswith("deterministic")]
    resolved, res = run(disable_deterministic_inference=True)
    assert resolved.deterministic_attention_kernel is None


@pytest.mark.parametrize("kwargs,platform,info,message", [
    (dict(disable_deterministic_inference=True), "cpu", None, "contradict each other"),
    ({}, "cuda", None, "not implemented yet on cuda"),
    (dict(device="cuda"), "cuda", None, "not implemented yet on cuda"),
    # an MLA model of another type than DeepSeek's (deepseek_fixed.py pins those)
    ({}, "cpu", ModelInfo(kv_pool_kind="mla", uses_dsa=True),
     "not implemented yet for an MLA model of type unknown"),
    ({}, "cpu", ModelInfo.from_hf_config({"model_type": "minicpm3", "kv_lora_rank": 256}),
     "not implemented yet for an MLA model of type unknown"),
    ({}, "cpu", ModelInfo(has_recurrent_state=True), "not implemented yet for a recurrent"),
    # a MoE family whose experts the fixed GEMM does not pin (moe_decoder.py's and gpt-oss's are)
    ({}, "cpu", ModelInfo.from_hf_config({"model_type": "olmoe", "num_experts": 8}),
     "not implemented yet for a MoE model of type olmoe"),
])
def test_what_it_cannot_honour_is_refused_by_name(kwargs, platform, info, message):
    with pytest.raises(ValueError, match="--enable-deterministic-inference") as err:
        run(platform, info, enable_deterministic_inference=True, **kwargs)
    assert message in str(err.value)


AVX2 = ("avx2", "fma", "f16c")


def on_cpu(flags, model_info: ModelInfo | None = None, **kwargs):
    resolved, res = resolve(ServerArgs(**kwargs), simulated("cpu", cpu_flags=flags, cpu_threads=2),
                            model_info, env={})
    return resolved, {r.field: r for r in res}


def test_on_by_default_where_measured_free():
    """An AVX2 CPU without AVX-512 at bf16 (its --dtype auto at 2 threads): on, with the
    measured reason; every other case keeps it opt-in."""
    resolved, res = on_cpu(AVX2, dtype="bfloat16")
    assert resolved.enable_deterministic_inference is True
    assert res["enable_deterministic_inference"].rule == "deterministic.cpu_default"
    assert "0.997x" in res["enable_deterministic_inference"].reason
    assert resolved.deterministic_linear_kernel == deterministic.LINEAR_KERNEL
    resolved, res = on_cpu(AVX2)  # --dtype auto resolves to bf16 there first
    assert resolved.dtype == "bfloat16" and resolved.enable_deterministic_inference


def test_on_by_default_at_bf16_on_avx512_bf16_without_amx():
    """AVX-512 BF16 without AMX at bf16 (its --dtype auto): on, measured within 5% there;
    with AMX (measured 0.89x) and at fp32 it stays opt-in."""
    flags = AVX2 + ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
    resolved, res = on_cpu(flags, dtype="bfloat16")
    assert resolved.enable_deterministic_inference is True
    assert res["enable_deterministic_inference"].rule == "deterministic.cpu_default"
    assert "1.070x" in res["enable_deterministic_inference"].reason
    for other, kwargs in ((flags + ("amx_bf16",), dict(dtype="bfloat16")),
                          (flags, dict(dtype="float32"))):
        assert on_cpu(other, **kwargs)[0].enable_deterministic_inference is False


@pytest.mark.parametrize("flags,info,kwargs", [
    (AVX2, None, dict(dtype="float32")),                          # measured 0.91x
    (AVX2 + ("avx512f", "avx512_bf16", "amx_bf16"), None, dict(dtype="bfloat16")),  # 0.89x
    (AVX2, None, dict(dtype="bfloat16", disable_deterministic_inference=True)),
    (AVX2, ModelInfo(kv_pool_kind="mla", uses_dsa=True), dict(dtype="bfloat16")),
    # DeepSeek MLA / DSA: pinned by the flag, their cost not measured
    (AVX2, ModelInfo.from_hf_config({"model_type": "deepseek_v3", "kv_lora_rank": 512,
                                     "n_routed_experts": 8}), dict(dtype="bfloat16")),
    (AVX2, ModelInfo(softmax_extras=("attention sinks",)), dict(dtype="bfloat16")),
    # Gemma 2's soft-cap: the flag runs it (below), its cost there is not measured
    (AVX2, ModelInfo(softmax_extras=("attention logit soft-capping",)), dict(dtype="bfloat16")),
    (AVX2, None, dict(dtype="bfloat16", quantization="w8a8_int8")),
    (AVX2, ModelInfo(quant_method="gptq"), dict(dtype="bfloat16")),  # taken, not measured
    (AVX2, ModelInfo(quant_method="fp8"), dict(dtype="bfloat16")),
    # MoE experts: pinned by the flag, but their cost is not measured
    (AVX2, ModelInfo.from_hf_config({"model_type": "qwen3_moe", "num_experts": 8}),
     dict(dtype="bfloat16")),
    (AVX2, ModelInfo.from_hf_config({"model_type": "glm4_moe", "n_routed_experts": 8}),
     dict(dtype="bfloat16")),
    ((), None, dict(dtype="bfloat16")),                           # no AVX2
])
def test_opt_in_elsewhere(flags, info, kwargs):
    resolved, res = on_cpu(flags, info, **kwargs)
    assert resolved.enable_deterministic_inference is False
    assert "enable_deterministic_inference" not in res


@pytest.mark.parametrize("ablation", deterministic.ABLATIONS)
def test_a_kernel_ablation_keeps_the_default_off_and_refuses_the_flag(ablation):
    env = {ablation: False}
    resolved, _ = resolve(ServerArgs(dtype="bfloat16"), simulated("cpu", cpu_flags=AVX2), None,
                          env=env)
    assert resolved.enable_deterministic_inference is False
    with pytest.raises(ValueError, match=f"{ablation}=0 turns off"):
        resolve(ServerArgs(enable_deterministic_inference=True), simulated("cpu"), None, env=env)


def test_w8a8_int8_keeps_the_default_off_and_takes_the_flag():
    """w8a8_int8's own int8 GEMM is batch-invariant as it stands (the load checks each layer:
    test_batch_invariance.py), so the flag is honoured; its cost is unmeasured, so it stays
    opt-in, for the target's quantization and a quantized draft's alike."""
    draft = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="smollm2-135m",
                 speculative_draft_model_quantization="w8a8_int8")
    for kw, kernel in ((dict(quantization="w8a8_int8"), deterministic.INT8_LINEAR_KERNEL),
                       (draft, deterministic.LINEAR_KERNEL)):
        resolved, _ = on_cpu(AVX2, dtype="bfloat16", **kw)
        assert resolved.enable_deterministic_inference is False
        resolved, _ = on_cpu(AVX2, dtype="bfloat16", enable_deterministic_inference=True, **kw)
        assert resolved.deterministic_linear_kernel == kernel


AVX512 = AVX2 + ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_bf16")
GGUF = "/nonexistent/model-Q4_1.gguf"


def test_on_by_default_for_gguf_kept_packed_where_measured_free():
    """--quantization gguf at --dtype auto (float32) or bf16 on an AVX-512 CPU: on, with the
    measured reason; at fp16, on an AVX2-only CPU (not measured packed), with the flag off and
    with a packed draft beside it: off."""
    resolved, res = on_cpu(AVX512, model_path=GGUF, quantization="gguf")
    assert resolved.dtype == "float32" and resolved.enable_deterministic_inference is True
    assert res["enable_deterministic_inference"].rule == "deterministic.cpu_default"
    assert "0.994x" in res["enable_deterministic_inference"].reason
    assert resolved.deterministic_linear_kernel == deterministic.PACKED_LINEAR_KERNEL
    resolved, _ = on_cpu(AVX512, model_path=GGUF, quantization="gguf", dtype="bfloat16")
    assert resolved.enable_deterministic_inference is True
    for flags, kw in ((AVX512, dict(dtype="float16")), (AVX2, {}),
                      (AVX512, dict(disable_deterministic_inference=True)),
                      (AVX512, dict(speculative_algorithm="STANDALONE",
                                    speculative_draft_model_path=GGUF,
                                    speculative_draft_model_quantization="gguf"))):
        resolved, _ = on_cpu(flags, model_path=GGUF, quantization="gguf", **kw)
        assert resolved.enable_deterministic_inference is False, (flags, kw)


@pytest.mark.parametrize("info,kwargs,kernel", [
    (ModelInfo(quant_method="gptq"), {}, deterministic.PACKED_LINEAR_KERNEL),
    (ModelInfo(quant_method="gptq"), dict(quantization="gptq_marlin"),
     deterministic.PACKED_LINEAR_KERNEL),
    (ModelInfo(quant_method="awq"), dict(quantization="awq"), deterministic.PACKED_LINEAR_KERNEL),
    (ModelInfo(quant_method="compressed-tensors"), {}, deterministic.PACKED_LINEAR_KERNEL),
    (ModelInfo(quant_method="fp8"), dict(quantization="fp8"), deterministic.LINEAR_KERNEL),
])
def test_quantized_checkpoints_take_the_flag(info, kwargs, kernel):
    """GPTQ / AWQ / compressed-tensors run packed on the batch-invariant GGUF kernels, their
    float parts on the fixed GEMM (runner/quant/gguf_pinned.py); FP8 is dequantized at load
    and runs as a float model. The flag names what runs."""
    resolved, _ = on_cpu(AVX2, info, dtype="bfloat16", enable_deterministic_inference=True,
                         **kwargs)
    assert resolved.deterministic_linear_kernel == kernel


@pytest.mark.parametrize("cfg", [
    {"model_type": "qwen3_moe", "num_experts": 8},
    {"model_type": "qwen2_moe", "num_experts": 8},
    {"model_type": "mixtral", "num_local_experts": 8, "sliding_window": 4096},
    {"model_type": "glm4_moe", "n_routed_experts": 8},
    # gpt-oss: experts pinned the same way, its sinks in the decode kernel's softmax
    {"model_type": "gpt_oss", "num_local_experts": 8, "sliding_window": 128},
])
def test_moe_decoder_families_take_the_flag_and_keep_the_default_off(cfg):
    """moe_decoder.py's MoE families: the router and every expert on the fixed GEMM
    (runner/cpu/fixed_experts.py), so the flag is honoured; its cost is not measured, so the
    CPU default stays off for them (test_opt_in_elsewhere)."""
    info = ModelInfo.from_hf_config(cfg)
    assert info.routed_experts == cfg["model_type"]
    assert cfg["model_type"] in deterministic.PINNED_MOE_FAMILIES
    resolved, res = run(model_info=info, enable_deterministic_inference=True)
    assert resolved.deterministic_linear_kernel == deterministic.LINEAR_KERNEL
    assert resolved.deterministic_attention_kernel == deterministic.ATTENTION_KERNEL
    resolved, _ = on_cpu(AVX2, info, dtype="bfloat16")
    assert resolved.enable_deterministic_inference is False


def test_sliding_window_models_are_mha_and_deterministic():
    """A sliding window is applied by the attention backend over the ordinary pool, which
    keeps every token's KV: such a model is "mha" (not a KV-dropping "swa" pool) and
    deterministic inference covers it (each query's kernel range begins W keys back)."""
    for cfg in ({"model_type": "mistral", "sliding_window": 4096},
                {"model_type": "qwen2", "sliding_window": 32, "use_sliding_window": True,
                 "layer_types": ["full_attention", "sliding_attention"]},
                {"model_type": "gemma3_text", "sliding_window": 512,
                 "layer_types": ["sliding_attention", "full_attention"]}):
        info = ModelInfo.from_hf_config(cfg)
        assert info.kv_pool_kind == "mha" and not info.softmax_extras, cfg
        resolved, _ = run(model_info=info, enable_deterministic_inference=True)
        assert resolved.deterministic_attention_kernel == deterministic.ATTENTION_KERNEL


def test_soft_capped_attention_runs_in_the_decode_kernel():
    """Gemma 2 (soft-capped logits, windows): the flag pins its kernels like any dense model's,
    the soft-cap in the paged decode kernel's softmax; not on by default."""
    info = ModelInfo.from_hf_config({"model_type": "gemma2", "sliding_window": 4096,
                                     "attn_logit_softcapping": 50.0})
    assert info.softmax_extras == ("attention logit soft-capping",)
    resolved, _ = run("cpu", info, enable_deterministic_inference=True)
    assert resolved.deterministic_attention_kernel == deterministic.ATTENTION_KERNEL
    resolved, _ = on_cpu(AVX2, info, dtype="bfloat16")
    assert not resolved.enable_deterministic_inference


@pytest.mark.parametrize("cfg,attention", [
    ({"model_type": "deepseek_v3", "kv_lora_rank": 512, "n_routed_experts": 256},
     deterministic.MLA_ATTENTION_KERNEL),
    ({"model_type": "deepseek_v2", "kv_lora_rank": 512, "n_routed_experts": 160},
     deterministic.MLA_ATTENTION_KERNEL),
    ({"model_type": "kimi_k2", "kv_lora_rank": 512, "n_routed_experts": 384},
     deterministic.MLA_ATTENTION_KERNEL),
    ({"model_type": "deepseek_v32", "kv_lora_rank": 512, "n_routed_experts": 256,
      "index_topk": 2048}, deterministic.DSA_ATTENTION_KERNEL),
])
def test_deepseek_mla_and_dsa_take_the_flag_and_keep_the_default_off(cfg, attention):
    """DeepSeek's MLA (and V3.2's DSA indexer): the attention, indexer, projections and
    experts pinned (runner/models/deepseek_fixed.py, runner/attention/mla_fixed.py); the
    explain text names them; not on by default (cost not measured)."""
    info = ModelInfo.from_hf_config(cfg)
    assert info.kv_pool_kind == "mla" and info.uses_dsa == ("index_topk" in cfg)
    resolved, res = run(model_info=info, enable_deterministic_inference=True)
    assert resolved.deterministic_attention_kernel == attention
    assert resolved.deterministic_linear_kernel == deterministic.MLA_LINEAR_KERNEL
    assert "indexer" in res["deterministic_attention_kernel"].reason
    resolved, _ = on_cpu(AVX2, info, dtype="bfloat16")
    assert resolved.enable_deterministic_inference is False


def _hybrid(config, arch: str) -> ModelInfo:
    return ModelInfo.from_hf_config({**config.to_dict(), "architectures": [arch]})


def _hybrids() -> dict:
    import transformers as T
    return {
        "qwen3_5": _hybrid(T.Qwen3_5TextConfig(num_hidden_layers=4), "Qwen3_5ForCausalLM"),
        "qwen3_next": _hybrid(T.Qwen3NextConfig(num_hidden_layers=4), "Qwen3NextForCausalLM"),
        "nemotron_h": _hybrid(T.NemotronHConfig(hybrid_override_pattern="M*M-",
                                                num_hidden_layers=4), "NemotronHForCausalLM"),
        "mamba2": _hybrid(T.Mamba2Config(num_hidden_layers=2), "Mamba2ForCausalLM"),
        "granite": _hybrid(T.GraniteMoeHybridConfig(layer_types=["mamba", "attention"],
                                                    num_hidden_layers=2),
                           "GraniteMoeHybridForCausalLM"),
        "falcon_h1": _hybrid(T.FalconH1Config(num_hidden_layers=2), "FalconH1ForCausalLM"),
        "nemotron_h_moe": _hybrid(T.NemotronHConfig(hybrid_override_pattern="ME*E",
                                                    num_hidden_layers=4),
                                  "NemotronHForCausalLM"),
        "qwen3_5_moe": _hybrid(T.Qwen3_5MoeTextConfig(num_hidden_layers=4),
                               "Qwen3_5MoeForCausalLM"),
        # a name the pinned path does not know (the multimodal wrapper's)
        "qwen3_5_moe_vl": _hybrid(T.Qwen3_5MoeTextConfig(num_hidden_layers=4),
                                  "Qwen3_5MoeForConditionalGeneration"),
    }


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next", "nemotron_h", "mamba2", "granite",
                                  "falcon_h1", "nemotron_h_moe", "qwen3_5_moe"])
def test_recurrent_hybrids_take_the_flag_and_keep_the_default_off(name):
    """hybrid_fixed.py's models: the flag records their recurrent kernel beside the GEMM and
    attention; the default stays off where it is on for a dense model (AVX2, bf16)."""
    info = _hybrids()[name]
    resolved, res = run("cpu", info, enable_deterministic_inference=True)
    assert resolved.deterministic_recurrent_kernel == deterministic.RECURRENT_KERNEL
    assert res["deterministic_recurrent_kernel"].rule == "deterministic.kernels"
    assert "snapshot" in res["deterministic_recurrent_kernel"].reason
    assert resolved.deterministic_linear_kernel == deterministic.LINEAR_KERNEL
    resolved, res = on_cpu(AVX2, info, dtype="bfloat16")
    assert resolved.enable_deterministic_inference is False
    assert resolved.deterministic_recurrent_kernel is None


@pytest.mark.parametrize("name,kwargs,env,message", [
    ("qwen3_5_moe_vl", {}, {}, "(Qwen3_5MoeForConditionalGeneration; built for"),
    ("granite", dict(tp_size=2), {}, "--tp-size 2 on a recurrent model"),
    ("qwen3_5", dict(speculative_algorithm="NGRAM"), {}, "--speculative-algorithm NGRAM"),
    ("nemotron_h", {}, {"KVSTRATA_CPU_RECURRENT_STEP": False},
     "KVSTRATA_CPU_RECURRENT_STEP=0 turns off"),
])
def test_unbuilt_recurrent_combinations_are_refused_by_name(name, kwargs, env, message):
    with pytest.raises(ValueError, match="--enable-deterministic-inference") as err:
        resolve(ServerArgs(enable_deterministic_inference=True, **kwargs), simulated("cpu"),
                _hybrids()[name], env=env)
    assert message in str(err.value)
