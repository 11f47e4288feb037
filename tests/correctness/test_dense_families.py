"""Dense families beyond llama / qwen / gemma against transformers (float32, eager attention):
Phi-3 (fused qkv_proj / gate_up_proj checkpoint, LongRoPE, 3/4 partial rotary, a window),
SmolLM3 (NoPE every 2nd layer here, YaRN), OLMo 2 (output norms, whole-projection QK-norm,
dynamic rope within its context) and GLM-4 (sandwich norms, interleaved half rotary, qkv bias);
and every rope_type the llama decoder honours, cos / sin against transformers' rotary.

Each family: one tiny random checkpoint from transformers' own config class (2 layers,
vocab 300, hidden 64, norm weights drawn at random so that every norm matters); prefill
logits (atol 1e-4) and greedy tokens through a page-1 runner; a chunked prefill that hits the
radix cache through one LLM engine with pages of 16.
"""
from __future__ import annotations

import os

import pytest
import torch

from helpers.compare import assert_tokens_match
from helpers.driver import greedy_in_mode
from helpers.gemma_ckpt import hf_gemma, hf_greedy
from helpers.runner import forward_logits, make_runner, num_live_requests

VOCAB = 300
PREFILL_ATOL = 1e-4
NEW_TOKENS = 8
PROMPT_LENS = (1, 9, 30)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, tie_word_embeddings=False)


def family_config(family: str):
    import transformers as tf

    if family == "phi3":  # the short factors (prompts stay below the original 256)
        g = torch.Generator().manual_seed(3)
        half = int(16 * 0.75) // 2
        return tf.Phi3Config(**COMMON, sliding_window=8, original_max_position_embeddings=256,
                             rope_parameters={
                                 "rope_type": "longrope", "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.75,
                                 "short_factor": (1 + torch.rand(half, generator=g)).tolist(),
                                 "long_factor": (4 + torch.rand(half, generator=g)).tolist()})
    if family == "smollm3":
        return tf.SmolLM3Config(**COMMON, no_rope_layers=[1, 0], rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 128})
    if family == "olmo2":
        return tf.Olmo2Config(**COMMON, rope_parameters={
            "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    if family == "glm4":
        return tf.Glm4Config(**COMMON, head_dim=16, attention_bias=True)
    raise ValueError(family)


FAMILIES = {"phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
            "olmo2": "Olmo2ForCausalLM", "glm4": "Glm4ForCausalLM"}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    from transformers import AutoModelForCausalLM

    root = str(tmp_path_factory.mktemp("dense_families"))
    out = {}
    for i, family in enumerate(FAMILIES):
        torch.manual_seed(100 + i)
        model = AutoModelForCausalLM.from_config(family_config(family), dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(1.0, 0.3)  # initialised to 1, a norm would hide a missing one
                elif name.endswith("bias"):
                    p.normal_(0, 0.3)
        out[family] = os.path.join(root, family)
        model.save_pretrained(out[family], safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_greedy_match_transformers(family, paths, prompts):
    hf = hf_gemma(paths[family])
    assert type(hf).__name__ == FAMILIES[family]
    runner = make_runner(paths[family], page_size=1, max_total_tokens=2048,
                         context_length=512, max_running_requests=8)
    model = runner.model
    if family == "smollm3":
        assert model.nope_layers == {1}
    if family in ("phi3", "glm4"):
        assert model.rotary.dim == (12 if family == "phi3" else 8)  # partial rotary
    for prompt in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(forward_logits(runner, prompt), ref, atol=PREFILL_ATOL,
                                   rtol=0, msg=lambda m: f"{family} {len(prompt)}: {m}")
    refs = hf_greedy(hf, prompts, NEW_TOKENS)
    outs = greedy_in_mode(runner, prompts, NEW_TOKENS, batched=True, chunk=4, staggered=True)
    for prompt, ours, (ref_tokens, ref_logits) in zip(prompts, outs, refs):
        assert_tokens_match(ours, ref_tokens, ref_logits, label=f"{family} {len(prompt)}")
    assert num_live_requests(runner) == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_radix_hit_with_chunked_prefill_pages_of_16(family, paths):
    from kvstrata import LLM

    prompt = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    (ref_tokens, ref_logits), = hf_greedy(hf_gemma(paths[family]), [prompt], NEW_TOKENS)
    greedy = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
              "logprobs": 0}
    with LLM(model_path=paths[family], skip_tokenizer_init=True, page_size=16,
             chunked_prefill_size=16, max_total_tokens=2048) as llm:
        llm.generate(input_ids=prompt[:34], sampling_params=greedy)  # caches 32 tokens
        out = llm.generate(input_ids=prompt, sampling_params=greedy)
    assert out["meta_info"]["cached_tokens"] >= 32
    assert_tokens_match(out["output_ids"], ref_tokens, ref_logits, label=f"{family} radix")


# ---------------------------------------------------------------- rope types (llama decoder)
ROPES = {
    "default": {},
    "linear": {"factor": 4.0},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 64},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.8,
                              "beta_fast": 16, "original_max_position_embeddings": 64},
    "dynamic": {"factor": 2.0},
    "longrope": {"short_factor": [1.0 + i / 8 for i in range(8)],
                 "long_factor": [2.0 + i for i in range(8)],
                 "original_max_position_embeddings": 64},
    "longrope_partial": {"rope_type": "longrope", "partial_rotary_factor": 0.5,
                         "short_factor": [1.5, 1.2, 1.1, 1.0],
                         "long_factor": [3.0, 2.0, 1.5, 1.0],
                         "original_max_position_embeddings": 64},
}
MAX_POSITIONS = 128
# Ranges transformers rotates in one forward (one choice of frequencies for all of them):
# below the original context, and past it (longrope's long factors, dynamic's grown base only
# at a single position each: transformers grows it for the batch's longest sequence).
POSITION_SETS = ([list(range(0, 64))], [list(range(64, 128))], [[130], [200], [1000]])


@pytest.mark.parametrize("name", ROPES)
def test_rope_cos_sin_match_transformers(name):
    import transformers as tf
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from kvstrata.runner.models.rope import RotaryEmbedding, rope_parameters, rotary_dim

    params = {"rope_type": name, "rope_theta": 10000.0, **ROPES[name]}
    config = tf.LlamaConfig(hidden_size=128, num_attention_heads=8, head_dim=16,
                            max_position_embeddings=MAX_POSITIONS, rope_parameters=params)
    ours_params = rope_parameters(config)
    ours = RotaryEmbedding(rotary_dim(16, ours_params), ours_params, torch.device("cpu"),
                           MAX_POSITIONS)
    for sets in POSITION_SETS:
        for positions in sets:
            theirs_rope = LlamaRotaryEmbedding(config)  # fresh: dynamic keeps state
            pos = torch.tensor(positions)
            cos, sin = theirs_rope(torch.zeros(1, dtype=torch.float32), pos[None])
            c, s = ours.plain_cos_sin(pos)
            torch.testing.assert_close(c, cos[0], atol=1e-6, rtol=1e-6,
                                       msg=lambda m: f"{name} cos at {positions[:2]}: {m}")
            torch.testing.assert_close(s, sin[0], atol=1e-6, rtol=1e-6,
                                       msg=lambda m: f"{name} sin at {positions[:2]}: {m}")


def test_unknown_rope_type_is_refused_by_name():
    from kvstrata.runner.models.rope import compute_inv_freq

    with pytest.raises(ValueError, match="rope_type 'mrope'"):
        compute_inv_freq(16, {"rope_type": "mrope", "rope_theta": 10000.0})
