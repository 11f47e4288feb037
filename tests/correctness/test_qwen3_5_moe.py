"""Qwen3.5-MoE (Qwen3_5MoeForCausalLM, runner/models/qwen3_next.py): Qwen3.5's Gated DeltaNet
and gated attention layers with Qwen3-Next's MoE block in every layer (one tensor per expert,
as transformers saves them), against transformers 5.25's torch path. A tiny random model through the engine: greedy tokens equal transformers'
at page sizes 1 and 16 with chunks that divide no prompt, a prompt sharing an earlier one's
first 40 tokens resumes at a state snapshot; pools and state slots whole after the drain.
"""
from __future__ import annotations

import pytest
import torch

from helpers.hybrid_ckpt import (VOCAB, HFGreedy, assert_drained_whole,
                                 build_qwen3_5_moe_checkpoint)
from kvstrata import LLM

NEW = 8
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return build_qwen3_5_moe_checkpoint(str(tmp_path_factory.mktemp("qwen3_5_moe") / "m"))


@pytest.fixture(scope="module")
def ref(path) -> HFGreedy:
    return HFGreedy(path)


@pytest.mark.parametrize("page_size,chunk", [(1, 7), (16, 16)])
def test_greedy_equals_transformers(page_size, chunk, path, ref):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 29, 70)]
    branch = prompts[-1][:40] + [7, 8, 9]
    with LLM(path, skip_tokenizer_init=True, dtype="float32", page_size=page_size,
             chunked_prefill_size=chunk, max_total_tokens=1024, max_mamba_cache_size=24) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == [ref(p, NEW) for p in prompts]
        out, = llm.generate(input_ids=[branch], sampling_params=GREEDY)
        assert out["meta_info"]["cached_tokens"] > 0
        assert out["output_ids"] == ref(branch, NEW)
        assert_drained_whole(llm)
