"""`LLM(tp_size=N)`: the whole engine under tensor parallelism (issue 23) -- one scheduler on
rank 0, every other rank a real process applying its SchedulerOutputs -- against the same
engine on one rank and against transformers. Each (model, tp) case runs one engine through
three prompts twice (chunked prefill; the second time from the radix cache) and then the
whole batch in a pool too small for it (retraction), with logprobs; every rank's digests of the steps it applied and the
tokens it sampled must equal rank 0's, and KVSTRATA_CHECK_INTEGRITY (on in the test suite)
checks every rank's req_to_token rows after every step."""
from __future__ import annotations

import os
import random

import pytest

from helpers.compare import assert_tokens_match
from tests.conftest import GREEDY_TOKENS

GREEDY = {"max_new_tokens": GREEDY_TOKENS, "min_new_tokens": GREEDY_TOKENS, "temperature": 0,
          "logprobs": 2}
# A pool the 8-prompt batch outgrows (retraction), chunks of 16 (the 45- and 70-token prompts
# take several), pages of 4.
ENGINE = dict(page_size=4, chunked_prefill_size=16, max_total_tokens=224,
              schedule_conservativeness=0.1, skip_tokenizer_init=True)


def run_case(path: str, tp: int, prompts: list[list[int]]) -> dict:
    from kvstrata import LLM

    with LLM(model_path=path, tp_size=tp, **ENGINE) as llm:
        first = llm.generate(input_ids=prompts[3:6], sampling_params=GREEDY)
        again = llm.generate(input_ids=prompts[3:6], sampling_params=GREEDY)
        batch = llm.generate(input_ids=prompts, sampling_params=GREEDY)
        retractions = llm.get_load()["num_retractions"]
        llm.check_integrity()
        digests = llm.engine.runner.digests() if tp > 1 else None
        plan = llm.server_info()["kv_plan"]
    return {"first": first, "again": again, "batch": batch, "retractions": retractions,
            "digests": digests, "plan": plan}


RUNS = {"first": slice(3, 6), "again": slice(3, 6), "batch": slice(0, 8)}


def logprobs(outs) -> list[float]:
    return [lp for o in outs for lp, _ in o["meta_info"]["output_token_logprobs"]]


def check_case(got: dict, one: dict, refs: list, prompts: list, label: str) -> None:
    assert got["retractions"] > 0, label
    assert sum(o["meta_info"]["cached_tokens"] for o in got["again"]) > 0, label
    for run, which in RUNS.items():
        for i, out in enumerate(got[run]):
            ref_tokens, ref_logits = refs[which][i]
            assert_tokens_match(out["output_ids"], ref_tokens, ref_logits,
                                label=f"{label} {run} prompt {i}")
            assert out["output_ids"] == one[run][i]["output_ids"], (label, run, i)
        assert logprobs(got[run]) == pytest.approx(logprobs(one[run]), abs=1e-4), label
    ranks = got["digests"]
    assert all(d == ranks[0] for d in ranks), ranks
    assert ranks[0]["steps"] > 0


@pytest.fixture(scope="module")
def one_rank(tiny_checkpoints, tiny_prompts):
    return {"llama": run_case(tiny_checkpoints["llama"], 1, tiny_prompts)}


# qwen2's q/k/v biases and untied head under TP: tests/correctness/test_tensor_parallel.py
# tp 4 (each KV head replicated on two ranks) is a soak (KVSTRATA_SOAK=1): four ranks on
# `make test`'s two cores; the replicated heads' shard plan is unit-tested at 4 ranks
# (test_tensor_parallel.py test_tp_sizes_that_do_not_divide_are_refused_by_name's TPShard).
@pytest.mark.parametrize("arch,tp", [("llama", 2), pytest.param("llama", 4,
                                                               marks=pytest.mark.soak)])
def test_tp_engine_equals_one_rank(arch, tp, tiny_checkpoints, tiny_prompts, tiny_references,
                                   one_rank):
    """llama: 4 query heads, 2 KV heads, tied head -- at tp 4 each KV head lives on two
    ranks. A rank's KV pool holds its KV heads."""
    got = run_case(tiny_checkpoints[arch], tp, tiny_prompts)
    check_case(got, one_rank[arch], tiny_references[arch], tiny_prompts, f"{arch} tp{tp}")
    # KV heads per pool: 2 on one rank, 1 per rank at tp 2 and (replicated) at tp 4
    assert one_rank[arch]["plan"]["components"][0]["token_shape"][0] == 2
    assert got["plan"]["components"][0]["token_shape"][0] == 1


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory) -> str:
    from helpers.moe_ckpt import build_moe_checkpoint

    return build_moe_checkpoint("qwen3_moe",
                                str(tmp_path_factory.mktemp("tp_moe") / "qwen3_moe"))


