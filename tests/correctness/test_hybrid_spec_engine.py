"""Speculative decoding over hybrid recurrent models through kvstrata.LLM: NGRAM and STANDALONE
chains. A verify runs the recurrent layers over every draft token from the request's slot,
keeps each step's state and commits only the accepted step's (runner/recurrent/backend.py;
SGLang's intermediate states), so greedy tokens must equal transformers' whatever is accepted:
- NGRAM at page sizes 1 and 16, first rounds (partial accepts) and repeats (whole chains
  accepted), second chat turns hitting the snapshots the speculative first turns left;
- a stop token inside an accepted run: the request ends before its last accepted draft, so
  its working slot holds a state past its end and is not donated (a second turn resumes from
  an older snapshot or recomputes, exactly);
- STANDALONE with a llama draft (no recurrent layers) whose one layer is a bigram table of
  the target's own greedy outputs, so that drafts are accepted;
- what is refused by name: draft heads, trees, a draft with recurrent layers.
Every KV and state-slot invariant is checked after every step (tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from kvstrata import LLM
from tests.correctness.test_hybrid_engine import (  # noqa: F401 (fixtures)
    GREEDY, paths, prompts, ref, whole)
from tests.helpers.hybrid_ckpt import VOCAB

SPEC = {"speculative_disable_by_batch_size": 1 << 20}  # every decode step verifies drafts
LONG = 24  # tokens per answer: long enough for the n-gram cache to learn a loop


def spec_llm(path, page_size, **kw) -> LLM:
    return LLM(path, skip_tokenizer_init=True, dtype="float32", page_size=page_size,
               max_total_tokens=2048, max_mamba_cache_size=48, **SPEC, **kw)


def run(llm, batch, new=LONG, **params):
    outs = llm.generate(input_ids=batch, sampling_params={**GREEDY, "max_new_tokens": new,
                                                          **params})
    whole(llm)
    return outs


@pytest.mark.parametrize("arch,page_size", [("qwen3_5", 1), ("nemotron_h", 16),
                                            ("granite", 16)])
def test_ngram_equals_transformers_and_hits_after_it(arch, page_size, paths, prompts, ref):
    with spec_llm(paths[arch], page_size, speculative_algorithm="NGRAM") as llm:
        accepted = []
        for _ in range(2):  # the second round drafts from the first's answers
            outs = run(llm, prompts)
            for p, o in zip(prompts, outs):
                assert o["output_ids"] == ref(arch)(p, LONG), f"{arch} NGRAM"
            accepted.append(sum(o["meta_info"]["spec_accept_token_num"] for o in outs))
        assert accepted[1] > accepted[0], accepted
        turn2 = [p + o["output_ids"] + [5, 6] for p, o in zip(prompts, outs)]
        outs = run(llm, turn2)
        assert sum(o["meta_info"]["cached_tokens"] for o in outs) > 0
        for p, o in zip(turn2, outs):
            assert o["output_ids"] == ref(arch)(p, LONG), f"{arch} NGRAM turn 2"


def test_stop_inside_an_accepted_run_donates_no_state_past_its_end(paths, prompts, ref,
                                                                   monkeypatch):
    """Round 1 teaches the n-gram cache; round 2 accepts whole chains and stops at a token
    in the middle of one. Its state slot then holds the state after the whole accepted run:
    a second turn built on the stopped answer must not resume from it."""
    from kvstrata.engine.scheduler import core

    past_end = []
    clamp = core.clamp_computed
    monkeypatch.setattr(core, "clamp_computed",
                        lambda req: clamp(req) or past_end.append(req.state_past_end))
    arch, prompt = "qwen3_5", prompts[2]
    with spec_llm(paths[arch], 1, speculative_algorithm="NGRAM") as llm:
        run(llm, [prompt])
        full = ref(arch)(prompt, LONG)
        # a token whose first occurrence is mid-chain (a chain accepts up to 12 drafts)
        stop = next(full[i] for i in range(4, 10) if full.index(full[i]) == i)
        out = run(llm, [prompt], stop_token_ids=[stop])[0]
        assert out["output_ids"] == full[:full.index(stop) + 1]
        assert out["meta_info"]["spec_accept_length"] > 2 and True in past_end, past_end
        turn2 = prompt + out["output_ids"] + [7, 8]
        assert run(llm, [turn2])[0]["output_ids"] == ref(arch)(turn2, LONG)


def bigram_draft(path: str, answers: list[list[int]]) -> str:
    """A one-layer llama whose logits are a bigram table of `answers` (each token -> the
    token that followed it): embeddings one-hot, the layer's outputs zeroed, lm_head the
    table. Greedy over a target that loops, it drafts the loop."""
    import transformers as T

    cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=VOCAB, intermediate_size=8,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                        max_position_embeddings=512, bos_token_id=1, eos_token_id=None,
                        pad_token_id=0, tie_word_embeddings=False)
    model = T.LlamaForCausalLM(cfg)
    table = torch.zeros(VOCAB, VOCAB)
    for seq in answers:
        for a, b in zip(seq, seq[1:]):
            table[b, a] = 1.0
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(VOCAB))
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
        model.lm_head.weight.copy_(table)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("arch,page_size", [("qwen3_next", 1), ("nemotron_h", 16)])
def test_standalone_with_a_bigram_draft(arch, page_size, paths, prompts, ref, tmp_path):
    answers = [p + ref(arch)(p, LONG) for p in prompts]
    draft = bigram_draft(str(tmp_path / "draft"), answers)
    with spec_llm(paths[arch], page_size, speculative_algorithm="STANDALONE",
                  speculative_draft_model_path=draft) as llm:
        assert llm.server_info()["kv_plan"]["draft_components"], "the draft's K/V is sized"
        outs = run(llm, prompts)
        for p, o in zip(prompts, outs):
            assert o["output_ids"] == ref(arch)(p, LONG), f"{arch} STANDALONE"
        assert sum(o["meta_info"]["spec_accept_token_num"] for o in outs) > 0


@pytest.mark.parametrize("kw,match", [
    ({"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "x"},
     "a draft head over a recurrent target"),
    ({"speculative_algorithm": "NGRAM", "speculative_ngram_max_bfs_breadth": 4},
     "NGRAM tree drafts"),
    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "x",
      "speculative_eagle_topk": 2}, "verifies chains only"),
])
def test_unbuilt_speculation_is_refused_by_name(kw, match, paths):
    with pytest.raises(ValueError, match=match):
        spec_llm(paths["qwen3_5"], 1, **kw)


def test_a_recurrent_draft_is_refused(paths):
    with pytest.raises(ValueError, match="a draft model with recurrent"):
        spec_llm(paths["qwen3_5"], 1, speculative_algorithm="STANDALONE",
                 speculative_draft_model_path=paths["qwen3_next"])


def test_standalone_on_a_model_without_kv_is_refused(paths, tmp_path):
    draft = bigram_draft(str(tmp_path / "draft"), [[3, 4, 5]])
    with pytest.raises(ValueError, match="without attention K/V"):
        LLM(paths["mamba2"], skip_tokenizer_init=True, dtype="float32",
            speculative_algorithm="STANDALONE", speculative_draft_model_path=draft)

