"""SmolLM2-135M-Instruct (Q4_1 GGUF): our runner vs transformers on the same dequantized file.

The reference is transformers' LlamaForCausalLM filled by transformers' own GGUF loader
(dequantize + reverse q/k permutation), independent of ours. (from_pretrained(gguf_file=...)
would need `accelerate`, which is not a dependency; load_gguf_checkpoint is what it calls.)
"""
from __future__ import annotations

import pytest
import torch

from helpers.compare import assert_tokens_match
from helpers.driver import greedy_generate
from helpers.runner import forward_logits

PROMPT = "What is the capital of France?"
N_TOKENS = 32


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_gguf_path):
    from kvstrata.bench.hf_reference import load_hf_model
    from kvstrata.config.model_source import load_tokenizer, resolve_model_path

    tok = load_tokenizer(resolve_model_path(smollm2_gguf_path))
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}],
                                  add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    # transformers' own GGUF reader (not ours) fills transformers' LlamaForCausalLM.
    model = load_hf_model(smollm2_gguf_path)
    config = model.config
    with torch.no_grad():
        prefill = model(torch.tensor([ids])).logits[0]
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=N_TOKENS,
                             min_new_tokens=N_TOKENS, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=config.pad_token_id)
    tokens = out.sequences[0, len(ids):].tolist()
    return ids, prefill, tokens, [s[0] for s in out.logits], tok


@pytest.fixture(scope="module")
def smollm2_runner(smollm2_gguf_path):
    from helpers.runner import make_runner

    return make_runner(smollm2_gguf_path, page_size=16, max_total_tokens=4096,
                       max_running_requests=8, context_length=2048)


def test_smollm2_gguf_matches_transformers(smollm2_runner, smollm2_reference):
    ids, prefill, ref_tokens, ref_logits, tok = smollm2_reference
    torch.testing.assert_close(forward_logits(smollm2_runner, ids), prefill, atol=2e-3, rtol=0)
    ours = greedy_generate(smollm2_runner, [ids], N_TOKENS)[0]
    assert_tokens_match(ours, ref_tokens, ref_logits, label="smollm2")
    text = tok.decode(ours, skip_special_tokens=True)
    assert "Paris" in text, text
    assert 2 in smollm2_runner.eos_token_ids  # <|im_end|>


def test_smollm2_batched_equals_alone(smollm2_runner, smollm2_reference):
    """The same prompt among other requests decodes to the same tokens as alone."""
    ids, _, ref_tokens, ref_logits, _ = smollm2_reference
    outs = greedy_generate(smollm2_runner, [ids, ids[3:20]], 8, chunk=11, arrivals=[1, 0])
    assert_tokens_match(outs[0], ref_tokens[:8], ref_logits, label="smollm2 batched")