# A soak (KVSTRATA_SOAK=1; ~25 s on 2 busy cores): the MoE arithmetic under TP is
# test_tensor_parallel.py's (every MoE family, tp 2 against one rank and transformers, ~2 s);
# this runs the same shard through the serving path (ranks, retraction, radix hits).
@pytest.mark.soak
def test_tp_qwen3_moe_engine(tiny_qwen3_moe, tiny_prompts, shared_tmp_dir):
    """An MoE of the llama family under tp 2 (runner/parallel/tp_moe.py): heads and KV
    heads split as the dense decoder's, experts by index (4 of 8 per rank), the dense first
    layer by width. Tokens equal transformers' (fp32) in every run (the one-rank engine's
    are transformers' too: test_moe_families.py; the logits under tp 2 equal one rank's:
    test_tensor_parallel.py), and every rank applied the same steps."""
    from tests.conftest import shared_references

    got = run_case(tiny_qwen3_moe, 2, tiny_prompts)
    refs = shared_references(tiny_qwen3_moe, tiny_prompts, shared_tmp_dir)
    assert got["retractions"] > 0
    assert sum(o["meta_info"]["cached_tokens"] for o in got["again"]) > 0
    for run, which in RUNS.items():
        for i, out in enumerate(got[run]):
            ref_tokens, ref_logits = refs[which][i]
            assert_tokens_match(out["output_ids"], ref_tokens, ref_logits,
                                label=f"qwen3_moe tp2 {run} prompt {i}")
    assert len({str(d) for d in got["digests"]}) == 1
    assert got["plan"]["components"][0]["token_shape"][0] == 1  # 1 of the 2 KV heads


def test_tp_deepseek_v32_engine(tiny_dsa_4_heads, tiny_prompts):
    """MLA under tp 2: heads split, the latent KV (and the indexer's keys) replicated --
    every rank's pool is the one-rank pool, and every rank's DSA picks the same top-k."""
    one = run_case(tiny_dsa_4_heads, 1, tiny_prompts)
    got = run_case(tiny_dsa_4_heads, 2, tiny_prompts)
    assert got["plan"] == one["plan"]
    for run in RUNS:
        assert [o["output_ids"] for o in got[run]] == [o["output_ids"] for o in one[run]]
        assert logprobs(got[run]) == pytest.approx(logprobs(one[run]), abs=1e-4)
    assert got["retractions"] > 0
    assert len({str(d) for d in got["digests"]}) == 1


def _hicache_rounds(path: str, tp: int, store: str, conversations: dict) -> list[dict]:
    """Round 0: the multi-turn conversations through a device pool far smaller than them
    (pages go to the host pool and come back), a file store behind; round 1: a new engine
    (empty device and host pools) on the same store serves the last prompt's prefix from
    it. Returns each round's outputs and load."""
    from kvstrata import LLM
    from tests.correctness.test_hicache_engine import GREEDY as ANSWER, multi_turn

    extra = f'{{"file_path": "{store}", "prefetch_threshold": 8}}'
    kw = dict(skip_tokenizer_init=True, page_size=4, max_total_tokens=160,
              enable_hierarchical_cache=True, hicache_size=0, hicache_ratio=8.0,
              hicache_storage_backend="file", hicache_storage_prefetch_policy="wait_complete",
              hicache_storage_backend_extra_config=extra)
    rounds = []
    with LLM(model_path=path, tp_size=tp, **kw) as llm:
        prompts, outputs = multi_turn(llm, **conversations)
        rounds.append({"prompts": prompts, "outputs": outputs, "load": llm.get_load()})
        llm.check_integrity()
    with LLM(model_path=path, tp_size=tp, **kw) as llm:
        out = llm.generate(input_ids=prompts[-1], sampling_params=ANSWER)
        rounds.append({"outputs": [out["output_ids"]], "load": llm.get_load()})
        if tp > 1:
            ranks = llm.engine.runner.digests()
            assert all(d == ranks[0] for d in ranks), ranks
    return rounds


# deepseek_v32 is a soak (KVSTRATA_SOAK=1): its MLA pages through the tiers under TP are
# also test_dsa_hicache.py's (one rank) and test_tp_deepseek_v32_engine's (TP, no tiers).
@pytest.mark.parametrize("model", ["llama", pytest.param("deepseek_v32",
                                                         marks=pytest.mark.soak)])
