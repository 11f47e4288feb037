"""config/gguf_config.py: the Gemma 2 / Gemma 3 config fields read from a GGUF file's metadata
the way llama.cpp reads them (what transformers' GGUF conversion drops), and the ModelInfo
resolution gets from a Gemma GGUF's header (its windows and soft-caps) without a conversion;
a GGUF of a recurrent arch that is not built refused by its arch; a gpt-oss file's config
(config/gguf_gpt_oss.py) with llama.cpp's defaults, and its keys not built refused by name;
a Nemotron-H file's layer kinds from its per-layer arrays (config/gguf_hybrid.py), and its
fields not built refused by name. tests/correctness/test_gemma_gguf.py, test_gpt_oss_gguf.py
and test_hybrid_gguf.py serve such files against transformers."""
from __future__ import annotations

import pytest

from kvstrata.config.gguf_config import gemma_fields


def meta(arch: str, **kv) -> dict:
    base = {"block_count": 6, "embedding_length": 64, "attention.head_count": 4,
            "attention.key_length": 16, "attention.sliding_window": 8}
    return {"general.architecture": arch, **{f"{arch}.{k.replace('__', '.')}": v
                                             for k, v in {**base, **kv}.items()}}


def test_other_archs_are_left_alone():
    assert gemma_fields({"general.architecture": "llama", "llama.block_count": 2}) == {}


