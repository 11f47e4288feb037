"""SmolLM2-135M-Instruct's bundled Q4_1 GGUF served with its weights kept quantized
(`--quantization gguf`) against the same file dequantized at load (`--load-format
gguf_dequantize`, float32): the greedy answers to two chat prompts are equal (or first leave
the dequantized model's where it is at a near-tie), and the perplexity of a fixed text is
within 1% of the dequantized model's.

Both multiply the same weights (gguf's dequantized values) with float32 activations (the
default kernel); only the kernels' summation order differs, so the ratio is ~1.000 and the
bound catches a wrong block layout, a lost q/k un-permutation or a misplaced fused segment
(each costs far more than 1%). The opt-in 8-bit activations (KVSTRATA_GGUF_INT8_ACTIVATIONS=1,
llama.cpp's scheme) move SmolLM2's logits along TEXT by 0.16 on average and by at most 1.25
(measured, on logits of ~25): the ratio stays ~1 (0.995 measured), and greedy answers may part
where the dequantized model's top tokens are closer than that (Q8_TIE_TOL).

With --enable-deterministic-inference (one engine, test_deterministic_inference_kept_quantized)
a seeded and a greedy request answer alike alone, beside another request with their prompts
chunked, and as a radix hit: tokens and logprobs bit for bit (runner/quant/gguf_pinned.py).

It runs where runner/cpu/gguf_matmul.py's AVX2 body runs. Its portable C body (a CPU without
AVX2 + FMA + F16C) gives the same bits ~17x slower: this test's ~20 forwards would take
minutes of make test's budget there, so it is skipped by name; the tiny checkpoints in
test_gguf_packed.py cover that body. Measured with float activations (gguf-kern at 1d24cab):
perplexity 19.5732 both ways, both greedy answers matched, the first one naming Paris; with
the 8-bit activations (q8dot): 19.5732 vs 19.4786 (ratio 0.995), the first answer parting at
its first token within Q8_TIE_TOL (the dequantized model's top two 0.08 apart: "L'Étoile, ..."
instead of naming Paris) and the second matching.
"""
from __future__ import annotations

import math

import pytest
import torch

from helpers.compare import assert_tokens_match
from helpers.driver import greedy_generate
from helpers.runner import forward_logits, make_runner

PROMPTS = ["What is the capital of France?", "Name three primary colors."]
NEW_TOKENS = 10
PPL_MAX_RATIO = 1.01
# Where greedy may part: the dequantized model's logit of the packed run's token within this
# of its top (float32 sums in another order move logits by far less) ...
TIE_TOL = 1e-2
# ... and with 8-bit activations: the largest logit change they made along TEXT, 1.25, rounded up
Q8_TIE_TOL = 1.5
TEXT = ("The library opens at nine in the morning and closes at six in the evening. On "
        "Saturdays it closes at noon, and on Sundays it stays closed. Members may borrow up to "
        "five books at a time for three weeks; a book that comes back late costs ten cents a "
        "day. The reading room on the second floor is quiet, and phones must be switched off "
        "there. Children under twelve need an adult with them after four o'clock. Each year, "
        "in the first week of June, the library sells the books it no longer needs, and the "
        "money buys new ones.")

pytestmark = pytest.mark.slow


def _portable_matmul() -> bool:
    from kvstrata.runner.cpu import gguf_matmul

    # (not kernel_name() != AVX2_KERNEL: a VNNI CPU's name says so too, which skipped it there)
    return not gguf_matmul._own()


def _perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
    picked = logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1))
    return math.exp(-float(picked.mean()))


@pytest.mark.skipif(_portable_matmul(), reason="gguf_matmul's portable C body (no AVX2 + FMA + "
                    "F16C here) is ~17x slower than its AVX2 body: too slow for make test")
