"""NEXTN on Qwen3-Next, Qwen3.5 and Qwen3.5-MoE: their MTP layer (runner/models/qwen3_next_mtp.py,
a gated full-attention layer; Qwen3.5's with its dense MLP, Qwen3.5-MoE's with its MoE block:
routed experts, shared expert and its gate) drafts beside the recurrent target
(runner/spec/mtp_hybrid.py); the target's verify keeps one Gated DeltaNet state per draft step
and commits the accepted one.

A tiny random Qwen3-Next / Qwen3.5 / Qwen3.5-MoE (helpers/hybrid_ckpt.py; layer outputs scaled
down so that an MTP layer passing the embedding through drafts well: OUTPUT_SCALE) with an MTP
layer written the way Qwen's releases store it (`mtp.pre_fc_norm_embedding`,
`mtp.pre_fc_norm_hidden`, `mtp.fc`, `mtp.layers.0.*`, `mtp.norm`; transformers skips them;
SGLang's Qwen3_5ForCausalLMMTP reads Qwen3.5's and Qwen3.5-MoE's under these names, the experts
one tensor per expert). An MTP layer with an MoE block (Qwen3.5-MoE's; Qwen3-Next's with decoder_sparse_step 1,
tests/correctness/test_tp_nextn_hybrid.py) copies the target's last full-attention layer
(transformers' MoE layer holds its experts fused, so a fresh one would not save under the
released per-expert names). The draft's logits, over an extend and then token by token
from its cached K/V, equal transformers' own decoder layer (Qwen3NextDecoderLayer /
Qwen3_5DecoderLayer) run as the MTP layer over transformers' final-normed hidden states; greedy
output with NEXTN equals plain greedy (itself transformers') with radix hits (state snapshots)
and chunked prefill, drafts accepted and the pools whole.
Refusals (trees, other hybrids): tests/unit/test_resolution_recurrent.py; PD:
tests/correctness/test_hybrid_pd_engine.py.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from helpers.family_checks import random_prompts
from helpers.hybrid_ckpt import (VOCAB, HFGreedy, build_hybrid_checkpoint,
                                 build_qwen3_5_moe_checkpoint, hf_hybrid)
from helpers.tiny_ckpt import scale_outputs
from kvstrata import LLM
from tests.correctness.test_speculative_mtp import _llm
from tests.correctness.test_speculative_mtp_mla import assert_twice_equal_with_drafts_passing

NEW_TOKENS = 12
PROMPT_LENS = (3, 9, 17, 30)
MTP_ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def _mtp_layer_config(config):
    """The target's config for one full-attention layer at index 0 (the MTP layer's)."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers, cfg.layer_types = 1, ["full_attention"]
    return cfg


# Layer outputs (attention, Gated DeltaNet, MLP and expert down projections) scaled by this,
# in the target and the MTP layer alike: each token's logits are then mostly its embedding's
# through the head (a bigram), which the MTP layer -- fc passing the embedding half through --
# also predicts, so most drafts pass and the rest fail where the context (the recurrent state
# included) tips the target: the verify's commit of an accepted step is exercised often.
OUTPUT_SCALE = 0.02


def _decoder_layer(hf):
    """transformers' decoder layer class of the model (Qwen3NextDecoderLayer or
    Qwen3_5DecoderLayer): the MTP layer is one of them at index 0, full attention."""
    return type(hf.model.layers[0])


def _copied_layer(hf) -> int | None:
    """The target layer an MTP layer with an MoE block copies (the model's last
    full-attention layer, an MoE one too), or None: a fresh transformers decoder layer (a
    dense MLP)."""
    if not hasattr(hf.model.layers[0].mlp, "experts"):
        return None
    kinds = hf.config.layer_types
    last = max(i for i, kind in enumerate(kinds) if kind == "full_attention")
    assert hasattr(hf.model.layers[last].mlp, "experts")
    return last


def add_mtp_layer(src: str, seed: int = 97) -> str:
    """`src` with its layer outputs scaled (OUTPUT_SCALE) plus MTP weights (a transformers
    decoder layer's, renamed, or on a MoE model a copy of its last full-attention layer's;
    fc mostly the embedding half) and the config fields Qwen's releases carry."""
    from safetensors.torch import load_file, save_file

    hf = hf_hybrid(src)
    torch.manual_seed(seed)
    h = hf.config.hidden_size
    tensors = load_file(f"{src}/model.safetensors")
    copied = _copied_layer(hf)
    if copied is not None:
        prefix = f"model.layers.{copied}."
        tensors.update({"mtp.layers.0." + k[len(prefix):]: v.clone()
                        for k, v in list(tensors.items()) if k.startswith(prefix)})
    else:
        layer = _decoder_layer(hf)(_mtp_layer_config(hf.config), 0)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0, 0.3)  # zero-centred norms: w of 0 would hide the + 1
                tensors[f"mtp.layers.0.{name}"] = p.detach().clone()
    scale_outputs(tensors, OUTPUT_SCALE)  # the target's and the MTP layer's
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        tensors[f"mtp.{name}.weight"] = torch.randn(h) * 0.1
    tensors["mtp.norm.weight"] = tensors["model.norm.weight"].clone()
    tensors["mtp.fc.weight"] = torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1) + (
        torch.randn(h, 2 * h) * 0.02)
    save_file({k: v.contiguous() for k, v in tensors.items()}, f"{src}/model.safetensors",
              metadata={"format": "pt"})
    with open(f"{src}/config.json") as f:
        raw = json.load(f)
    raw.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    with open(f"{src}/config.json", "w") as f:
        json.dump(raw, f, indent=1)
    return src