def test_tp_hicache_host_tier_and_file_store(model, tiny_checkpoints, tiny_dsa_4_heads,
                                             tmp_path):
    """HiCache under tp 2: per-rank host pools, every device<->host job ends for the
    scheduler only once it ended on both ranks, storage keys per rank (llama) or one copy
    written by rank 0 and read by both (MLA), storage hits agreed as the minimum over ranks.
    Outputs equal the one-rank engine's with the same tiers."""
    path = tiny_checkpoints["llama"] if model == "llama" else tiny_dsa_4_heads
    talk: dict = {}  # 3 conversations x 5 turns: far more than the 160-token pool
    one = _hicache_rounds(path, 1, str(tmp_path / "one"), talk)
    two = _hicache_rounds(path, 2, str(tmp_path / "two"), talk)
    for r in range(2):
        assert two[r]["outputs"] == one[r]["outputs"], (model, r)
    first, second = two[0]["load"], two[1]["load"]
    assert first["hicache_host_hit_tokens"] > 0 and first["hicache_h2d_pages"] > 0, first
    assert second["hicache_storage_hit_tokens"] > 0, second
    assert second["hicache_storage_hit_tokens"] == one[1]["load"]["hicache_storage_hit_tokens"]
    if model == "deepseek_v32":  # one copy of the latent KV: rank 1 wrote nothing (a
        # second copy would double the store; index records differ by a few bytes)
        assert _bytes_under(tmp_path / "two") < 1.05 * _bytes_under(tmp_path / "one")


def _bytes_under(folder) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def test_speculation_under_tp(tiny_checkpoints, tmp_path):
    """NGRAM (drafts from the scheduler's n-gram cache cross to every rank in the
    SchedulerOutput like any token), STANDALONE (the target drafting for itself; a soak) and EAGLE
    (a head that copies its target, through the rank's vocabulary-parallel embedding and
    output head; draft models run whole on every rank): tp 2 verify steps accept drafts and
    give the plain one-rank tokens and logprobs, every rank applying the same steps."""
    from kvstrata import LLM
    from tests.correctness.test_speculative import assert_same, greedy, repeating_prompts
    from tests.helpers.eagle_heads import copy_head, copyable_target

    prompts = repeating_prompts()[:3]
    target = copyable_target(tiny_checkpoints["llama"], str(tmp_path / "target"))
    drafts = {"NGRAM": None, "EAGLE": copy_head(target, str(tmp_path / "head"))}
    if os.environ.get("KVSTRATA_SOAK") == "1":  # `make test`'s 10 minutes: a draft model
        drafts["STANDALONE"] = target  # whole on every rank is EAGLE's draft path too
    base = dict(model_path=target, skip_tokenizer_init=True, max_total_tokens=2048,
                dtype="float32")
    with LLM(**base) as llm:
        plain = llm.generate(input_ids=prompts, sampling_params=greedy(16))
    for algorithm, draft in drafts.items():
        shape = ({"speculative_num_draft_tokens": 5} if draft is None else
                 {"speculative_draft_model_path": draft, "speculative_num_steps": 3})
        with LLM(**base, tp_size=2, speculative_algorithm=algorithm, **shape,
                 speculative_disable_by_batch_size=1 << 20) as llm:
            spec = llm.generate(input_ids=prompts, sampling_params=greedy(16))
            ranks = llm.engine.runner.digests()
        assert_same(plain, spec)
        assert sum(o["meta_info"]["spec_accept_token_num"] for o in spec) > 0, algorithm
        assert all(d == ranks[0] for d in ranks), algorithm


@pytest.mark.soak  # KVSTRATA_SOAK=1: the tiny models' TP 2 / 4 cases above cover the split
def test_smollm2_gguf_tp3_equals_one_rank(smollm2_gguf_path):
    """The real model on 3 ranks (9 query heads, 3 KV heads: one each; ranks round-robin
    on the cores when there are fewer): greedy tokens and logprobs of one rank."""
    from kvstrata import LLM

    rng = random.Random(11)
    ids = [[rng.randrange(100, 40000) for _ in range(n)] for n in (9, 57)]  # 2 chunks of 32
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    got = {}
    for tp in (1, 3):
        with LLM("smollm2-135m", tp_size=tp, skip_tokenizer_init=True, chunked_prefill_size=32,
                 max_total_tokens=4096) as llm:
            got[tp] = llm.generate(input_ids=ids, sampling_params=params)
    for one, three in zip(got[1], got[3]):
        assert three["output_ids"] == one["output_ids"]
    assert logprobs(got[3]) == pytest.approx(logprobs(got[1]), abs=1e-4)


def test_a_size_the_heads_do_not_split_into_is_a_clear_error(tiny_checkpoints):
    """tp 3 on 4 attention heads: a ValueError naming the flag; the caller's process leaves
    the group and gets its cores back (a later LLM(tp_size=N) can start)."""
    import os

    import torch.distributed as dist

    from kvstrata import LLM

    cores = os.sched_getaffinity(0)
    with pytest.raises(ValueError, match="--tp-size 3 must divide num_attention_heads 4"):
        LLM(model_path=tiny_checkpoints["llama"], tp_size=3, skip_tokenizer_init=True,
            max_total_tokens=256)
    assert not dist.is_initialized()
    assert os.sched_getaffinity(0) == cores
