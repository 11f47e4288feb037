"""gpt-oss GGUF files (llama.cpp arch `gpt-oss`): a tiny random gpt-oss (window 8, random
sinks, YaRN, 4 experts of which 2 per token) written as llama.cpp's converter writes it
(tests/helpers/gpt_oss_gguf.py: its names and metadata keys, F16 / F32 tensors, the experts
MXFP4 by gguf's quantizer) is served from the file with transformers' greedy tokens on the
values the file holds, over the hybrid SWA pool, for prompts many windows long; ggml's MXFP4
dequantized bit for bit as gguf's; the config from the header (transformers' GGUF conversion
fails on these files); the chat template from tokenizer.chat_template; what is not built
refused by name.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from helpers.compare import assert_served_twice_match
from helpers.gpt_oss import VOCAB, WINDOW, build_checkpoint, load_reference
from helpers.gpt_oss_gguf import (CHAT_TEMPLATE, gguf_compatible_overrides,
                                  write_gpt_oss_gguf)
from helpers.runner import make_runner

NEW_TOKENS = 12
PROMPT_LENS = (5, 20, 37)  # inside the window, and 2-4 windows long


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(HF checkpoint, its GGUF, an HF checkpoint of the GGUF's values); the converted
    metadata under a private cache."""
    root = tmp_path_factory.mktemp("gpt_oss_gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(root / "cache"))  # config/model_source.py's cache
        hf = build_checkpoint(str(root / "hf"), seed=5, **gguf_compatible_overrides)
        path = write_gpt_oss_gguf(hf, str(root / "gpt-oss.gguf"), str(root / "ref"))
        yield hf, path, str(root / "ref")


def test_ggml_mxfp4_dequantizes_as_ggufs_bit_for_bit():
    """Every byte value (all 256 scales: subnormal, overflowing; all 16 codes, -0 too) over a
    3-D expert-shaped tensor: the loader's MXFP4 (quant/mxfp4.py) is gguf's, bit for bit."""
    import gguf

    from kvstrata.runner.models.gguf_weights import dequantize

    raw = np.random.default_rng(0).integers(0, 256, size=(3, 40, 4 * 17), dtype=np.uint8)
    raw[0, 0, ::17] = np.arange(4)  # scales 0, 1 (ggml's subnormal halves), 2, 3
    raw[0, 1, ::17] = 255
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    ours = dequantize(raw, mxfp4)
    with np.errstate(over="ignore"):
        theirs = gguf.quants.dequantize(raw, mxfp4)
    assert ours.shape == theirs.shape == (3, 40, 128)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_config_comes_from_the_header(files):
    """What the runner reads of the file's config equals the HF config (windows from
    llama.cpp's swa pattern, YaRN, experts, head size), and resolution sees the windows and
    sinks from the header alone."""
    from transformers import AutoConfig

    from kvstrata.config import ModelInfo
    from kvstrata.config.model_source import load_hf_config, resolve_model_path

    hf_path, gguf_path, _ = files
    ours, theirs = load_hf_config(resolve_model_path(gguf_path)), AutoConfig.from_pretrained(
        hf_path)
    for field in ("architectures", "num_hidden_layers", "hidden_size", "intermediate_size",
                  "head_dim", "num_attention_heads", "num_key_value_heads", "sliding_window",
                  "layer_types", "num_local_experts", "num_experts_per_tok", "swiglu_limit",
                  "rope_parameters", "vocab_size", "tie_word_embeddings",
                  "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert np.float32(ours.rms_norm_eps) == np.float32(theirs.rms_norm_eps)  # stored float32
    info = ModelInfo.from_model_path(gguf_path)
    assert info.layer_windows == (WINDOW, None, WINDOW, None)
    assert "attention sinks" in info.softmax_extras


def test_greedy_from_the_gguf_equals_transformers(files):
    """Served from the GGUF (chunks of 16 crossing the window, a radix prefix hit) beside the
    SWA pool: transformers' greedy tokens on the values the file holds."""
    from kvstrata import LLM

    _, gguf_path, ref_path = files
    hf = load_reference(ref_path)
    rng = random.Random(7)
    prompts = [[rng.randrange(6, VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    refs = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), do_sample=False,
                              max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        refs.append((out.sequences[0, len(prompt):].tolist(), [s[0] for s in out.logits]))
    greedy = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "temperature": 0}
    with LLM(model_path=gguf_path, skip_tokenizer_init=True, dtype="float32", page_size=4,
             chunked_prefill_size=16, max_total_tokens=1024) as llm:
        assert llm.server_info()["kv_plan"]["pool_kind"] == "swa"
        model = llm.engine.runner.model
        assert model.layer_windows == [WINDOW, None, WINDOW, None]
        for ours, theirs in zip(model.layers, hf.model.layers):
            assert torch.equal(ours.sinks, theirs.self_attn.sinks.detach())
        assert_served_twice_match(llm, prompts, refs, greedy, "gpt-oss GGUF")


def test_fused_gate_up_file_loads_the_same_experts(files, tmp_path):
    """The newer converter's ffn_gate_up_exps (gate rows, then up rows; here F16) fills the
    experts as the split tensors do: equal to the reference checkpoint's, split by us."""
    from kvstrata.config.model_source import load_hf_config, resolve_model_path
    from kvstrata.runner.models.loader import load_model

    hf_path, _, _ = files
    path = write_gpt_oss_gguf(hf_path, str(tmp_path / "fused.gguf"), str(tmp_path / "ref"),
                              expert_type="F16", fuse_gate_up=True)
    source = resolve_model_path(path)
    model = load_model(source, load_hf_config(source), "float32")
    hf = load_reference(str(tmp_path / "ref"))
    for ours, theirs in zip(model.layers, hf.model.layers):
        experts = theirs.mlp.experts
        gate_up = torch.cat([experts.gate_up_proj[..., ::2], experts.gate_up_proj[..., 1::2]],
                            dim=-1).transpose(1, 2)
        assert torch.equal(ours.gate_up, gate_up.detach())
        assert torch.equal(ours.down, experts.down_proj.transpose(1, 2).detach())


def test_chat_template_comes_from_the_gguf(files):
    """tokenizer.chat_template is the tokenizer's template, as for other GGUF files; the
    byte-level BPE vocabulary (merges, special tokens) round-trips."""
    from kvstrata.config.model_source import load_tokenizer, resolve_model_path

    _, gguf_path, _ = files
    tok = load_tokenizer(resolve_model_path(gguf_path))
    assert tok.chat_template == CHAT_TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "the tea"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text == "<|start|>user<|message|>the tea<|end|><|start|>assistant"
    ids = tok(text)["input_ids"]
    assert ids[:1] == [3] and 4 in ids and 5 in ids  # <|start|>, <|message|>, <|end|>
    assert tok.decode(ids) == text


@pytest.mark.parametrize("flags", [{"quantization": "gguf"}, {"load_format": "gguf"},
                                   {"quantization": "w8a8_int8"}],
                         ids=["quantization-gguf", "load-format-gguf", "w8a8"])
def test_what_is_not_built_is_refused_by_name(files, flags):
    """Weights kept in their GGUF blocks (no packed kernel for the MXFP4 experts) and
    re-quantizing: refused from the header, before anything loads."""
    _, gguf_path, _ = files
    with pytest.raises(ValueError, match="GptOssForCausalLM .gpt-oss. is not supported "
                                         "with --(quantization|load-format gguf)"):
        make_runner(gguf_path, max_total_tokens=256, **flags)


def test_a_kept_quantized_gpt_oss_gguf_is_refused_at_load(files):
    """The loader refuses it too (a STANDALONE draft's --speculative-draft-model-quantization
    gguf reaches it without the target's checks)."""
    from kvstrata.config.model_source import load_hf_config, resolve_model_path
    from kvstrata.runner.models.loader import load_model

    source = resolve_model_path(files[1])
    with pytest.raises(ValueError, match="not built for gpt-oss"):
        load_model(source, load_hf_config(source), "float32", keep_quantized=True)
