"""DeepSeek-V3, V2 and V2-Lite's shape (runner/models/deepseek.py: MLA without the DSA
indexer, attention/mla_dense.py) against transformers on tiny random checkpoints
(helpers/moe_ckpt.py, float32): prefill logits within 1e-4, greedy tokens equal (near-tie
rule) on pages of 1 and 16, batched and chunked with staggered arrivals; through the engine
with chunked prefill and a radix hit; V3's rope_interleave false and a Kimi-K2 style config
(model_type kimi_k2, legacy rope fields); what these models do not run is refused by name.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers.family_checks import (MODES, assert_greedy_in_mode_matches,
                                   assert_prefill_logits_match, assert_prefix_hit_matches,
                                   assert_ngram_equals_plain, cached_runner,
                                   random_prompts)
from helpers.gemma_ckpt import hf_greedy
from helpers.moe_ckpt import MLA_MOES, VOCAB, build_moe_checkpoint, hf_moe, moe_checkpoints
from helpers.runner import forward_logits, make_runner

PREFILL_ATOL = 1e-4
NEW_TOKENS = 12
PROMPT_LENS = (1, 9, 17, 40)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    return moe_checkpoints(str(tmp_path_factory.mktemp("mla_moe")), MLA_MOES)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(7, PROMPT_LENS, VOCAB)


@pytest.fixture(scope="module")
def references(paths, prompts) -> dict:
    return {a: hf_greedy(hf_moe(paths[a]), prompts, NEW_TOKENS) for a in MLA_MOES}


_runner = cached_runner


def _hf_logits(path: str, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_moe(path)(torch.tensor([prompt])).logits[0]


@pytest.mark.parametrize("arch", MLA_MOES)
def test_model_is_built_as_configured(arch, paths):
    from kvstrata.runner.attention.mla_dense import MLADenseBackend

    runner = _runner(paths[arch])
    model = runner.model
    assert runner.plan.pool_kind == "mla"
    assert [c.name for c in runner.plan.components] == ["kv_latent"]  # no indexer keys
    assert isinstance(model.attn_backend, MLADenseBackend)
    assert model.dims.mlp_layer_types == ("dense", "sparse", "sparse")
    layer, moe = model.layers[0], model.layers[1].mlp
    assert (layer.q_proj is not None) == (arch == "deepseek_v2_lite")
    assert layer.index_wk is None
    assert (moe.score_bias is not None) == (arch == "deepseek_v3")
    d = model.dims
    assert (d.scoring, d.topk_method, d.n_group) == {
        "deepseek_v3": ("sigmoid", "noaux_tc", 4), "deepseek_v2_lite": ("softmax", "greedy", 1),
        "deepseek_v2": ("softmax", "group_limited_greedy", 4)}[arch]


@pytest.mark.parametrize("arch", MLA_MOES)
def test_prefill_logits_match_transformers(arch, paths, prompts):
    assert_prefill_logits_match(_runner(paths[arch]), hf_moe(paths[arch]), prompts,
                                PREFILL_ATOL)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", MLA_MOES)
def test_greedy_matches_transformers(arch, mode, paths, prompts, references):
    assert_greedy_in_mode_matches(_runner(paths[arch], MODES[mode][0]), mode, prompts,
                                  references[arch], NEW_TOKENS, arch)


def test_prefix_hit_and_chunked_prefill_match_transformers(paths, prompts):
    """Through the engine (V3, MLA pool): chunks of 16 on pages of 16, then a request whose
    first 32 tokens come from the radix cache; tokens and the first logprob equal
    transformers'."""
    path = paths["deepseek_v3"]
    assert_prefix_hit_matches(path, hf_moe(path), prompts[-1], PREFILL_ATOL)


def test_ngram_speculation_equals_plain(paths):
    """NGRAM drafts verified through dense MLA attention (V3): a verify is a multi-token
    extend over cached latents."""
    assert_ngram_equals_plain(paths["deepseek_v3"])