def test_smollm2_kept_quantized_equals_dequantized_at_load(smollm2_gguf_path, monkeypatch):
    from kvstrata.config.model_source import load_tokenizer, resolve_model_path

    tok = load_tokenizer(resolve_model_path(smollm2_gguf_path))
    prompts = []
    for q in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}],
                                      add_generation_prompt=True, tokenize=True)
        prompts.append(ids if isinstance(ids, list) else ids["input_ids"])
    text = tok(TEXT)["input_ids"]
    assert len(text) >= 100
    kw = dict(page_size=16, max_total_tokens=1024, context_length=512, max_running_requests=4)
    floats = make_runner(smollm2_gguf_path, load_format="gguf_dequantize", dtype="float32", **kw)
    ref_ppl = _perplexity(forward_logits(floats, text), text)
    refs = greedy_generate(floats, prompts, NEW_TOKENS)
    # the dequantized model's logits along its own greedy path: the tie rule's reference
    ref_logits = [forward_logits(floats, p + r)[len(p) - 1:-1] for p, r in zip(prompts, refs)]
    del floats
    for int8 in (False, True):  # the default float activations, then the opt-in 8-bit ones
        monkeypatch.setenv("KVSTRATA_GGUF_INT8_ACTIVATIONS", "1" if int8 else "0")
        packed = make_runner(smollm2_gguf_path, quantization="gguf", **kw)
        assert type(packed.model.layers[0].qkv_weight).__name__ == "GgufLinear"
        assert packed.model.gguf_info["activations"] == ("int8 blocks of 32" if int8
                                                         else "float32")
        ppl = _perplexity(forward_logits(packed, text), text)
        outs = greedy_generate(packed, prompts, NEW_TOKENS)
        del packed
        ratio = ppl / ref_ppl
        print(f"perplexity dequantized {ref_ppl:.4f} kept quantized (int8 activations "
              f"{int8}) {ppl:.4f} ratio {ratio:.5f}")
        assert 1 / PPL_MAX_RATIO <= ratio <= PPL_MAX_RATIO
        for q, out, ref, logits in zip(PROMPTS, outs, refs, ref_logits):
            assert_tokens_match(out, ref, list(logits), tie_tol=Q8_TIE_TOL if int8 else TIE_TOL,
                                label=f"{q} int8 {int8}")
        if not int8:  # with 8-bit activations the first token's near-tie may flip (above)
            answer = tok.decode(outs[0], skip_special_tokens=True)
            assert "Paris" in answer, answer


SEEDED = {"max_new_tokens": 12, "temperature": 0.8, "seed": 11, "logprobs": 0,
          "ignore_eos": True}
GREEDY = {"max_new_tokens": 12, "temperature": 0, "logprobs": 0, "ignore_eos": True}


@pytest.mark.skipif(_portable_matmul(), reason="gguf_matmul's portable C body (no AVX2 + FMA + "
                    "F16C here) is ~17x slower than its AVX2 body: too slow for make test")
def test_deterministic_inference_kept_quantized(smollm2_gguf_path):
    """--enable-deterministic-inference kept quantized, at the auto dtype (float32 with
    --quantization gguf; runner/quant/gguf_pinned.py): a seeded and a greedy request answer
    with the same tokens and logprobs alone on a cold engine, side by side with a third
    request (prompts chunked by 32), and again with their prompt a radix hit. One engine."""
    from kvstrata import LLM

    def run(llm, prompts, sps):
        outs = llm.generate(prompts, sampling_params=sps)
        return [(o["output_ids"], [lp for lp, _ in o["meta_info"]["output_token_logprobs"]],
                 o["meta_info"]["cached_tokens"]) for o in outs]

    prompt = TEXT + " When does the library close on Saturdays?"
    with LLM(smollm2_gguf_path, quantization="gguf", enable_deterministic_inference=True,
             chunked_prefill_size=32, max_total_tokens=4096) as llm:
        assert llm.server_info()["quantization_info"]["batch_invariant"]
        alone = []
        for sp in (SEEDED, GREEDY):
            llm.flush_cache()
            alone.append(run(llm, [prompt], [sp])[0])
        llm.flush_cache()
        mixed = run(llm, [prompt, PROMPTS[0] * 3, prompt], [SEEDED, GREEDY, GREEDY])
        warm = run(llm, [prompt, prompt], [SEEDED, GREEDY])
    assert all(w[2] > 0 for w in warm), "the warm requests were meant to hit the cache"
    for got in ([mixed[0], mixed[2]], warm):
        assert [g[:2] for g in got] == [a[:2] for a in alone]
