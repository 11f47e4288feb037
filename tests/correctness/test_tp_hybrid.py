"""Tensor parallelism over the recurrent hybrids (runner/parallel/tp_hybrid.py), float32,
tiny random checkpoints (tests/helpers/hybrid_ckpt.py):

- every family at tp 2 in one 2-process gloo group (a ModelRunner per rank driven by
  hand-built steps): Qwen3.5 (Gated DeltaNet, GVA 2 key : 4 value heads), Qwen3-Next (its
  MoE by width), Nemotron-H (2 Mamba2 groups split), Mamba2 (no attention), Granite-4.0-H
  (its MoE), Granite with n_groups 1 (B / C replicated, the gated norm's one group across
  both ranks), Falcon-H1 (attention and Mamba2 side by side, every muP multiplier, the
  norm before the gate, the mixer's biases: rank 0's out_proj bias) and Nemotron-H with MoE
  blocks (experts by width, with and without the latent projections and their biases). Each rank's prefill logits are transformers' (2e-4, as the one-rank models'),
  its greedy tokens are transformers' with prompts in chunks that do and do not divide them
  arriving staggered, and its state slot holds half the heads (conv channels, SSM states);
- the whole engine (`LLM(tp_size=2)`) over Qwen3.5 and Nemotron-H: greedy tokens equal
  transformers' in chunked prefill, a second chat turn hits the snapshot its first left,
  every pool and state slot whole after the drain, and every rank applied the same steps
  and sampled the same tokens (KVSTRATA_CHECK_INTEGRITY checks each rank's req_to_token rows
  after every step); NGRAM chains over Qwen3.5 (and STANDALONE over Qwen3-Next, a soak)
  at tp 2 with transformers' tokens and accepted drafts;
- refusals by name: head counts, groups and widths the size does not divide, an
  architecture without a tensor-parallel class.
"""
from __future__ import annotations

import pytest
import torch

from helpers.hybrid_ckpt import (VOCAB, HFGreedy, build_falcon_h1_checkpoint,
                                 build_hybrid_checkpoint, build_nemotron_h_moe_checkpoint,
                                 hf_hybrid, hf_logits)
from tests.helpers.rank_processes import results_from_ranks

PREFILL_ATOL = 2e-4
NEW_TOKENS = 8
PROMPT_LENS = (1, 29, 40)
# label -> (arch, config overrides, the conv / ssm slot shapes of one rank at tp 2)
MODELS = {
    "qwen3_5": ("qwen3_5", {}, ((40, 3), (2, 8, 12))),
    "qwen3_next": ("qwen3_next", {}, ((40, 3), (2, 8, 12))),
    "nemotron_h": ("nemotron_h", {}, ((48, 3), (2, 8, 16))),
    "mamba2": ("mamba2", {}, ((96, 3), (4, 16, 16))),
    "granite": ("granite", {}, ((96, 3), (2, 32, 16))),
    "granite_one_group": ("granite", {"mamba_n_groups": 1}, ((96, 3), (2, 32, 16))),
    "falcon_h1": ("falcon_h1", {}, ((64, 3), (2, 16, 16))),
    "nemotron_h_moe": ("nemotron_h_moe", {}, ((48, 3), (2, 8, 16))),
    "nemotron_h_moe_latent": ("nemotron_h_moe_latent", {}, ((48, 3), (2, 8, 16))),
}


def build_latent_moe_with_biases(path: str) -> str:
    """Nemotron-H's MoE with the latent projections and every bias drawn away from 0 (a
    row-parallel bias added on both ranks would show)."""
    from helpers.hybrid_ckpt import tiny_nemotron_h_moe_config
    from helpers.tiny_ckpt import build_checkpoint

    def redraw(name: str, p) -> None:
        if name.endswith(("bias", "gate.weight")):
            p.normal_(0.0, 0.3)
        elif name.endswith("A_log"):
            p.uniform_(-1.0, 1.0)

    return build_checkpoint(tiny_nemotron_h_moe_config(moe_latent_size=32, mlp_bias=True),
                            path, 4343, redraw)


