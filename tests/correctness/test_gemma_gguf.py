"""Gemma 3 and Gemma 2 GGUF files (llama.cpp archs `gemma3`, `gemma2`): a tiny random HF
checkpoint written as llama.cpp's converter writes it (tests/helpers/gemma_gguf.py: its tensor
names, norms stored as 1 + w, its metadata keys, a sentencepiece vocabulary) and served from
the file gives transformers' greedy tokens on the HF checkpoint, over the hybrid SWA pool.

The checkpoints make the file's own fields matter: Gemma 2's soft-caps (3 / 15, not
transformers' defaults 50 / 30), Gemma 3's scaled global rope (linear, factor 2, not the
local one) and norms drawn at random (a lost or doubled + 1 shows). The attention scale is
head_dim's, as llama.cpp assumes below 27B (config/gguf_config.py; a GGUF cannot name it).
"""
from __future__ import annotations

import random

import pytest
import torch

from helpers.compare import assert_tokens_match
from helpers.gemma_ckpt import GEMMAS, build_gemma_checkpoint, hf_gemma, hf_greedy
from helpers.gemma_gguf import gguf_compatible_config, write_gemma_gguf

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """arch -> (HF checkpoint, its GGUF file); the converted metadata under a private cache."""
    root = tmp_path_factory.mktemp("gemma_gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(root / "cache"))  # config/model_source.py's cache
        out = {}
        for arch in GEMMAS:
            hf = build_gemma_checkpoint(arch, str(root / arch),
                                        config=gguf_compatible_config(arch))
            out[arch] = (hf, write_gemma_gguf(hf, str(root / f"{arch}.gguf")))
        yield out


@pytest.mark.parametrize("arch", GEMMAS)
def test_converted_config_is_the_checkpoints(arch, ggufs):
    """What the runner reads of the file's converted config equals the HF config: the
    fields transformers' conversion drops come back from the file the way llama.cpp reads
    them (soft-caps, rope scaling, attention scale, layer pattern)."""
    from transformers import AutoConfig

    from kvstrata.config.model_source import load_hf_config, resolve_model_path
    from kvstrata.runner.models.gemma import layer_rope_parameters

    hf_path, gguf_path = ggufs[arch]
    ours, theirs = load_hf_config(resolve_model_path(gguf_path)), AutoConfig.from_pretrained(
        hf_path)
    for field in ("num_hidden_layers", "hidden_size", "intermediate_size", "head_dim",
                  "num_attention_heads", "num_key_value_heads", "query_pre_attn_scalar",
                  "sliding_window", "layer_types", "attn_logit_softcapping",
                  "final_logit_softcapping", "vocab_size", "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field
    for layer_type in set(theirs.layer_types):
        a, b = layer_rope_parameters(ours, layer_type), layer_rope_parameters(theirs, layer_type)
        assert {k: a.get(k) for k in ("rope_type", "rope_theta", "factor")} == \
            {k: b.get(k) for k in ("rope_type", "rope_theta", "factor")}, layer_type
    assert ours.architectures == theirs.architectures


@pytest.mark.parametrize("arch", GEMMAS)
def test_greedy_from_the_gguf_equals_transformers(arch, ggufs):
    """Served from the GGUF (chunked prefill across the window, prefix hits) beside the SWA
    pool: transformers' tokens on the HF checkpoint, and the norm scales are transformers'
    1 + w exactly (the file's stored scale is not offset again)."""
    from kvstrata import LLM

    hf_path, gguf_path = ggufs[arch]
    hf = hf_gemma(hf_path)
    rng = random.Random(5)
    prompts = [[rng.randrange(4, 300) for _ in range(n)] for n in (4, 30, 61)]
    refs = hf_greedy(hf, prompts, NEW_TOKENS)
    greedy = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "temperature": 0}
    with LLM(model_path=gguf_path, skip_tokenizer_init=True, dtype="float32", page_size=16,
             chunked_prefill_size=16, max_total_tokens=1024) as llm:
        assert llm.server_info()["kv_plan"]["pool_kind"] == "swa"
        model = llm.engine.runner.model
        for ours, theirs in zip(model.layers, hf.model.layers):
            assert torch.equal(ours.input_norm, 1 + theirs.input_layernorm.weight.float())
            assert torch.equal(ours.post_ff_norm,
                               1 + theirs.post_feedforward_layernorm.weight.float())
        for _ in range(2):  # the second time from the radix cache
            outs = llm.generate(input_ids=prompts, sampling_params=greedy)
            for i, (out, (ref_tokens, ref_logits)) in enumerate(zip(outs, refs)):
                assert_tokens_match(out["output_ids"], ref_tokens, ref_logits,
                                    label=f"{arch} GGUF prompt {i}")
        assert sum(o["meta_info"]["cached_tokens"] for o in outs) > 0
        llm.engine.check_integrity()
