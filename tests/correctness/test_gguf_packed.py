"""GGUF weights kept quantized (--quantization gguf): tiny random llama (tied, q/k rows
permuted by llama.cpp's converter) and qwen3 (untied, q/k norms) files written by the test
(tests/helpers/decoder_gguf.py) with a type per tensor as a Q4_K_M file mixes them (Q4_K and
Q6_K in layer 0) and Q4_0 / F32 / Q8_0 segments side by side in layer 1's q|k|v, Q5_K in its
gate|up, Q4_0 embeddings and a Q6_K head. Served kept packed, they give transformers' logits
and greedy tokens on the weights the file holds (gguf's dequantization of them), the same as
the file dequantized at load; the packed layers replace the float weights (no float copy).
A type without a packed kernel (Q3_K, as a Q3_K_M file holds) is dequantized at load, with a
warning.
"""
from __future__ import annotations

import logging
import random

import pytest
import torch

from helpers.compare import assert_tokens_match
from helpers.decoder_gguf import ARCHS, TYPES, transformers_model, write_decoder_gguf

NEW_TOKENS = 8
# gguf_matmul.matmul multiplies gguf's dequantized values in float32: the float model's
# logits up to summation order (the layout and wiring check, below with that kernel).
LOGITS_ATOL = 5e-2
# A GGUF file's layers run gguf_matmul.matmul_q8, which quantizes activations to 8-bit blocks of 32
# first: 0.2-0.3% of |x| @ |W| per matmul here, 1% on the down projections, whose inputs in
# these random-weight models reach |x| ~ 300 (a block's outlier coarsens its neighbours);
# through the layers the logits (magnitude ~3-5) moved by up to 0.44 (measured).
Q8_LOGITS_ATOL = 0.6
# Greedy near-ties on the 8-bit path: its Q4_K / Q5_K / Q6_K layers quantize x per 256 values
# (gguf_q8k_run.h), coarser than per 32 on these outlier-heavy inputs: over the 5-token
# prompt's 8 greedy steps qwen3's logits moved by up to 2.5 (2.3 on 32-value blocks) and once
# chose a token whose reference logit is 0.66 below the top (0.05 on 32-value blocks).
Q8_TIE_TOL = 1.0


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """arch -> (GGUF path, transformers' model on the file's dequantized weights)."""
    root = tmp_path_factory.mktemp("gguf_packed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(root / "cache"))  # config/model_source.py's cache
        out = {}
        for arch in ARCHS:
            path = str(root / f"{arch}.gguf")
            config, reference = write_decoder_gguf(arch, path)
            out[arch] = (path, transformers_model(config, reference))
        yield out


@pytest.mark.parametrize("arch", ARCHS)
def test_kept_quantized_matches_transformers(arch, files, monkeypatch):
    """The 8-bit activation path (KVSTRATA_GGUF_INT8_ACTIVATIONS=1, opt-in) against
    transformers, and the same layers on float activations (the default kernel)."""
    from kvstrata import LLM
    from kvstrata.runner.cpu import gguf_matmul
    from kvstrata.runner.quant.gguf_linear import GgufLinear

    path, hf = files[arch]
    rng = random.Random(3)
    prompts = [[rng.randrange(4, 300) for _ in range(n)] for n in (5, 23)]
    greedy = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "temperature": 0}
    monkeypatch.setenv("KVSTRATA_GGUF_INT8_ACTIVATIONS", "1")
    with LLM(model_path=path, skip_tokenizer_init=True, quantization="gguf", page_size=16,
             chunked_prefill_size=16, max_total_tokens=1024) as llm:
        info = llm.server_info()
        assert info["dtype"] == "float32"  # --dtype auto with gguf (rule platform.cpu_dtype)
        assert info["quantization_info"]["activations"] == (
            "int8 blocks of 32; Q4_K / Q5_K / Q6_K: super-blocks of 256")
        assert info["quantization_info"]["packed_types"] == ["Q4_0", "Q4_1", "Q4_K", "Q5_K",
                                                             "Q6_K", "Q8_0"]
        model = llm.engine.runner.model
        for layer in model.layers:  # every linear replaced: no float weight left behind
            for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"):
                assert type(getattr(layer, name)) is GgufLinear, name
        kinds = [getattr(w, "qtype", None) for _, _, w, _ in model.layers[1].qkv_weight.parts]
        assert len(kinds) == 3 and kinds[1] is None  # Q4_0 | F32 rows | Q8_0 side by side
        assert len(model.layers[0].gate_up_weight.parts) == 1  # Q4_K | Q4_K joined
        assert type(model.embed) is GgufLinear
        assert (model.lm_head is model.embed) == (arch == "llama")  # tied: one packed copy
        with torch.no_grad():
            want = hf(torch.tensor([prompts[1]])).logits[0]
        from kvstrata.runner.forward_batch import ForwardBatch

        fb = ForwardBatch.build([prompts[1]], [0], [0], torch.device("cpu"))
        torch.testing.assert_close(model(fb), want, atol=Q8_LOGITS_ATOL, rtol=0)
        with pytest.MonkeyPatch.context() as mp:  # the same layers, float activations
            mp.setattr(gguf_matmul, "matmul_q8", gguf_matmul.matmul)
            torch.testing.assert_close(model(fb), want, atol=LOGITS_ATOL, rtol=0)
        outs = llm.generate(input_ids=prompts, sampling_params=greedy)
        llm.engine.check_integrity()
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0)
        assert_tokens_match(out["output_ids"], ref.sequences[0, len(prompt):].tolist(),
                            [s[0] for s in ref.logits], tie_tol=Q8_TIE_TOL,
                            label=f"{arch} packed GGUF prompt {i}")