BUILDERS = {"falcon_h1": build_falcon_h1_checkpoint,
            "nemotron_h_moe": build_nemotron_h_moe_checkpoint,
            "nemotron_h_moe_latent": build_latent_moe_with_biases}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp_hybrids")
    return {label: BUILDERS[arch](str(root / label), **over) if arch in BUILDERS
            else build_hybrid_checkpoint(arch, str(root / label), **over)
            for label, (arch, over, _) in MODELS.items()}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _runner(path: str, group):
    from kvstrata.config.kv_plan import KVPlan
    from kvstrata.runner.model_runner import ModelRunner

    runner = ModelRunner(path, dtype="float32", device="cpu", tp_group=group)
    facts = runner.kv_facts()
    runner.allocate_kv(KVPlan(1, 1024, 8, 256, facts.pool_kind, facts.components,
                              num_state_slots=8, state_components=facts.state_components))
    shapes = tuple(c.slot_shape for c in facts.state_components)
    kv = [c.token_shape[0] for c in facts.components]
    return runner, shapes, kv


def _rank(rank: int, size: int, port: int, paths: dict, prompts: list, out) -> None:
    import torch.distributed as dist

    from helpers.driver import greedy_in_mode
    from helpers.runner import forward_logits
    from kvstrata.runner.parallel.tensor_parallel import TPGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    try:
        for label, path in paths.items():  # one group for every model
            runner, shapes, kv = _runner(path, TPGroup(rank, size))
            logits = forward_logits(runner, prompts[-1])
            tokens = greedy_in_mode(runner, prompts, NEW_TOKENS, batched=True, chunk=7,
                                    staggered=True)
            out.put((label, rank, logits.tolist(), tokens, shapes, kv))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranked(paths, prompts) -> dict:
    """label -> [(rank, prefill logits, greedy tokens, state slot shapes, KV heads)]."""
    got = results_from_ranks(_rank, 2, (paths, prompts), 2 * len(paths), timeout_s=300)
    return {label: sorted((r, torch.tensor(lg), *rest) for q, r, lg, *rest in got
                          if q == label) for label in paths}


@pytest.mark.parametrize("label", list(MODELS))
def test_tp2_ranks_equal_transformers(label, paths, prompts, ranked):
    hf = hf_hybrid(paths[label])
    ref_logits = hf_logits(hf, prompts[-1])
    greedy = HFGreedy(paths[label])
    greedy.model = hf
    ref_tokens = [greedy(p, NEW_TOKENS) for p in prompts]
    results = ranked[label]
    assert [r for r, *_ in results] == [0, 1]
    for rank, logits, tokens, shapes, kv in results:
        assert (logits - ref_logits).abs().max().item() < PREFILL_ATOL, (label, rank)
        assert tokens == ref_tokens, (label, rank)
        assert shapes == MODELS[label][2], (label, rank)  # half the heads' state per rank
        assert kv == ([] if label == "mamba2" else [1, 1])  # 1 of 2 KV heads, K and V


# ---------------------------------------------------------------- the engine
# Soaks (KVSTRATA_SOAK=1, ~15 s each): the Mamba2 families through the engine at page 16
# (their ranks' arithmetic runs in make test above), Granite's replicated group with the
# norm's all-reduce on the shared-memory collectives.
ENGINE_CASES = [("qwen3_5", 1, 7),
                pytest.param("nemotron_h", 16, 16, marks=pytest.mark.soak),
                pytest.param("granite_one_group", 16, 16, marks=pytest.mark.soak)]


@pytest.mark.parametrize("label,page_size,chunk", ENGINE_CASES)
def test_tp2_engine_prefix_hit_and_chunks(label, page_size, chunk, paths, prompts):
    """Greedy equals transformers in chunked prefill at tp 2; the second chat turn hits the
    first turn's snapshot (at page 16: extra_buffer's track slot, the last whole page); every
    pool and state slot whole after each drain; every rank's steps and tokens the same."""
    from helpers.hybrid_engine import check_greedy_and_second_turn
    from kvstrata import LLM

    ref = HFGreedy(paths[label])
    with LLM(paths[label], tp_size=2, skip_tokenizer_init=True, dtype="float32",
             page_size=page_size, chunked_prefill_size=chunk, max_total_tokens=1024,
             max_mamba_cache_size=24) as llm:
        check_greedy_and_second_turn(llm, prompts, ref, page_size, NEW_TOKENS, f"{label} tp2")
        digests = llm.engine.runner.digests()
        plan = llm.server_info()["kv_plan"]
    assert len({str(d) for d in digests}) == 1 and digests[0]["steps"] > 0
    conv, ssm = plan["state_components"]
    assert (tuple(conv["slot_shape"]), tuple(ssm["slot_shape"])) == MODELS[label][2]


