"""NEXTN at --tp-size 2 over Qwen3.5 and Qwen3-Next (runner/models/qwen3_next_mtp.py over a
rank of runner/parallel/tp_hybrid.py): each rank's MTP layer holds its query / KV heads' share
of the gated attention and its width's share of the MLP (an MoE block: every expert's and the
shared expert's slice, router and shared gate replicated), its one-layer K/V pool its KV heads;
its partial sums are all-reduced, its logits all-gathered from the vocabulary-parallel head.
Checkpoints with an MTP layer as tests/correctness/test_speculative_mtp_hybrid.py writes them.

- ranks (one 2-process gloo group, a ModelRunner per rank): each rank's draft logits, over an
  extend and then position by position from its cached K/V, equal the transformers reference
  of the one-rank test (its decoder layer run as the MTP layer over transformers' hidden
  states) -- Qwen3.5 (dense MLP) and Qwen3-Next with every layer MoE (decoder_sparse_step 1,
  so the MTP layer's MLP is the MoE block);
- the engine (`LLM(tp_size=2)`, NEXTN) over Qwen3.5: greedy tokens equal transformers' (which
  one rank's equal, with and without the draft: the one-rank test) twice, the second round
  from the snapshot prefix cache, in chunked prefill; drafts accepted; pools and state slots
  whole; every rank the same steps and tokens.
"""
from __future__ import annotations

import pytest
import torch

from helpers.family_checks import random_prompts
from helpers.hybrid_ckpt import VOCAB, HFGreedy, build_hybrid_checkpoint
from tests.correctness.test_speculative_mtp_hybrid import (add_mtp_layer, draft_logits,
                                                           hf_mtp_logits, runner_with_draft)
from tests.helpers.rank_processes import results_from_ranks

NEW_TOKENS = 16
# label -> (arch, config overrides)
MODELS = {"qwen3_5": ("qwen3_5", {}),
          "qwen3_next_moe_mtp": ("qwen3_next", {"decoder_sparse_step": 1})}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp_nextn")
    return {label: add_mtp_layer(build_hybrid_checkpoint(arch, str(root / label), **over))
            for label, (arch, over) in MODELS.items()}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(3, (3, 9, 30), VOCAB)


def _rank(rank: int, size: int, port: int, cases: dict, prompt: list[int], out) -> None:
    import torch.distributed as dist

    from kvstrata.runner.parallel.tensor_parallel import TPGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    try:
        for label, (path, hidden) in cases.items():  # one group for every model
            draft = runner_with_draft(path, len(prompt), TPGroup(rank, size)).draft
            logits = draft_logits(draft, prompt, torch.tensor(hidden))
            heads = [c.token_shape[0] for c in draft.kv_components() if c.name in ("k", "v")]
            out.put((label, rank, logits.tolist(), heads))
    finally:
        dist.destroy_process_group()


def test_tp2_draft_logits_equal_transformers(paths, prompts):
    prompt = prompts[-1]
    refs = {label: hf_mtp_logits(path, prompt) for label, path in paths.items()}
    cases = {label: (paths[label], hidden.tolist()) for label, (hidden, _) in refs.items()}
    got = results_from_ranks(_rank, 2, (cases, prompt), 2 * len(cases), timeout_s=300)
    assert sorted((label, rank) for label, rank, *_ in got) == [
        (label, r) for label in sorted(paths) for r in (0, 1)]
    for label, rank, logits, heads in got:
        torch.testing.assert_close(torch.tensor(logits), refs[label][1], atol=1e-4, rtol=0,
                                   msg=lambda m: f"{label} rank {rank}: {m}")
        assert heads == [1, 1], (label, rank)  # 1 of the 2 KV heads, K and V


def test_tp2_engine_nextn_equals_transformers(paths, prompts):
    from helpers.hybrid_engine import whole
    from kvstrata import LLM

    path = paths["qwen3_5"]
    ref = HFGreedy(path)
    want = [ref(p, NEW_TOKENS) for p in prompts]
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    with LLM(path, tp_size=2, skip_tokenizer_init=True, dtype="float32",
             chunked_prefill_size=8, max_total_tokens=2048, max_mamba_cache_size=48,
             speculative_algorithm="NEXTN", speculative_disable_by_batch_size=1 << 20) as llm:
        for label in ("first", "radix hits"):
            outs = llm.generate(input_ids=prompts, sampling_params=params)
            whole(llm)
            assert [o["output_ids"] for o in outs] == want, label
            assert sum(o["meta_info"]["spec_accept_token_num"] for o in outs) > len(prompts)
        assert sum(o["meta_info"]["cached_tokens"] for o in outs) > 0
        digests = llm.engine.runner.digests()
    assert len({str(d) for d in digests}) == 1 and digests[0]["steps"] > 0