def test_kept_quantized_equals_dequantized_at_load(files, monkeypatch):
    """The same file, --quantization gguf against --load-format gguf_dequantize (float32):
    one forward's logits, the packed layers on float activations (the default,
    gguf_matmul.matmul; the paths' equality; this qwen3's logits move by up to 1.2 with
    8-bit activations, whose error the test above bounds against transformers)."""
    from helpers.runner import forward_logits, make_runner

    monkeypatch.delenv("KVSTRATA_GGUF_INT8_ACTIVATIONS", raising=False)

    path, _ = files["qwen3"]
    ids = [5, 17, 99, 250, 3, 42, 7, 8, 200, 101]
    kw = dict(skip_tokenizer_init=True, dtype="float32", page_size=16, max_total_tokens=256)
    runner = make_runner(path, quantization="gguf", **kw)
    assert runner.model.gguf_info["activations"] == "float32"
    packed = forward_logits(runner, ids)
    floats = forward_logits(make_runner(path, load_format="gguf_dequantize", **kw), ids)
    torch.testing.assert_close(packed, floats, atol=LOGITS_ATOL, rtol=0)


def test_type_without_kernel_is_dequantized_at_load(tmp_path, caplog, monkeypatch):
    """Q3_K (no packed kernel): its tensors load as float, logged once, the rest packed."""
    from kvstrata.config.model_source import load_hf_config, resolve_model_path
    from kvstrata.runner.models.loader import load_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    types = {**TYPES, 1: {**TYPES[1], "o_proj": "Q3_K", "down_proj": "Q3_K"}}
    path = str(tmp_path / "q3_k.gguf")
    _, reference = write_decoder_gguf("qwen3", path, types=types)
    source = resolve_model_path(path)
    with caplog.at_level(logging.WARNING, logger="kvstrata.runner.models.gguf_weights"):
        model = load_model(source, load_hf_config(source), "float32", keep_quantized=True)
    assert "2 tensors of type Q3_K have no packed kernel" in caplog.text
    layer = model.layers[1]
    assert isinstance(layer.o_weight, torch.Tensor)  # float: F.linear through gguf_linear
    torch.testing.assert_close(layer.o_weight, reference["model.layers.1.self_attn.o_proj.weight"])
    assert type(model.layers[0].o_weight).__name__ == "GgufLinear"
