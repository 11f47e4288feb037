"""One GGUF round trip per GGUF-exported family beyond llama / qwen3 / gemma / gpt-oss:
Qwen2, Qwen2-MoE, Qwen3-MoE, Mixtral (llama.cpp's llama arch with expert stacks), GLM-4.5
(sigmoid router, a NextN block not read), DeepSeek V3 and V2-Lite (llama.cpp's deepseek2: MLA
with kv_b_proj split into attn_k_b / attn_v_b), Phi-3, OLMo 2, GLM-4 and SmolLM3 (its NoPE
layer). Each: a tiny random model from transformers' own config class written as
llama.cpp's converter writes its arch (tests/helpers/family_gguf.py: Q8_0, Q4_0 and F32
matrices side by side, expert stacks, Mixtral's and SmolLM3's permuted q/k rows, Phi-3's
LongRoPE factor tensors), served from the file: its config read from the header equals the
checkpoint's; dequantized at load, greedy tokens equal transformers' on the file's values
(float32; chunked prefill across Phi-3's window, in hybrid SWA memory); kept packed
(--quantization gguf) likewise for the dense families (the MoE ones kept packed:
test_gguf_moe_packed.py), refused by name for DeepSeek (MLA); what a header names that
nothing builds is refused by key.
"""
from __future__ import annotations

import random

import pytest
import torch

from helpers.compare import assert_tokens_match
from helpers.family_gguf import FAMILIES, MLA, MOE_FAMILIES, VOCAB, write_family_gguf
from helpers.gemma_ckpt import hf_greedy

NEW_TOKENS = 8
DENSE = tuple(f for f in FAMILIES if f not in MOE_FAMILIES)
# packed layers multiply gguf's dequantized values in float32: the float model's logits up
# to summation order (test_gguf_packed.py's bound)
PACKED_TIE_TOL = 5e-2
ARCHITECTURES = {"qwen2": None, "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                 "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
                 "glm4": "Glm4ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                 "glm4_moe": "Glm4MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                 "deepseek_v2_lite": "DeepseekV2ForCausalLM"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """family -> (GGUF path, transformers' model on the file's values, its greedy refs)."""
    root = tmp_path_factory.mktemp("gguf_families")
    rng = random.Random(9)
    prompts = [[rng.randrange(4, VOCAB) for _ in range(n)] for n in (4, 21)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(root / "cache"))  # config/model_source.py's cache
        out = {}
        for family in FAMILIES:
            path = str(root / f"{family}.gguf")
            hf = write_family_gguf(family, path)
            out[family] = (path, hf, hf_greedy(hf, prompts, NEW_TOKENS))
        yield prompts, out


def _serve(path: str, prompts, **kw):
    from kvstrata import LLM

    greedy = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "temperature": 0}
    with LLM(model_path=path, skip_tokenizer_init=True, dtype="float32", page_size=16,
             chunked_prefill_size=16, max_total_tokens=1024, **kw) as llm:
        model, pool = llm.engine.runner.model, llm.server_info()["kv_plan"]["pool_kind"]
        outs = llm.generate(input_ids=prompts, sampling_params=greedy)
        llm.engine.check_integrity()
    # Phi-3's window, read from the header at resolution: hybrid SWA memory as from HF
    assert pool == {"phi3": "swa", "deepseek_v3": "mla", "deepseek_v2_lite": "mla"}.get(
        family_of(path), "mha")
    return model, [o["output_ids"] for o in outs]