def test_starved_pool_with_hicache_matches_transformers(paths):
    """V3's latent pages through the host tier: a device pool of 128 tokens, far smaller
    than the conversations, with HiCache; tokens equal transformers' and the host tier
    served some."""
    from helpers.compare import assert_match_transformers
    from tests.correctness.test_hicache_engine import (assert_host_tier_served, make_llm,
                                                       multi_turn)

    path = paths["deepseek_v3"]
    llm = make_llm(path, max_total_tokens=128, enable_hierarchical_cache=True,
                   hicache_mem_layout="page_first", hicache_io_backend="kernel",
                   hicache_size=0, hicache_ratio=8.0)
    try:
        prompts, outputs = multi_turn(llm, conversations=2, turns=4)
        assert_host_tier_served(llm)
    finally:
        llm.shutdown()
    assert_match_transformers(path, prompts, outputs, label="v3 hicache vs transformers")


def test_rope_halves_and_kimi_k2_config(paths, prompts, tmp_path):
    """rope_interleave false (same weights, rotary on halves) equals transformers, whose
    logits differ from the interleaved model's; a Kimi-K2 style config.json (model_type
    kimi_k2, which transformers does not register, rope_theta + rope_scaling {"type": yarn})
    of the V3 weights is read through DeepseekV3Config and serves the same logits."""
    prompt = prompts[-1]
    halves = build_moe_checkpoint("deepseek_v3", str(tmp_path / "halves"),
                                  rope_interleave=False)
    ref = _hf_logits(halves, prompt)
    assert (ref - _hf_logits(paths["deepseek_v3"], prompt)).abs().max() > 1e-2
    torch.testing.assert_close(forward_logits(_runner(halves), prompt), ref,
                               atol=PREFILL_ATOL, rtol=0)

    kimi = tmp_path / "kimi"
    shutil.copytree(paths["deepseek_v3"], kimi)
    cfg = json.loads((kimi / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg.update(model_type="kimi_k2", rope_theta=rope.pop("rope_theta"),
               rope_scaling={"type": rope.pop("rope_type"), **rope},
               auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    (kimi / "config.json").write_text(json.dumps(cfg))
    torch.testing.assert_close(forward_logits(_runner(str(kimi)), prompt),
                               _hf_logits(paths["deepseek_v3"], prompt), atol=PREFILL_ATOL,
                               rtol=0)


# ---------------------------------------------------------------- what is refused, by name
def _with_config(src: str, dst, **fields) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(fields)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_unsupported_fields_and_features_are_refused_by_name(paths, tmp_path):
    v3, v2 = paths["deepseek_v3"], paths["deepseek_v2"]
    fp8 = _with_config(v3, tmp_path / "fp8", quantization_config={"quant_method": "fp8"})
    with pytest.raises(ValueError, match=r"DeepseekV3ForCausalLM: config fields not "
                                         r"implemented by kvstrata: \['quantization_config'\]"):
        make_runner(fp8, max_total_tokens=256)
    renorm = _with_config(v2, tmp_path / "renorm", norm_topk_prob=True)
    with pytest.raises(ValueError, match="DeepseekV2ForCausalLM: norm_topk_prob=True is not "
                                         "supported"):
        make_runner(renorm, max_total_tokens=256)
    scoring = _with_config(v3, tmp_path / "scoring", scoring_func="softmax")
    with pytest.raises(ValueError, match="scoring_func='softmax' is not supported"):
        make_runner(scoring, max_total_tokens=256)
    rope = _with_config(v3, tmp_path / "rope",
                        rope_parameters={"rope_type": "mrope", "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="rope_type 'mrope' is not supported"):
        make_runner(rope, max_total_tokens=256)
    with pytest.raises(ValueError, match="NEXTN: DeepseekV2ForCausalLM has no MTP layer"):
        make_runner(v2, max_total_tokens=256, speculative_algorithm="NEXTN",
                    speculative_num_steps=1, speculative_eagle_topk=1,
                    speculative_num_draft_tokens=2)
