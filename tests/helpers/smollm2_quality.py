"""SmolLM2 quality measurements shared by the bf16 and w8a8 guards
(tests/correctness/test_bf16_quality.py, test_w8a8_int8.py): perplexity of the first
PPL_TOKENS tokens of docs/architecture.md from the engine's prompt logprobs, greedy answers
to the smoke prompts (chat template, top-5 logprobs), the "Paris" continuation and
/server_info.

Both guards compare against the same float32 run; it is measured once per suite run and
shared by the test workers through a file (pytest-xdist runs the two files on different
workers, often at the same time: the second one waits for the first one's result).
"""
from __future__ import annotations

import math
import os
import pickle

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PPL_TOKENS = 1100
ANSWER_TOKENS = 32
TOP_LOGPROBS = 5
FACT_PREFIX = "The capital of France is"
SMOKE = ["What is the capital of France?", "Name three primary colors.",
         "Write a haiku about the sea.", "What is 12 times 7?",
         "Explain in one sentence what a CPU does."]


def measure(gguf_path: str, answers: int = len(SMOKE), **llm_kwargs) -> dict:
    """One engine with `llm_kwargs` (dtype=..., quantization=...): ppl, n (scored tokens),
    answers (generate results for the first `answers` SMOKE prompts), fact (the text after
    FACT_PREFIX), info."""
    from kvstrata import LLM

    with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as fh:
        text = fh.read()
    with LLM(model_path=gguf_path, context_length=2048, max_total_tokens=4096, page_size=16,
             **llm_kwargs) as llm:
        passage = llm.tokenizer(text)["input_ids"][:PPL_TOKENS]
        assert len(passage) == PPL_TOKENS
        out = llm.generate(input_ids=passage, return_logprob=True,
                           sampling_params={"max_new_tokens": 1, "temperature": 0})
        lps = out["meta_info"]["input_token_logprobs"]
        prompts = []
        for q in SMOKE[:answers]:
            ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                    add_generation_prompt=True, tokenize=True)
            prompts.append(ids if isinstance(ids, list) else ids["input_ids"])
        answers = llm.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": ANSWER_TOKENS, "temperature": 0, "logprobs": TOP_LOGPROBS})
        fact = llm.generate(input_ids=prompts[0] + llm.tokenizer(FACT_PREFIX)["input_ids"],
                            sampling_params={"max_new_tokens": 3, "temperature": 0})
        info = llm.server_info()
    return {"ppl": math.exp(-sum(lps) / len(lps)), "n": len(lps), "answers": answers,
            "fact": fact["text"], "info": info}


def float32_reference(gguf_path: str, shared_dir: str) -> dict:
    """measure(dtype="float32"), computed by the first caller of the run and read back from
    `shared_dir` by the others."""
    from filelock import FileLock

    path = os.path.join(shared_dir, "smollm2_float32_quality.pkl")
    with FileLock(path + ".lock"):
        if not os.path.exists(path):
            result = measure(gguf_path, dtype="float32")
            with open(path + ".tmp", "wb") as fh:
                pickle.dump(result, fh)
            os.replace(path + ".tmp", path)
        with open(path, "rb") as fh:
            return pickle.load(fh)


def first_difference(got: dict, ref: dict, top_n: int = TOP_LOGPROBS) -> tuple[int, float] | None:
    """(index, gap) of the first token where `got` leaves `ref`'s greedy answer: gap is ref's
    top logprob minus ref's logprob of got's token among ref's top_n there (inf when absent);
    None when the answers are equal."""
    i = next((i for i, (a, b) in enumerate(zip(got["output_ids"], ref["output_ids"]))
              if a != b), None)
    if i is None:
        return None
    ranked = sorted(dict(ref["meta_info"]["output_top_logprobs"][i]).items(),
                    key=lambda kv: -kv[1])[:top_n]
    top = dict(ranked)
    return i, max(top.values()) - top.get(got["output_ids"][i], -math.inf)