def family_of(path: str) -> str:
    import os

    return os.path.splitext(os.path.basename(path))[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_config_from_the_header_is_the_checkpoints(family, files):
    from kvstrata.config.model_source import load_hf_config, resolve_model_path

    _, out = files
    path, hf, _ = out[family]
    ours, theirs = load_hf_config(resolve_model_path(path)), hf.config
    assert (getattr(ours, "architectures", None) or [None])[0] in (ARCHITECTURES[family],
                                                                   None)
    fields = ["num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
              "vocab_size", "tie_word_embeddings", "num_experts", "num_local_experts",
              "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "shared_expert_intermediate_size", "sliding_window", "attention_bias",
              "qkv_bias", "original_max_position_embeddings", "no_rope_layers",
              "n_routed_experts", "n_shared_experts", "first_k_dense_replace",
              "routed_scaling_factor", "use_qk_norm", "partial_rotary_factor", "n_group",
              "topk_group"]
    for field in fields:
        if hasattr(theirs, field):
            assert getattr(ours, field) == getattr(theirs, field), field
    rope_keys = ("rope_type", "rope_theta", "partial_rotary_factor", "short_factor",
                 "long_factor", "factor", "original_max_position_embeddings", "mscale",
                 "mscale_all_dim")
    a, b = ours.rope_parameters, theirs.rope_parameters
    for key in rope_keys:
        if key in b:
            want = b[key]
            got = a.get(key)
            if isinstance(want, list):
                torch.testing.assert_close(torch.tensor(got), torch.tensor(want))
            else:
                assert got == pytest.approx(want), key


@pytest.mark.parametrize("family", FAMILIES)
def test_dequantized_greedy_equals_transformers(family, files):
    prompts, out = files
    path, _, refs = out[family]
    model, outs = _serve(path, prompts)
    if family in MOE_FAMILIES:
        assert type(model).__name__ == ("DeepseekForCausalLM" if family in MLA
                                        else "MoeDecoderForCausalLM")
    for i, (ours, (ref_tokens, ref_logits)) in enumerate(zip(outs, refs)):
        assert_tokens_match(ours, ref_tokens, ref_logits, label=f"{family} GGUF prompt {i}")


@pytest.mark.parametrize("family", DENSE)
def test_kept_packed_greedy_equals_transformers(family, files):
    from kvstrata.runner.quant.gguf_linear import GgufLinear

    prompts, out = files
    path, _, refs = out[family]
    model, outs = _serve(path, prompts, quantization="gguf")
    layer = model.layers[0]
    assert type(layer.qkv_weight) is GgufLinear and type(layer.gate_up_weight) is GgufLinear
    # F32 in the file: a float weight (on the fixed GEMM where deterministic inference is on:
    # the default for GGUF kept packed on an AVX-512 CPU)
    down = layer.down_weight
    assert isinstance(down, torch.Tensor) or getattr(down, "fixed", False)
    for i, (ours, (ref_tokens, ref_logits)) in enumerate(zip(outs, refs)):
        assert_tokens_match(ours, ref_tokens, ref_logits, tie_tol=PACKED_TIE_TOL,
                            label=f"{family} packed GGUF prompt {i}")


@pytest.mark.parametrize("family", MLA)
def test_mla_kept_packed_is_refused_by_name(family, files):
    from kvstrata.config.model_source import load_hf_config, resolve_model_path
    from kvstrata.runner.models.loader import load_model

    source = resolve_model_path(files[1][family][0])
    with pytest.raises(ValueError, match="not built for .*ForCausalLM .no packed path for "
                                         "MLA"):
        load_model(source, load_hf_config(source), "float32", keep_quantized=True)


def _header_only(path: str, arch: str, keys: dict, tensors: tuple[str, ...]) -> str:
    """A GGUF of `arch` with these metadata keys (under the arch's prefix) and zero tensors:
    what the config reads, nothing to serve."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(path, arch)
    sizes = {"block_count": 1, "embedding_length": 32, "feed_forward_length": 32,
             "attention.head_count": 2, "attention.layer_norm_rms_epsilon": 1e-6,
             "expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 32,
             "expert_shared_count": 1}
    for key, value in {**sizes, **keys}.items():
        add = w.add_string if isinstance(value, str) else \
            w.add_float32 if isinstance(value, float) else w.add_uint32
        add(f"{arch}.{key}", value)
    for name in ("token_embd.weight", *tensors):
        w.add_tensor(name, np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_MOE_LAYER = ("blk.0.ffn_gate_inp.weight", "blk.0.exp_probs_b.bias")


@pytest.mark.parametrize("arch,keys,tensors,message", [
    ("qwen3moe", {"expert_gating_func": 2}, _MOE_LAYER, "expert_gating_func 2"),
    ("qwen3moe", {}, (), r"layers without experts \(\[0\]\)"),
    ("olmo2", {"rope.scaling.type": "yarn"}, (), "rope.scaling.type 'yarn'"),
    ("olmo2", {"attention.sliding_window": 4096}, (), "OLMo 3's windowed layers"),
    ("glm4moe", {"expert_gating_func": 2, "expert_group_count": 8}, _MOE_LAYER,
     "expert_group_count 8"),
    ("phi3", {}, ("rope_factors_long.weight",), "rope factor tensors"),
    ("deepseek2", {"rope.dimension_count": 16, "attention.key_length_mla": 32,
                   "attention.value_length_mla": 16, "attention.kv_lora_rank": 32,
                   "expert_group_count": 8}, _MOE_LAYER, "expert_group_count 8"),
    ("deepseek2", {"rope.dimension_count": 16, "attention.key_length_mla": 32,
                   "attention.value_length_mla": 16, "attention.kv_lora_rank": 32,
                   "rope.scaling.type": "yarn"}, _MOE_LAYER, "YaRN without"),
])
def test_what_the_header_names_but_nothing_builds_is_refused_by_key(arch, keys, tensors,
                                                                    message, tmp_path):
    from kvstrata.config.gguf_families import family_config

    path = _header_only(str(tmp_path / f"{arch}.gguf"), arch, keys, tensors)
    with pytest.raises(ValueError, match=f"GGUF {arch}: .*{message}"):
        family_config(path, {})
