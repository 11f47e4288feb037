"""NEXTN: DeepSeek's MTP layer drafts for its own model (co-located).

Exactness does not depend on draft quality: greedy output with NEXTN equals greedy without it
(and transformers), through page sizes, chunked prefill, radix hits and retraction. IndexShare
(index_share_for_mtp_iteration): the draft steps attend to exactly the slots the extend's last
position selected, without running the indexer.
"""
from __future__ import annotations

import pytest
import torch

from kvstrata import LLM
from kvstrata.config.resolve import resolve
from kvstrata.config.server_args import ServerArgs
from tests.conftest import GREEDY_TOKENS, add_mtp_layer
from tests.correctness.test_speculative import drained
from tests.correctness.test_speculative_standalone import accept_length
from tests.helpers.compare import assert_tokens_match


def _llm(path: str, spec: bool, **kw) -> LLM:
    if spec:  # draft every step (not the measured gate)
        kw = {"speculative_algorithm": "NEXTN",
              "speculative_disable_by_batch_size": 1 << 20, **kw}
    return LLM(model_path=path, skip_tokenizer_init=True, dtype="float32", **kw)


def _greedy(llm: LLM, prompts) -> list[dict]:
    params = {"max_new_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True}
    return llm.generate(input_ids=prompts, sampling_params=[params] * len(prompts))


@pytest.fixture(scope="module")
def plain_outputs(tiny_dsa_mtp_checkpoint, tiny_prompts, tiny_dsa_references):
    llm = _llm(tiny_dsa_mtp_checkpoint, False, max_total_tokens=4096)
    try:
        outs = _greedy(llm, tiny_prompts)
    finally:
        llm.shutdown()
    for i, (out, (ref, logits)) in enumerate(zip(outs, tiny_dsa_references)):
        assert_tokens_match(out["output_ids"], ref, logits, label=f"plain {i}")
    return [o["output_ids"] for o in outs]


def test_nextn_resolves_to_eagle_with_the_models_mtp_layer(tiny_dsa_mtp_checkpoint):
    args, res = resolve(ServerArgs(model_path=tiny_dsa_mtp_checkpoint,
                                   speculative_algorithm="NEXTN"))
    assert args.speculative_algorithm == "EAGLE"
    assert args.speculative_draft_model_path == tiny_dsa_mtp_checkpoint
    assert (args.speculative_num_steps, args.speculative_eagle_topk,
            args.speculative_num_draft_tokens) == (3, 1, 4)
    rules = {r.rule: r.reason for r in res}
    assert "MTP layer" in rules["spec.nextn"] and "spec.nextn_draft" in rules
    assert "NEXTN" in rules["spec.auto_shape"]


@pytest.mark.parametrize("page_size,chunk", [(1, None), (16, 16)])
def test_greedy_equals_plain(tiny_dsa_mtp_checkpoint, tiny_prompts, plain_outputs,
                             page_size, chunk):
    kw = {"chunked_prefill_size": chunk} if chunk else {}
    llm = _llm(tiny_dsa_mtp_checkpoint, True, page_size=page_size, max_total_tokens=4096,
               **kw)
    try:
        for label in ("first", "radix hits"):
            outs = _greedy(llm, tiny_prompts)
            assert [o["output_ids"] for o in outs] == plain_outputs, label
            assert accept_length(outs) >= 1.0
        assert sum(o["meta_info"]["cached_tokens"] for o in outs) > 0
        drained(llm)
        assert llm.engine.runner.draft.index_share
    finally:
        llm.shutdown()


def test_greedy_under_retraction(tiny_dsa_mtp_checkpoint, tiny_prompts, plain_outputs):
    llm = _llm(tiny_dsa_mtp_checkpoint, True, page_size=4, chunked_prefill_size=16,
               max_total_tokens=192)
    try:
        outs = _greedy(llm, tiny_prompts)
        assert llm.engine.scheduler.num_retractions > 0
        assert [o["output_ids"] for o in outs] == plain_outputs
        drained(llm)
    finally:
        llm.shutdown()


def _draft_steps(path: str, prompt: list[int]):
    """Extend over a prompt (after the target's forward), then two draft steps; returns the
    draft and the slots each step's forward attended to."""
    from tests.helpers.eagle_heads import runner_after_prompt

    runner, _ = runner_after_prompt(path, path, "EAGLE", prompt)
    draft = runner.draft
    backend = draft.model.attn_backend
    n = len(prompt)
    with torch.inference_mode():
        logits, carry = draft._forward([prompt[1:]], [1], [0])
        extend_sel = backend.last_selected[0][-1:]
        d1 = int(logits.argmax())
        logits, carry = draft._forward([[d1]], [1], [n - 1], carry)
        step1 = backend.last_selected[0]
        _, carry = draft._forward([[int(logits.argmax())]], [1], [n], carry)
        step2 = backend.last_selected[0]
    return draft, extend_sel, step1, step2


def test_index_share_reuses_the_extends_topk(tiny_dsa_mtp_checkpoint, tmp_path):
    prompt = [5, 17, 42, 99, 7, 250, 31, 64, 8, 120, 3, 4, 5, 6, 9, 77]  # > index_topk (8)
    draft, extend_sel, step1, step2 = _draft_steps(tiny_dsa_mtp_checkpoint, prompt)
    assert draft.index_share
    assert torch.equal(step1, extend_sel) and torch.equal(step2, extend_sel)
    assert int((extend_sel >= 0).sum()) == draft.model.dims.index_topk  # really sparse
    # Without IndexShare every draft step runs its own indexer: the newest draft position
    # is among the keys the second step may pick, and it differs from the extend's choice.
    off = add_mtp_layer(tiny_dsa_mtp_checkpoint, str(tmp_path / "no_share"),
                        index_share=False)
    draft, extend_sel, step1, step2 = _draft_steps(off, prompt)
    assert not draft.index_share
    assert not torch.equal(step2, extend_sel)


def test_refusals(tiny_dsa_checkpoint, tiny_dsa_mtp_checkpoint):
    with pytest.raises(ValueError, match="no MTP layer"):
        _llm(tiny_dsa_checkpoint, True)
    with pytest.raises(NotImplementedError, match="not implemented yet: --speculative-eagle-"
                                                  "topk > 1 with NEXTN"):
        _llm(tiny_dsa_mtp_checkpoint, True, speculative_eagle_topk=2,
             speculative_num_draft_tokens=4)
