"""NEXTN on DeepSeek-V3 (MLA without the DSA indexer): the checkpoint's MTP layer drafts over
dense MLA attention (attention/mla_dense.py) in its own one-layer latent pool.

A tiny random V3 (helpers/moe_ckpt.py; layer outputs scaled so that the MTP layer drafts
well: OUTPUT_SCALE) with one MTP layer stored as DeepSeek's releases store it (model.layers.{num_hidden_layers}.*: enorm / hnorm / eh_proj / shared_head beside a MoE
decoder layer). The draft's logits, over a prompt extended in one forward and then token by
token from the cached latents, equal transformers' own DeepseekV3DecoderLayer run as the MTP
layer over transformers' final-normed hidden states. Greedy output with NEXTN equals plain
greedy (itself transformers') on pages of 1 and 16, chunked, with radix hits and under
retraction. PD: tests/correctness/test_mla_pd_engine.py; V2's refusal (it has no MTP layer):
test_deepseek_families.py. What is not built is refused by name.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from helpers.family_checks import random_prompts
from helpers.gemma_ckpt import hf_greedy
from helpers.moe_ckpt import VOCAB, add_v3_mtp_layer, build_moe_checkpoint, hf_moe
from kvstrata import LLM
from tests.correctness.test_speculative import drained
from tests.correctness.test_speculative_mtp import _llm
from tests.helpers.compare import assert_tokens_match

NEW_TOKENS = 16
# Layer outputs scaled down and eh_proj passing the embedding through (moe_ckpt.py): most
# drafts pass, the rest fail where the context tips the target.
OUTPUT_SCALE = 0.02
PROMPT_LENS = (1, 5, 9, 17, 23, 40)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> tuple[str, str]:
    """(the V3 checkpoint without MTP weights, the same with one MTP layer)."""
    root = tmp_path_factory.mktemp("v3_mtp")
    base = build_moe_checkpoint("deepseek_v3", str(root / "base"))
    return base, add_v3_mtp_layer(base, str(root / "mtp"), OUTPUT_SCALE)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(5, PROMPT_LENS, VOCAB)


def _greedy(llm: LLM, prompts, new_tokens: int = NEW_TOKENS) -> list[dict]:
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    return llm.generate(input_ids=prompts, sampling_params=[params] * len(prompts))


@pytest.fixture(scope="module")
def plain_outputs(paths, prompts) -> list[list[int]]:
    path = paths[1]
    refs = hf_greedy(hf_moe(path), prompts, NEW_TOKENS)
    llm = _llm(path, False, max_total_tokens=2048)
    try:
        outs = [o["output_ids"] for o in _greedy(llm, prompts)]
    finally:
        llm.shutdown()
    for i, (out, (ref, logits)) in enumerate(zip(outs, refs)):
        assert_tokens_match(out, ref, logits, label=f"plain {i}")
    return outs


# ------------------------------------------------------------ the draft against transformers
def _hf_mtp_logits(path: str, prompt: list[int]) -> torch.Tensor:
    """The MTP layer's logits at positions 0..n-2 (reading x_{i+1} and h_i), with
    transformers' modules: its model over num_hidden_layers + 1 layers loads the MTP
    layer's decoder weights as the last layer; the target pass runs the others."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    with open(f"{path}/config.json") as f:
        n = json.load(f)["num_hidden_layers"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="eager",
                                              num_hidden_layers=n + 1).eval()
    pre = f"model.layers.{n}."
    weights = {k[len(pre):]: v for k, v in load_file(f"{path}/model.safetensors").items()
               if k.startswith(pre)}
    h_size, eps = hf.config.hidden_size, hf.config.rms_norm_eps

    def norm(name):
        module = type(hf.model.norm)(h_size, eps=eps)
        module.weight.data.copy_(weights[name])
        return module

    ids = torch.tensor([prompt])
    with torch.no_grad():
        hf.config.num_hidden_layers = n  # the target: its own layers, then the final norm
        hidden = hf.model(ids).last_hidden_state
        hf.config.num_hidden_layers = n + 1
        x = F.linear(torch.cat((norm("enorm.weight")(hf.model.embed_tokens(ids[:, 1:])),
                                norm("hnorm.weight")(hidden[:, :-1])), dim=-1),
                     weights["eh_proj.weight"])
        t = x.shape[1]
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        x = hf.model.layers[n](x, attention_mask=mask, position_ids=pos,
                               position_embeddings=hf.model.rotary_emb(x, pos))
        return hf.lm_head(norm("shared_head.norm.weight")(x))[0]


