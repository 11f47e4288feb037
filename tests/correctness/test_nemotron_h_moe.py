"""Nemotron-H with MoE blocks (E in hybrid_override_pattern: nemotron_h_moe.py) against
transformers, float32: a tiny random checkpoint from transformers' NemotronHConfig
(tests/helpers/hybrid_ckpt.py: blocks M E * M E, 8 relu^2 experts in 2 groups of which the
router keeps 1, top-2, a correction bias), served by kvstrata.LLM with the state slots and
snapshot prefix cache; the MoE blocks keep nothing per request.

- the plan: state for the 2 Mamba2 blocks, K/V for the 1 attention block, nothing for MoE;
- prefill logits within PREFILL_ATOL of transformers';
- greedy tokens equal transformers' at page sizes 1 and 16 (chunks of 16 that divide no
  prompt), and a second chat turn's hit at the first turn's snapshot;
- the experts read from either checkpoint layout (transformers' [E, I, H] stacks or one
  tensor per expert), and with moe_latent_size (the latent projections around the experts);
- an expert activation other than relu^2 is refused by name.
Pools and state slots are whole after every drain.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.hybrid_ckpt import (build_nemotron_h_moe_checkpoint, hf_hybrid, hf_logits,
                                 hybrid_runner, tiny_nemotron_h_moe_config)
from helpers.hybrid_engine import check_greedy_and_second_turn, one_model_fixtures
from helpers.runner import forward_logits

NEW = 8
LENS = (1, 29, 50)
PREFILL_ATOL = 1e-4


path, ref, prompts, engines = one_model_fixtures(build_nemotron_h_moe_checkpoint, 23, LENS,
                                                 max_total_tokens=1024,
                                                 max_mamba_cache_size=24)


def test_moe_blocks_keep_nothing(engines):
    llm = engines.get(16, 16)
    model, facts = llm.engine.runner.model, llm.engine.runner.kv_facts()
    assert model.block_type_names == ["linear_attention", "moe", "full_attention",
                                      "linear_attention", "moe"]
    conv, ssm = facts.state_components
    assert conv.num_layers == ssm.num_layers == 2
    assert [c.num_layers for c in facts.components] == [1, 1]


def test_prefill_logits_match_transformers(engines, ref, prompts):
    ours = forward_logits(engines.get(1).engine.runner, prompts[-1])
    assert (ours - hf_logits(ref.model, prompts[-1])).abs().max().item() < PREFILL_ATOL


@pytest.mark.parametrize("page_size,chunk", [(1, None), (16, 16)])
def test_greedy_and_second_turn_hit(page_size, chunk, engines, prompts, ref):
    check_greedy_and_second_turn(engines.get(page_size, chunk), prompts, ref, page_size, NEW,
                                 f"P={page_size} chunk={chunk}")


def _other_layout(src: str, dst: str) -> int:
    """A copy of checkpoint `src` with its experts in the other layout; how many expert
    tensors it rewrote."""
    os.makedirs(dst)
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            with open(os.path.join(src, name), "rb") as fh, \
                    open(os.path.join(dst, name), "wb") as out:
                out.write(fh.read())
    tensors, changed = {}, 0
    for name in (n for n in os.listdir(src) if n.endswith(".safetensors")):
        for key, t in load_file(os.path.join(src, name)).items():
            head, _, tail = key.partition(".experts.")
            parts = tail.split(".")
            if tail and len(parts) == 1:                     # stack -> one per expert
                for e in range(t.shape[0]):
                    tensors[f"{head}.experts.{e}.{tail}.weight"] = t[e].clone()
                changed += 1
            elif tail and len(parts) == 3:                   # one per expert -> stack
                stack = f"{head}.experts.{parts[1]}"
                tensors.setdefault(stack, {})[int(parts[0])] = t
                changed += 1
            else:
                tensors[key] = t
    tensors = {k: (torch.stack([v[e] for e in sorted(v)]) if isinstance(v, dict) else v)
               for k, v in tensors.items()}
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    index = os.path.join(dst, "model.safetensors.index.json")
    if os.path.exists(index):
        os.remove(index)
    return changed


def test_expert_layouts_and_latent_projection(path, tmp_path, prompts, engines):
    """The same weights with the experts in the other layout give the same logits; a
    checkpoint with moe_latent_size matches transformers."""
    other = str(tmp_path / "other_layout")
    assert _other_layout(path, other) > 0
    ours = forward_logits(engines.get(1).engine.runner, prompts[-1])
    again = forward_logits(hybrid_runner(other, num_pages=256), prompts[-1])
    assert torch.equal(ours, again)
    latent = build_nemotron_h_moe_checkpoint(str(tmp_path / "latent"), seed=77,
                                             moe_latent_size=32, mlp_bias=False)
    with open(os.path.join(latent, "config.json")) as fh:
        assert json.load(fh)["moe_latent_size"] == 32
    theirs = hf_logits(hf_hybrid(latent), prompts[-1])
    got = forward_logits(hybrid_runner(latent, num_pages=256), prompts[-1])
    assert (got - theirs).abs().max().item() < PREFILL_ATOL


def test_expert_activation_refused_by_name():
    from kvstrata.runner.models.nemotron_h import NemotronHForCausalLM

    config = tiny_nemotron_h_moe_config(hybrid_override_pattern="ME")
    config.mlp_hidden_act = "silu"
    with pytest.raises(ValueError, match="mlp_hidden_act"):
        NemotronHForCausalLM(config, torch.float32, torch.device("meta"))