@pytest.fixture(scope="module", params=MTP_ARCHS)
def path(request, tmp_path_factory) -> str:
    arch = request.param
    root = tmp_path_factory.mktemp(f"{arch}_mtp")
    if arch == "qwen3_5_moe":
        return add_mtp_layer(build_qwen3_5_moe_checkpoint(str(root / arch)))
    return add_mtp_layer(build_hybrid_checkpoint(arch, str(root / arch)))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(3, PROMPT_LENS, VOCAB)


def hf_mtp_logits(path: str, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' final-normed hidden states of the prompt, and the MTP layer's logits
    at positions 0..n-2 (reading x_{i+1} and h_i) with its decoder layer."""
    from safetensors.torch import load_file

    hf = hf_hybrid(path)
    mtp = {k[len("mtp."):]: v for k, v in load_file(f"{path}/model.safetensors").items()
           if k.startswith("mtp.")}
    copied = _copied_layer(hf)
    if copied is not None:  # the MTP layer's weights are this layer's (add_mtp_layer)
        layer = copy.deepcopy(hf.model.layers[copied]).eval()
    else:
        layer = _decoder_layer(hf)(_mtp_layer_config(hf.config), 0).eval()
        layer.load_state_dict({k[len("layers.0."):]: v for k, v in mtp.items()
                               if k.startswith("layers.0.")})
    size, eps = hf.config.hidden_size, hf.config.rms_norm_eps

    def norm(name):
        module = type(hf.model.norm)(size, eps=eps)
        module.weight.data.copy_(mtp[name])
        return module

    ids = torch.tensor([prompt])
    with torch.no_grad():
        hidden = hf.model(ids).last_hidden_state  # final-normed
        x = F.linear(torch.cat((norm("pre_fc_norm_embedding.weight")(
            hf.model.embed_tokens(ids[:, 1:])), norm("pre_fc_norm_hidden.weight")(
            hidden[:, :-1])), dim=-1), mtp["fc.weight"])
        t = x.shape[1]
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        x = layer(x, position_embeddings=hf.model.rotary_emb(x, pos), attention_mask=mask,
                  position_ids=pos)
        return hidden[0], hf.lm_head(norm("norm.weight")(x))[0]


def runner_with_draft(path: str, prompt_len: int, tp_group=None):
    """A ModelRunner (a tensor-parallel rank's with `tp_group`) with the MTP draft over a
    small hand-sized plan (state pool included), row 1 holding slots 1.. for the prompt."""
    from kvstrata.config.kv_plan import KVPlan
    from kvstrata.runner.model_runner import ModelRunner

    runner = ModelRunner(path, dtype="float32", device="cpu", draft_model_path=path,
                         draft_algorithm="EAGLE", tp_group=tp_group)
    facts = runner.kv_facts()
    runner.allocate_kv(KVPlan(1, 64, 2, 64, facts.pool_kind, facts.components,
                              draft_components=facts.draft_components, num_state_slots=4,
                              state_components=facts.state_components))
    runner.req_to_token.write_many([1], [0], [list(range(1, prompt_len + 3))])
    return runner


def draft_logits(draft, prompt: list[int], hidden: torch.Tensor,
                 first: int = 16) -> torch.Tensor:
    """The MTP draft's logits at positions 0..n-2 of `prompt` (row 1 of its runner), over an
    extend of the first `first` positions and then one position at a time from its cached
    K/V, its features `hidden` (transformers' final-normed states)."""
    n = len(prompt)
    draft.features[1:n + 1] = hidden
    got = []
    with torch.inference_mode():
        for lo, hi in [(0, first)] + [(p, p + 1) for p in range(first, n - 1)]:
            fb = draft._batch([prompt[lo + 1:hi + 1]], [1], [lo])
            fb.logits_idx = None
            logits, _ = draft.model(fb, draft.features[fb.out_slots])
            got.append(logits)
    return torch.cat(got)


def test_draft_logits_match_transformers(path, prompts):
    """The draft alone (its linears packed as the target's): its features are transformers'
    hidden states (the end-to-end test below feeds it ours)."""
    from kvstrata.runner.cpu.packed_linear import PackedLinear

    prompt = prompts[-1]
    hidden, want = hf_mtp_logits(path, prompt)
    draft = runner_with_draft(path, len(prompt)).draft
    assert [c.name for c in draft.kv_components()] == ["k", "v", "eagle_hidden"]
    # packed as the target is (qwen3_next_mtp.load_qwen3_next_mtp): no float matrix left
    head = draft.model
    assert isinstance(head.fc, PackedLinear) and isinstance(head.layer.mixer.qkv, PackedLinear)
    torch.testing.assert_close(draft_logits(draft, prompt, hidden), want, atol=1e-4, rtol=0)


def _greedy(llm: LLM, prompts) -> list[dict]:
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    return llm.generate(input_ids=prompts, sampling_params=[params] * len(prompts))


def test_greedy_equals_plain_and_transformers(path, prompts):
    reference = HFGreedy(path)
    plain = _llm(path, False, max_total_tokens=2048)
    try:
        want = [o["output_ids"] for o in _greedy(plain, prompts)]
    finally:
        plain.shutdown()
    for i, prompt in enumerate(prompts):
        assert want[i] == reference(prompt, NEW_TOKENS), f"plain {i}"
    llm = _llm(path, True, max_total_tokens=2048, chunked_prefill_size=8)
    try:
        assert type(llm.engine.runner.draft).__name__ == "Qwen3NextMTPDraft"
        # drafts pass often (OUTPUT_SCALE): committing another step's state would show
        assert_twice_equal_with_drafts_passing(llm, lambda: _greedy(llm, prompts), want)
    finally:
        llm.shutdown()