def test_gemma2_with_llama_cpps_defaults():
    """No soft-cap, window or rope keys: llama.cpp's defaults (50 / 30, 4096, base 10000);
    layers alternate local / global; scale from head_dim."""
    m = meta("gemma2", block_count=4)
    del m["gemma2.attention.sliding_window"]
    f = gemma_fields(m)
    assert f["architectures"] == ["Gemma2ForCausalLM"]
    assert (f["attn_logit_softcapping"], f["final_logit_softcapping"]) == (50.0, 30.0)
    assert f["sliding_window"] == 4096 and f["query_pre_attn_scalar"] == 16
    assert f["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert f["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    f = gemma_fields(meta("gemma2", attn_logit_softcapping=3.0, final_logit_softcapping=15.0))
    assert (f["attn_logit_softcapping"], f["final_logit_softcapping"]) == (3.0, 15.0)


def test_gemma3_rope_and_layers():
    f = gemma_fields(meta("gemma3", block_count=12, rope__freq_base=1e6,
                          rope__scaling__type="linear", rope__scaling__factor=8.0))
    assert f["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 2
    assert f["rope_parameters"] == {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_theta": 1e6, "rope_type": "linear", "factor": 8.0}}
    assert f["final_logit_softcapping"] is None and f["attn_logit_softcapping"] is None
    f = gemma_fields(meta("gemma3", rope__freq_base_swa=5000.0, final_logit_softcapping=30.0))
    assert f["rope_parameters"]["sliding_attention"]["rope_theta"] == 5000.0
    assert f["rope_parameters"]["full_attention"]["rope_type"] == "default"
    assert f["final_logit_softcapping"] == 30.0
    with pytest.raises(ValueError, match="rope.scaling.type 'yarn' is not supported"):
        gemma_fields(meta("gemma3", rope__scaling__type="yarn"))
    m = meta("gemma3")
    del m["gemma3.attention.sliding_window"]
    with pytest.raises(ValueError, match="sliding_window"):
        gemma_fields(m)


@pytest.mark.parametrize("arch,layers", [("gemma2", 46), ("gemma3", 62)])
def test_the_27b_attention_scale(arch, layers):
    """llama.cpp: 1/sqrt(n_embd / n_head) for a 27B model (by its layer count), whose
    query_pre_attn_scalar is not its head_dim (Gemma 3 27B: 5376 / 32 = 168, head_dim 128)."""
    m = meta(arch, block_count=layers, embedding_length=5376, attention__head_count=32,
             attention__key_length=128)
    assert gemma_fields(m)["query_pre_attn_scalar"] == 168
    assert gemma_fields({**m, f"{arch}.block_count": layers - 2}
                        )["query_pre_attn_scalar"] == 128


def test_a_named_sliding_window_pattern():
    f = gemma_fields(meta("gemma3", block_count=4, attention__sliding_window_pattern=2))
    assert f["layer_types"] == ["sliding_attention", "full_attention"] * 2
    f = gemma_fields(meta("gemma3", block_count=3,
                          attention__sliding_window_pattern=[True, False, True]))
    assert f["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert set(gemma_fields(meta("gemma3", attention__sliding_window_pattern=0)
                            )["layer_types"]) == {"sliding_attention"}
    with pytest.raises(ValueError, match="2 entries for 6 layers"):
        gemma_fields(meta("gemma3", attention__sliding_window_pattern=[True, False]))


def test_model_info_from_a_gemma_gguf_header(tmp_path):
    """Resolution sees a Gemma GGUF's windows (so hybrid SWA memory is on for it) and Gemma
    2's soft-capping, from the header alone; other GGUFs stay None (a plain MHA model)."""
    gguf = pytest.importorskip("gguf")
    from kvstrata.config import ModelInfo

    def write(arch, **keys):
        path = tmp_path / f"{arch}.gguf"
        w = gguf.GGUFWriter(str(path), arch)
        for key, value in keys.items():
            (w.add_float32 if isinstance(value, float) else w.add_uint32)(
                f"{arch}.{key.replace('__', '.')}", value)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return str(path)

    dims = dict(block_count=4, embedding_length=64, attention__head_count=4,
                attention__sliding_window=8)
    info = ModelInfo.from_model_path(write("gemma2", attn_logit_softcapping=3.0, **dims))
    assert info.layer_windows == (8, None, 8, None)
    assert "attention logit soft-capping" in info.softmax_extras
    info = ModelInfo.from_model_path(write("gemma3", **{**dims, "block_count": 6}))
    assert info.layer_windows == (8,) * 5 + (None,) and not info.softmax_extras
    assert ModelInfo.from_model_path(write("llama", block_count=2)) is None


@pytest.mark.parametrize("arch", ["mamba", "jamba"])
def test_a_recurrent_gguf_is_refused_by_name(tmp_path, arch):
    """A GGUF of a recurrent arch that is not built (all but mamba2, nemotron_h,
    nemotron_h_moe, granitehybrid, qwen35, qwen35moe, qwen3next and falcon-h1:
    config/gguf_hybrid.py)
    is refused at resolution
    (ModelInfo reads the header) and at load (before transformers' conversion), naming the
    arch and the way out."""
    gguf = pytest.importorskip("gguf")
    from kvstrata.config import ModelInfo
    from kvstrata.config.model_source import gguf_metadata_dir, resolve_model_path

    path = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", 2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    why = (f"GGUF {arch} .*recurrent .* state is built from GGUF files of llama.cpp's mamba2, "
           f"nemotron_h, nemotron_h_moe, granitehybrid, qwen35, qwen35moe, qwen3next and "
           f"falcon-h1 archs only.* HF safetensors")
    with pytest.raises(ValueError, match=why):
        ModelInfo.from_model_path(str(path))
    with pytest.raises(ValueError, match=why):
        gguf_metadata_dir(resolve_model_path(str(path)))


def oss(**kv) -> dict:
    base = {"block_count": 4, "embedding_length": 64, "attention.head_count": 4,
            "attention.head_count_kv": 2, "attention.sliding_window": 8,
            "attention.layer_norm_rms_epsilon": 1e-5, "feed_forward_length": 64,
            "expert_count": 4, "expert_used_count": 2, "rope.freq_base": 150000.0,
            "rope.scaling.type": "yarn", "rope.scaling.factor": 32.0,
            "rope.scaling.original_context_length": 4096}
    return {"general.architecture": "gpt-oss",
            **{f"gpt-oss.{k.replace('__', '.')}": v for k, v in {**base, **kv}.items()}}


def test_gpt_oss_with_llama_cpps_defaults():
    """gpt-oss: even layers windowed (llama.cpp's period 2), head_dim n_embd / n_head, the
    experts' width from feed_forward_length without expert_feed_forward_length, YaRN betas
    32 / 1, transformers' untruncated ramp, SwiGLU limit 7."""
    from kvstrata.config.gguf_config import arch_fields

    f = arch_fields(oss())
    assert f["architectures"] == ["GptOssForCausalLM"] and f["model_type"] == "gpt_oss"
    assert f["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert (f["head_dim"], f["intermediate_size"], f["swiglu_limit"]) == (16, 64, 7.0)
    assert f["rope_parameters"] == {
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
        "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False}
    f = arch_fields(oss(attention__sliding_window_pattern=[False, True, True, False],
                        expert_feed_forward_length=32, rope__scaling__type="none"))
    assert f["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention",
                                "full_attention"]
    assert f["intermediate_size"] == 32
    assert f["rope_parameters"] == {"rope_type": "default", "rope_theta": 150000.0}


@pytest.mark.parametrize("kv,match", [
    ({"attention__sliding_window": None}, "attention.sliding_window"),
    ({"rope__freq_base_swa": 10000.0}, "rope.freq_base_swa"),
    ({"rope__scaling__yarn_attn_factor": 1.0}, "yarn_attn_factor"),
    ({"rope__scaling__yarn_ext_factor": 0.5}, "yarn_ext_factor"),
    ({"rope__scaling__type": "linear"}, "rope.scaling.type 'linear'"),
    ({"rope__dimension_count": 8}, "rope.dimension_count 8"),
    ({"attention__value_length": 32}, "value_length 32"),
    ({"expert_weights_scale": 2.5}, "expert_weights_scale 2.5")])
def test_gpt_oss_keys_not_built_are_refused_by_name(kv, match):
    from kvstrata.config.gguf_config import arch_fields

    meta = {k: v for k, v in oss(**kv).items() if v is not None}
    with pytest.raises(ValueError, match=match):
        arch_fields(meta)


NEMOTRON = {"general.architecture": "nemotron_h", "nemotron_h.block_count": 3,
            "nemotron_h.embedding_length": 64, "nemotron_h.ssm.inner_size": 32,
            "nemotron_h.ssm.time_step_rank": 4, "nemotron_h.ssm.group_count": 2,
            "nemotron_h.ssm.conv_kernel": 4, "nemotron_h.ssm.state_size": 16,
            "nemotron_h.attention.layer_norm_rms_epsilon": 1e-5,
            "nemotron_h.attention.head_count": 4, "nemotron_h.attention.key_length": 16,
            "nemotron_h.attention.head_count_kv": [0, 2, 0],
            "nemotron_h.feed_forward_length": [0, 0, 24]}


@pytest.mark.parametrize("change,match", [
    ({}, None),
    ({"nemotron_h.feed_forward_length": [0, 8, 0]}, "layer 1 has both K/V heads"),
    ({"nemotron_h.attention.head_count_kv": [1, 2, 0]}, "head_count_kv differs"),
    ({"nemotron_h.attention.value_length": 8}, "value_length 8 != key_length 16"),
    ({"nemotron_h.ssm.dt_b_c_rms": True}, "dt_b_c_rms"),
    ({"nemotron_h.ssm.time_step_rank": 3}, "not a whole number"),
    ({"nemotron_h.feed_forward_length": [0, 0]}, "2 entries for 3 layers"),
], ids=["builds", "attention-and-mlp", "kv-heads-vary", "value-length", "dt-b-c-rms",
        "heads", "short-array"])
def test_nemotron_h_layers_from_the_header(change, match):
    """llama.cpp's rule: no K/V heads and no feed-forward length = Mamba2, K/V heads =
    attention, a feed-forward length = the MLP; what this model does not build is refused."""
    from kvstrata.config.gguf_hybrid import hybrid_fields

    dims = {"token_embd.weight": (64, 100)}
    if match is None:
        fields = hybrid_fields({**NEMOTRON, **change}, dims)
        assert fields["layers_block_type"] == ["linear_attention", "full_attention", "mlp"]
        assert (fields["num_attention_heads"], fields["num_key_value_heads"],
                fields["head_dim"], fields["intermediate_size"]) == (4, 2, 16, 24)
        assert (fields["mamba_num_heads"], fields["mamba_head_dim"], fields["vocab_size"],
                fields["tie_word_embeddings"]) == (4, 8, 100, True)
        assert "max_position_embeddings" not in fields  # none in the file
        return
    with pytest.raises(ValueError, match=match):
        hybrid_fields({**NEMOTRON, **change}, dims)


GRANITE = {"general.architecture": "granitehybrid", "granitehybrid.block_count": 2,
           "granitehybrid.embedding_length": 64, "granitehybrid.ssm.inner_size": 128,
           "granitehybrid.ssm.time_step_rank": 4, "granitehybrid.ssm.group_count": 2,
           "granitehybrid.ssm.conv_kernel": 4, "granitehybrid.ssm.state_size": 16,
           "granitehybrid.attention.layer_norm_rms_epsilon": 1e-5,
           "granitehybrid.attention.head_count": 4,
           "granitehybrid.attention.head_count_kv": [0, 2],
           "granitehybrid.expert_count": 4, "granitehybrid.expert_used_count": 2}
GRANITE_DIMS = {"token_embd.weight": (64, 100), "output.weight": (64, 100),
                "blk.0.ffn_gate_exps.weight": (64, 40, 4),
                "blk.0.ffn_gate_shexp.weight": (64, 56)}


@pytest.mark.parametrize("change,match", [
    ({}, None),
    ({"granitehybrid.rope.scaling.type": "linear"}, "rope.scaling.type 'linear'"),
    ({"granitehybrid.rope.dimension_count": 8}, "rope.dimension_count 8"),
    ({"granitehybrid.attention.key_length": 8}, "key_length 8 x 4 heads"),
], ids=["builds", "rope-scaling", "partial-rope", "head-size"])
def test_granite_hybrid_from_the_header(change, match):
    """llama.cpp's granitehybrid: K/V heads = attention, else Mamba2; rope unless
    rope.scaling.finetuned is false; absent multipliers applied as llama.cpp does (none; the
    attention's 1/sqrt(head size)); MLP widths from the tensors."""
    from kvstrata.config.gguf_hybrid import hybrid_fields

    if match is not None:
        with pytest.raises(ValueError, match=match):
            hybrid_fields({**GRANITE, **change}, GRANITE_DIMS)
        return
    fields = hybrid_fields(GRANITE, GRANITE_DIMS)
    assert fields["layer_types"] == ["mamba", "attention"]
    assert (fields["position_embedding_type"], fields["attention_multiplier"],
            fields["embedding_multiplier"], fields["logits_scaling"]) == ("rope", 0.25, 1.0, 1.0)
    assert (fields["num_local_experts"], fields["num_experts_per_tok"],
            fields["intermediate_size"], fields["shared_intermediate_size"]) == (4, 2, 40, 56)
    assert (fields["mamba_n_heads"], fields["mamba_d_head"], fields["mamba_expand"]) == (4, 32, 2)
    off = hybrid_fields({**GRANITE, "granitehybrid.rope.scaling.finetuned": False},
                        GRANITE_DIMS)
    assert off["position_embedding_type"] == "nope"


def test_qwen3_5_from_the_header():
    """llama.cpp's qwen35: every full_attention_interval-th layer full attention, Gated
    DeltaNet's heads from the ssm.* keys, the MTP block (nextn_predict_layers) not a layer;
    a MoE or rope-scaled file refused."""
    from kvstrata.config.gguf_hybrid import hybrid_fields

    meta = {"general.architecture": "qwen35", "qwen35.block_count": 9,
            "qwen35.nextn_predict_layers": 1, "qwen35.embedding_length": 64,
            "qwen35.feed_forward_length": 88, "qwen35.attention.head_count": 4,
            "qwen35.attention.head_count_kv": 2, "qwen35.attention.key_length": 16,
            "qwen35.attention.layer_norm_rms_epsilon": 1e-6, "qwen35.rope.dimension_count": 4,
            "qwen35.ssm.inner_size": 48, "qwen35.ssm.time_step_rank": 4,
            "qwen35.ssm.group_count": 2, "qwen35.ssm.state_size": 8,
            "qwen35.ssm.conv_kernel": 4}
    dims = {"token_embd.weight": (64, 100)}
    fields = hybrid_fields(meta, dims)
    assert fields["num_hidden_layers"] == 8
    assert fields["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] \
        + ["linear_attention"] * 3 + ["full_attention"]
    assert (fields["linear_num_key_heads"], fields["linear_num_value_heads"],
            fields["linear_key_head_dim"], fields["linear_value_head_dim"]) == (2, 4, 8, 12)
    assert fields["rope_parameters"]["partial_rotary_factor"] == 0.25
    for change, match in (({"qwen35.expert_count": 8}, "expert_count"),
                          ({"qwen35.rope.scaling.type": "yarn"}, "rope.scaling.type 'yarn'")):
        with pytest.raises(ValueError, match=match):
            hybrid_fields({**meta, **change}, dims)
    # Qwen3-Next: the same keys, every layer a MoE (widths from the expert tensors)
    next_meta = {k.replace("qwen35.", "qwen3next."): v for k, v in meta.items()}
    next_meta.update({"general.architecture": "qwen3next", "qwen3next.expert_count": 4,
                      "qwen3next.expert_used_count": 2})
    with pytest.raises(ValueError, match="every qwen3next layer is a MoE"):
        hybrid_fields(next_meta, dims)
    moe = hybrid_fields(next_meta, {**dims, "blk.0.ffn_gate_exps.weight": (64, 24, 4),
                                    "blk.0.ffn_gate_shexp.weight": (64, 40)})
    assert (moe["architectures"], moe["num_experts"], moe["moe_intermediate_size"],
            moe["shared_expert_intermediate_size"], moe["decoder_sparse_step"]) == (
        ["Qwen3NextForCausalLM"], 4, 24, 40, 1)
    # Qwen3.5-MoE: Qwen3.5's keys without feed_forward_length, the experts as Qwen3-Next's
    moe_meta = {k.replace("qwen3next.", "qwen35moe."): v for k, v in next_meta.items()
                if k != "qwen3next.feed_forward_length"}
    moe_meta["general.architecture"] = "qwen35moe"
    moe = hybrid_fields(moe_meta, {**dims, "blk.0.ffn_gate_exps.weight": (64, 24, 4),
                                   "blk.0.ffn_gate_shexp.weight": (64, 40)})
    assert (moe["architectures"], moe["model_type"], moe["num_experts"],
            "intermediate_size" in moe) == (["Qwen3_5MoeForCausalLM"], "qwen3_5_moe_text", 4,
                                            False)


NEMOTRON_MOE = {**{k.replace("nemotron_h.", "nemotron_h_moe."): v for k, v in NEMOTRON.items()},
                "general.architecture": "nemotron_h_moe", "nemotron_h_moe.block_count": 4,
                "nemotron_h_moe.nextn_predict_layers": 1,
                "nemotron_h_moe.attention.head_count_kv": [0, 2, 0, 2],
                "nemotron_h_moe.feed_forward_length": [0, 0, 24, 24],
                "nemotron_h_moe.expert_count": 8, "nemotron_h_moe.expert_used_count": 2,
                "nemotron_h_moe.expert_shared_feed_forward_length": 40,
                "nemotron_h_moe.expert_weights_norm": True,
                "nemotron_h_moe.expert_weights_scale": 2.5}
NEMOTRON_MOE_DIMS = {"token_embd.weight": (64, 100), "blk.2.ffn_up_exps.weight": (64, 24, 8),
                     "blk.2.ffn_up_shexp.weight": (64, 40)}


@pytest.mark.parametrize("change,match", [
    ({}, None),
    ({"nemotron_h_moe.expert_group_count": 2}, "expert_group_count 2 without"),
    ({"nemotron_h_moe.moe_latent_size": 16}, "moe_latent_size 16 and the ffn_latent_down"),
], ids=["builds", "groups-without-used", "latent-without-tensors"])
def test_nemotron_h_moe_from_the_header(change, match):
    """llama.cpp's nemotron_h_moe: a layer with a feed-forward length is a MoE; the router's
    keys as its build_moe_ffn reads them; the MTP block after the layers (its array entries
    too) is not a layer."""
    from kvstrata.config.gguf_hybrid import hybrid_fields

    if match is not None:
        with pytest.raises(ValueError, match=match):
            hybrid_fields({**NEMOTRON_MOE, **change}, NEMOTRON_MOE_DIMS)
        return
    fields = hybrid_fields(NEMOTRON_MOE, NEMOTRON_MOE_DIMS)
    assert fields["num_hidden_layers"] == 3
    assert fields["layers_block_type"] == ["linear_attention", "full_attention", "moe"]
    assert (fields["n_routed_experts"], fields["num_experts_per_tok"],
            fields["moe_intermediate_size"], fields["moe_shared_expert_intermediate_size"],
            fields["norm_topk_prob"], fields["routed_scaling_factor"], fields["n_group"],
            fields["topk_group"], fields["moe_latent_size"]) == (8, 2, 24, 40, True, 2.5, 1, 1,
                                                                 None)


FALCON = {"general.architecture": "falcon-h1", "falcon-h1.block_count": 2,
          "falcon-h1.embedding_length": 64, "falcon-h1.ssm.inner_size": 64,
          "falcon-h1.ssm.time_step_rank": 4, "falcon-h1.ssm.group_count": 2,
          "falcon-h1.ssm.conv_kernel": 4, "falcon-h1.ssm.state_size": 16,
          "falcon-h1.attention.layer_norm_rms_epsilon": 1e-5,
          "falcon-h1.attention.head_count": 4, "falcon-h1.attention.head_count_kv": 2,
          "falcon-h1.attention.key_length": 24, "falcon-h1.feed_forward_length": 88,
          "falcon-h1.rope.freq_base": 1e5}


@pytest.mark.parametrize("change,match", [
    ({}, None),
    ({"blk.0.ssm_in.bias": (138,)}, "ssm_in.bias is not supported"),
    ({"blk.1.attn_q.bias": (96,)}, "attn_q.bias is not supported"),
    ({"falcon-h1.rope.scaling.type": "yarn"}, "rope.scaling.type 'yarn'"),
    ({"falcon-h1.rope.dimension_count": 8}, "rope.dimension_count 8"),
    ({"falcon-h1.attention.scale": 0.5}, "attention.scale is not supported"),
], ids=["builds", "ssm-in-bias", "attention-bias", "rope-scaling", "partial-rope", "scale"])
def test_falcon_h1_from_the_header(change, match):
    """llama.cpp's falcon-h1: attention and Mamba2 in every layer, every muP multiplier 1 (the
    converter folded them into the weights), the gated norm after the gate when ssm_norm is
    there; what llama.cpp does not read is refused by key or tensor name."""
    from kvstrata.config.gguf_hybrid import hybrid_fields

    dims = {"token_embd.weight": (64, 100), "output.weight": (64, 100)}
    meta = dict(FALCON)
    for key, value in change.items():
        (dims if key.startswith("blk.") else meta)[key] = value
    if match is not None:
        with pytest.raises(ValueError, match=match):
            hybrid_fields(meta, dims)
        return
    fields = hybrid_fields(meta, dims)
    assert (fields["architectures"], fields["num_attention_heads"], fields["head_dim"],
            fields["mamba_d_head"], fields["mamba_rms_norm"], fields["ssm_multipliers"],
            fields["key_multiplier"]) == (["FalconH1ForCausalLM"], 4, 24, 16, False, [1.0] * 5,
                                          1.0)
    normed = hybrid_fields(meta, {**dims, "blk.0.ssm_norm.weight": (32, 2)})
    assert normed["mamba_rms_norm"] and not normed["mamba_norm_before_gate"]