SPEC_CASES = [("NGRAM", "qwen3_5"), pytest.param("STANDALONE", "qwen3_next",
                                                 marks=pytest.mark.soak)]


@pytest.mark.parametrize("algorithm,label", SPEC_CASES)
def test_tp2_speculative_chains(algorithm, label, paths, prompts, tmp_path):
    """NGRAM (twice: the second round drafts from the first's answers) and STANDALONE (a
    bigram llama draft run whole on every rank, soak) at tp 2: each rank's verify keeps its
    heads' per-step states and commits the accepted one; greedy equals transformers', drafts
    are accepted, pools whole, every rank the same steps and tokens."""
    from helpers.hybrid_engine import whole
    from kvstrata import LLM
    from tests.correctness.test_hybrid_spec_engine import bigram_draft

    ref, new = HFGreedy(paths[label]), 24
    kw = {"speculative_algorithm": algorithm}
    if algorithm == "STANDALONE":
        kw["speculative_draft_model_path"] = bigram_draft(
            str(tmp_path / "draft"), [p + ref(p, new) for p in prompts])
    accepted = []
    with LLM(paths[label], tp_size=2, skip_tokenizer_init=True, dtype="float32",
             max_total_tokens=2048, max_mamba_cache_size=48,
             speculative_disable_by_batch_size=1 << 20, **kw) as llm:
        for _ in range(2 if algorithm == "NGRAM" else 1):
            outs = llm.generate(input_ids=prompts, sampling_params={
                "temperature": 0, "max_new_tokens": new, "ignore_eos": True})
            whole(llm)
            assert [o["output_ids"] for o in outs] == [ref(p, new) for p in prompts]
            accepted.append(sum(o["meta_info"]["spec_accept_token_num"] for o in outs))
        digests = llm.engine.runner.digests()
    assert accepted[-1] > 0, accepted
    assert len({str(d) for d in digests}) == 1


# ---------------------------------------------------------------- refusals
def _split(arch: str, size: int, **overrides):
    from helpers.hybrid_ckpt import ARCH_NAMES, tiny_hybrid_config, tiny_nemotron_h_moe_config
    from kvstrata.runner.parallel.tp_hybrid import tp_class

    if arch == "nemotron_h_moe":
        config, arch = tiny_nemotron_h_moe_config(), "nemotron_h"
    else:
        config = tiny_hybrid_config(arch)
    for field, value in overrides.items():
        setattr(config, field, value)
    return tp_class(ARCH_NAMES[arch], size).plan(config, 0, size)


@pytest.mark.parametrize("arch,size,overrides,match", [
    ("qwen3_5", 3, {}, "--tp-size 3 must divide num_attention_heads 4"),
    ("qwen3_5", 4, {}, "--tp-size 4 must divide linear_num_key_heads 2"),
    ("qwen3_next", 2, {"moe_intermediate_size": 25}, "must divide moe_intermediate_size 25"),
    ("nemotron_h", 4, {}, "--tp-size 4 must divide the Mamba2 layers' n_groups 2"),
    ("mamba2", 16, {}, "--tp-size 16 must divide the Mamba2 layers' num_heads 8"),
    ("nemotron_h_moe", 2, {"moe_shared_expert_intermediate_size": 41},
     "must divide moe_shared_expert_intermediate_size 41"),
])
def test_shares_that_are_not_built_are_refused_by_name(arch, size, overrides, match):
    with pytest.raises(ValueError, match=match):
        _split(arch, size, **overrides)


def test_n_groups_one_is_replicated_and_split_groups_are_whole_per_rank():
    one = _split("granite", 2, mamba_n_groups=1).mamba
    assert one.replicated_groups and one.groups == (0, 1) and one.local.n_groups == 1
    two = _split("nemotron_h", 2).mamba
    assert not two.replicated_groups and two.groups == (0, 1) and two.local.heads == 2
    assert _split("qwen3_5", 2).value_heads == (0, 2)  # key head 0 and its 2 value heads


def test_an_architecture_without_a_split_is_refused_by_name():
    from kvstrata.runner.parallel.tp_hybrid import tp_class

    with pytest.raises(ValueError, match="tensor parallelism is not built for "
                                         "KimiLinearForCausalLM"):
        tp_class("KimiLinearForCausalLM", 2)
