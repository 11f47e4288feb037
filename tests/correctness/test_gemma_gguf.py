"""Gemma 3 and Gemma 2 GGUF files (llama.cpp archs `gemma3`, `gemma2`): a tiny random HF
checkpoint written as llama.cpp's converter writes it (tests/helpers/gemma_gguf.py: its tensor
names, norms stored as 1 + w, its metadata keys, a sentencepiece vocabulary) and served from
the file gives transformers' greedy tokens on the HF checkpoint, over the hybrid SWA pool.

The checkpoints make the file's own fields matter: Gemma 2's soft-caps (3 / 15, not
transformers' defaults 50 / 30), Gemma 3's scaled global rope (linear, factor 2, not the
local one) and norms drawn at random (a lost or doubled + 1 shows). The attention scale is
head_dim's, as llama.cpp assumes below 27B (config/gguf_config.py; a GGUF cannot name it).
The same checkpoints quantized (Q4_0 / Q4_1 / Q8_0 by gguf's quantizer, mixed in q|k|v) and
served kept packed (--quantization gguf) give transformers' greedy tokens on the weights the
file holds.
"""
from __future__ import annotations

import random

import pytest
import torch

from helpers.compare import assert_served_twice_match, assert_tokens_match
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
        assert_served_twice_match(llm, prompts, refs, greedy, f"{arch} GGUF")


# Quantized by gguf's own quantizer (the tiny MLP width, 88, is no multiple of a block: the
# down projection stays float32 beside them, as a file's float tensors do)
PACKED_NEW_TOKENS = 8
GEMMA_TYPES = {"q_proj": "Q8_0", "k_proj": "Q4_0", "v_proj": "Q8_0", "o_proj": "Q4_1",
               "gate_proj": "Q4_1", "up_proj": "Q4_0", "embed_tokens": "Q8_0"}


@pytest.mark.parametrize("arch", GEMMAS)
def test_quantized_gguf_kept_packed_equals_transformers(arch, ggufs, tmp_path, monkeypatch):
    """A quantized Gemma file served with --quantization gguf: transformers' greedy tokens
    on the weights the file holds (gguf's dequantization), its tied head the packed
    embedding (one copy, scaled lookups of only the rows looked up)."""
    from kvstrata import LLM
    from kvstrata.runner.quant.gguf_linear import GgufLinear

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    hf_path, _ = ggufs[arch]
    reference: dict = {}
    path = write_gemma_gguf(hf_path, str(tmp_path / f"{arch}.gguf"), GEMMA_TYPES, reference)
    hf = hf_gemma(hf_path)
    missing, unexpected = hf.load_state_dict(reference, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    rng = random.Random(6)
    prompts = [[rng.randrange(4, 300) for _ in range(n)] for n in (4, 30)]
    refs = hf_greedy(hf, prompts, PACKED_NEW_TOKENS)
    greedy = {"max_new_tokens": PACKED_NEW_TOKENS, "min_new_tokens": PACKED_NEW_TOKENS,
              "temperature": 0}
    with LLM(model_path=path, skip_tokenizer_init=True, quantization="gguf", page_size=16,
             chunked_prefill_size=16, max_total_tokens=1024) as llm:
        model = llm.engine.runner.model
        assert type(model.embed) is GgufLinear and model.lm_head is model.embed
        assert type(model.layers[0].qkv_weight) is GgufLinear
        # stored F32 in the file: a float weight (on the fixed GEMM where deterministic
        # inference is on: the default for GGUF kept packed on an AVX-512 CPU)
        down = model.layers[0].down_weight
        assert isinstance(down, torch.Tensor) or getattr(down, "fixed", False)
        outs = llm.generate(input_ids=prompts, sampling_params=greedy)
        llm.engine.check_integrity()
    for i, (out, (ref_tokens, ref_logits)) in enumerate(zip(outs, refs)):
        assert_tokens_match(out["output_ids"], ref_tokens, ref_logits, tie_tol=5e-2,
                            label=f"{arch} packed GGUF prompt {i}")
