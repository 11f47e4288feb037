"""Falcon-H1 (attention and a Mamba2 mixer side by side in every layer, muP multipliers) against
transformers, float32: tiny random checkpoints from transformers' FalconH1Config
(tests/helpers/hybrid_ckpt.py: every multiplier away from 1, the gated group norm before the
gate, the mixer's biases on), served by kvstrata.LLM with the real scheduler, state slots and
snapshot prefix cache. Every layer has K/V pages and a state in each slot: the plan's K/V and
state components both cover all of them.

- the plan: K/V and conv / ssm state for every layer, the slots asked for;
- prefill logits within PREFILL_ATOL of transformers';
- greedy tokens equal transformers' at page sizes 1 and 16, whole prompts and chunks of 16
  that divide none of them (a chunk carries the state in the request's slot);
- prefix hits: a second chat turn resumes at the snapshot the first turn left (page size 1:
  its end; 16: the last page end), K/V and state both from there;
- the mixer without its norm (mamba_rms_norm false, the released checkpoints' setting) and
  without biases, through the runner;
- fields not built are refused by name; so is a layer mix where a parallel layer's index
  would differ between the KV pool and the state pool.
Pools and state slots are whole after every drain.
"""
from __future__ import annotations

import pytest
import torch

from helpers.driver import greedy_in_mode
from helpers.hybrid_ckpt import (HFGreedy, build_falcon_h1_checkpoint, hf_logits,
                                 hybrid_runner, tiny_falcon_h1_config)
from helpers.hybrid_engine import check_greedy_and_second_turn, one_model_fixtures
from helpers.runner import forward_logits

NEW = 8
LENS = (1, 29, 50)  # one token, under two pages, across three; chunks of 16 divide none
PREFILL_ATOL = 1e-4
LAYERS = 3


path, ref, prompts, engines = one_model_fixtures(build_falcon_h1_checkpoint, 17, LENS,
                                                 max_total_tokens=1024,
                                                 max_mamba_cache_size=24)


def test_every_layer_has_kv_and_state(engines):
    llm = engines.get(16, 16)
    plan, facts = llm.server_info()["kv_plan"], llm.engine.runner.kv_facts()
    assert type(llm.engine.runner.model).__name__ == "FalconH1ForCausalLM"
    conv, ssm = facts.state_components
    # conv: 4 heads x 16 + 2 groups x 2 x 16 channels, kernel 4; ssm: (heads, head_dim, d_state)
    assert (conv.slot_shape, ssm.slot_shape) == ((128, 3), (4, 16, 16))
    assert conv.num_layers == ssm.num_layers == LAYERS
    assert [c.num_layers for c in facts.components] == [LAYERS, LAYERS]  # K and V
    assert plan["pool_kind"] == "mha" and plan["num_state_slots"] == 24
    assert llm.engine.runner.model.pool_index == list(range(LAYERS))


def test_prefill_logits_match_transformers(engines, ref, prompts):
    ours = forward_logits(engines.get(1).engine.runner, prompts[-1])
    theirs = hf_logits(ref.model, prompts[-1])
    assert (ours - theirs).abs().max().item() < PREFILL_ATOL


@pytest.mark.parametrize("page_size,chunk", [(1, None), (16, 16)])
def test_greedy_and_second_turn_hit(page_size, chunk, engines, prompts, ref):
    check_greedy_and_second_turn(engines.get(page_size, chunk), prompts, ref, page_size, NEW,
                                 f"P={page_size} chunk={chunk}")


def test_mixer_without_norm_or_biases(tmp_path, prompts):
    """Falcon-H1's released configs: mamba_rms_norm false (y * silu(z), no norm weight),
    no projection biases; a tied head."""
    path = build_falcon_h1_checkpoint(str(tmp_path / "plain"), seed=97, mamba_rms_norm=False,
                                      mamba_proj_bias=False, projectors_bias=False,
                                      tie_word_embeddings=True)
    runner = hybrid_runner(path, page_size=1, num_pages=1024)
    hf = HFGreedy(path)
    theirs = hf_logits(hf.model, prompts[-1])
    assert (forward_logits(runner, prompts[-1]) - theirs).abs().max().item() < PREFILL_ATOL
    got = greedy_in_mode(runner, prompts, NEW, batched=True, chunk=7, staggered=True)
    assert got == [hf(p, NEW) for p in prompts]


@pytest.mark.parametrize("field,value", [("attention_bias", True), ("mlp_bias", True),
                                         ("hidden_act", "gelu"),
                                         ("ssm_multipliers", [1.0, 1.0]),
                                         ("attn_layer_indices", [0, 2]),
                                         ("mamba_use_mlp", False)])
def test_unbuilt_fields_are_refused_by_name(field, value):
    from kvstrata.runner.models.falcon_h1 import FalconH1ForCausalLM

    config = tiny_falcon_h1_config()
    setattr(config, field, value)
    with pytest.raises(ValueError, match=field):
        FalconH1ForCausalLM(config, torch.float32, torch.device("meta"))



def test_parallel_layers_share_one_index_in_both_pools():
    """A parallel layer's K/V and state sit at the same index in their pools, so every
    attention layer before it must be parallel too; a mix that breaks it is refused."""
    from kvstrata.runner.models.hybrid_base import (FULL_ATTENTION, PARALLEL, RECURRENT,
                                                    HybridForCausalLM)

    meta = torch.device("meta")
    model = HybridForCausalLM([PARALLEL, PARALLEL, PARALLEL], torch.float32, meta)
    assert (model.pool_index, model.num_attention_layers, model.num_recurrent_layers) == (
        [0, 1, 2], 3, 3)
    for kinds in ([FULL_ATTENTION, PARALLEL], [PARALLEL, RECURRENT, PARALLEL]):
        with pytest.raises(ValueError, match="parallel layer"):
            HybridForCausalLM(kinds, torch.float32, meta)