def test_draft_logits_match_transformers(paths, prompts):
    from kvstrata.runner.attention.mla_dense import MLADenseBackend
    from tests.helpers.eagle_heads import runner_after_prompt

    path, prompt = paths[1], prompts[-1]
    runner, _ = runner_after_prompt(path, path, "EAGLE", prompt)
    draft = runner.draft
    assert isinstance(draft.model.attn_backend, MLADenseBackend)
    assert [c.name for c in draft.kv_components()] == ["kv_latent", "eagle_hidden"]
    assert not draft.index_share
    # packed as the target's layers are (deepseek_packed.py): their logits are checked below
    assert type(draft.model.layer.kv_a_proj).__name__ == "PackedLinear"
    assert type(draft.model.eh_proj).__name__ == "PackedLinear"
    n, first = len(prompt), 24
    got = []
    with torch.inference_mode():
        # positions 0..first-1 in one extend, then one at a time over the cached latents
        spans = [(0, first)] + [(p, p + 1) for p in range(first, n - 1)]
        for lo, hi in spans:
            fb = draft._batch([prompt[lo + 1:hi + 1]], [1], [lo])
            fb.logits_idx = None
            feats = draft.features[fb.out_slots]
            logits, _ = draft.model(fb, feats)
            got.append(logits)
    torch.testing.assert_close(torch.cat(got), _hf_mtp_logits(path, prompt), atol=1e-4,
                               rtol=0)


# ------------------------------------------------------------------- greedy equals plain
@pytest.mark.parametrize("page_size,chunk", [(1, None), (16, 16)])
def test_greedy_equals_plain(paths, prompts, plain_outputs, page_size, chunk):
    kw = {"chunked_prefill_size": chunk} if chunk else {}
    llm = _llm(paths[1], True, page_size=page_size, max_total_tokens=2048, **kw)
    try:
        assert_twice_equal_with_drafts_passing(llm, lambda: _greedy(llm, prompts), plain_outputs)
    finally:
        llm.shutdown()


def assert_twice_equal_with_drafts_passing(llm: LLM, run, want: list[list[int]]) -> None:
    """`run()` twice (the second from the radix cache): tokens equal `want` each time, more
    drafts pass than there are requests (a commit of the wrong step would show), and the
    pools drain whole."""
    for label in ("first", "radix hits"):
        outs = run()
        assert [o["output_ids"] for o in outs] == want, label
        assert sum(o["meta_info"]["spec_accept_token_num"] for o in outs) > len(want), label
    assert sum(o["meta_info"]["cached_tokens"] for o in outs) > 0
    drained(llm)


def test_greedy_under_retraction(paths, prompts):
    """Longer answers from a pool of 128 tokens that admits more than fits (conservativeness
    0.3): requests are retracted and resumed; tokens equal a plain run's with a large
    pool."""
    path, new = paths[1], 48
    plain = _llm(path, False, max_total_tokens=2048)
    try:
        want = [o["output_ids"] for o in _greedy(plain, prompts, new)]
    finally:
        plain.shutdown()
    llm = _llm(path, True, page_size=4, chunked_prefill_size=16, max_total_tokens=128,
               schedule_conservativeness=0.3)  # admits more than fits: retractions
    try:
        outs = _greedy(llm, prompts, new)
        assert llm.engine.scheduler.num_retractions > 0
        assert [o["output_ids"] for o in outs] == want
        drained(llm)
    finally:
        llm.shutdown()


# ------------------------------------------------------------------------- refused by name
def test_refusals(paths, tmp_path):
    base, mtp = paths
    # transformers' DeepseekV3Config writes num_nextn_predict_layers 1 by default: a V3
    # checkpoint without the layer's weights says so by name
    with pytest.raises(ValueError, match=r"has no MTP layer weights \(model\.layers\.3\.\*, "
                                         r"although its config.json says "
                                         r"num_nextn_predict_layers 1\)"):
        _llm(base, True)
    shared = tmp_path / "shared"
    shutil.copytree(mtp, shared)
    cfg = json.loads((shared / "config.json").read_text())
    (shared / "config.json").write_text(json.dumps({**cfg,
                                                    "index_share_for_mtp_iteration": True}))
    with pytest.raises(ValueError, match="index_share_for_mtp_iteration is true but "
                                         "DeepseekV3ForCausalLM has no DSA indexer"):
        _llm(str(shared), True)
    with pytest.raises(NotImplementedError, match="--speculative-eagle-topk > 1 with NEXTN"):
        _llm(mtp, True, speculative_eagle_topk=2, speculative_num_draft_tokens=4)
