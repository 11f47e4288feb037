"""EAGLE speculative decoding (an EAGLE-2 head reading the target's hidden states).

The head's arithmetic is checked against transformers (its decoder layer without the input
norm, fed fc(cat(embed(x_{i+1}), h_i)) with h the HF target's final hidden states), through
the runner's own feature store and draft steps. Greedy: output tokens equal plain greedy
with a random head (most drafts fail) and with a head that copies its target (nearly every
draft passes: tests/helpers/eagle_heads.py), through page sizes, chunked prefill, radix
hits, retraction, a starved HiCache and aborts. Sampling keeps the target's distribution.
"""
from __future__ import annotations

import pytest
import torch

from kvstrata import LLM
from kvstrata.config.kv_plan import EAGLE_HIDDEN, KVPlan
from tests.correctness.test_speculative import (
    assert_same_distribution, assert_stops_cut_exactly, drained, greedy,
    repeating_prompts, sample_both, stop_cases)
from tests.correctness.test_speculative_standalone import (
    accept_length, check_retraction_starved_hicache_and_aborts, twice_equal_plain)
from tests.helpers.eagle_heads import (copy_head, copyable_target, random_head,
                                       runner_after_prompt)

STEPS = 4


@pytest.fixture(scope="module")
def eagle(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    llama = tiny_checkpoints["llama"]
    head, hf_layer_model, fc = random_head(llama, str(root / "random_head"))
    target = copyable_target(llama, str(root / "copy_target"))
    return {"llama": llama, "random_head": head, "hf": (hf_layer_model, fc),
            "copy_target": target, "copy_head": copy_head(target, str(root / "copy_head"))}


def make_llm(target: str, head: str | None, **kw) -> LLM:
    if head is not None:  # drafts in every step (not the measured gate)
        kw = {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": head,
              "speculative_num_steps": STEPS, "speculative_disable_by_batch_size": 1 << 20,
              **kw}
    return LLM(model_path=target, skip_tokenizer_init=True, dtype="float32", **kw)


@pytest.fixture(scope="module")
def plain(eagle):
    """Plain greedy references per target (page size 1, a large pool)."""
    cache: dict = {}

    def get(target: str, prompts, params):
        key = (target, str(prompts), str(params))
        if key not in cache:
            llm = cache.get(target) or make_llm(eagle[target], None, max_total_tokens=8192)
            cache[target] = llm
            cache[key] = llm.generate(input_ids=prompts, sampling_params=params)
        return cache[key]
    return get


def test_head_matches_transformers(eagle):
    """Extend logits over a prompt, then two self-fed draft steps, equal an HF reference."""
    import transformers as tf

    prompt = [5, 17, 42, 99, 7, 250, 31, 64, 8, 120]
    n = len(prompt)
    runner, _ = runner_after_prompt(eagle["llama"], eagle["random_head"], "EAGLE", prompt)
    assert runner.plan.draft_components[-1].name == EAGLE_HIDDEN
    draft = runner.draft
    with torch.inference_mode():  # our head: extend over positions 0..n-2, then 2 steps
        logits, hidden = draft._forward([prompt[1:]], [1], [0])
        d1 = int(logits.argmax())
        logits2, hidden2 = draft._forward([[d1]], [1], [n - 1], hidden)
        d2 = int(logits2.argmax())
        logits3, _ = draft._forward([[d2]], [1], [n], hidden2)

    target = tf.AutoModelForCausalLM.from_pretrained(eagle["llama"], dtype=torch.float32)
    layer_model, fc = eagle["hf"]
    layer_model.layers[0].input_layernorm = torch.nn.Identity()
    layer_model.norm = torch.nn.Identity()
    embed = target.model.embed_tokens.weight
    with torch.no_grad():
        h = target.model(torch.tensor([prompt])).last_hidden_state[0]  # final-normed
        toks = prompt[1:]
        # Sequence 1: positions 0..n-2, features h_0..h_{n-2}.
        x = fc(torch.cat([embed[torch.tensor(toks)], h[:-1]], -1))
        out1 = layer_model(inputs_embeds=x[None], position_ids=torch.arange(n - 1)[None]
                           ).last_hidden_state[0]
        # Steps: position n-1 reads (d1, the head's own output at n-2), n reads (d2, ...).
        x2 = torch.cat([x, fc(torch.cat([embed[d1], out1[-1]], -1))[None]], 0)
        out2 = layer_model(inputs_embeds=x2[None], position_ids=torch.arange(n)[None]
                           ).last_hidden_state[0]
        x3 = torch.cat([x2, fc(torch.cat([embed[d2], out2[-1]], -1))[None]], 0)
        out3 = layer_model(inputs_embeds=x3[None], position_ids=torch.arange(n + 1)[None]
                           ).last_hidden_state[0]
    torch.testing.assert_close(logits[0], (out1 @ embed.T)[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits2[0], (out2 @ embed.T)[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits3[0], (out3 @ embed.T)[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("target,head,page_size,chunk", [
    ("llama", "random_head", 1, 8), ("copy_target", "copy_head", 16, None),
    ("copy_target", "copy_head", 1, 8)])
def test_greedy_equals_plain(eagle, plain, target, head, page_size, chunk):
    prompts = repeating_prompts()
    params = greedy(40)
    ref = plain(target, prompts, params)
    llm = make_llm(eagle[target], eagle[head], page_size=page_size, max_total_tokens=8192,
                   chunked_prefill_size=chunk or -1)
    first, again = twice_equal_plain(llm, prompts, params, ref)
    if head == "copy_head":  # head KV shared through radix hits (next-token checked)
        assert accept_length(first) > STEPS - 1 and accept_length(again) > STEPS - 1
    plan = llm.engine.kv_plan
    assert plan.draft_components[-1].name == EAGLE_HIDDEN


@pytest.mark.parametrize("tree", [{}, {"speculative_eagle_topk": 3,
                                       "speculative_num_draft_tokens": 8,
                                       "speculative_num_steps": 3}])
def test_retraction_starved_hicache_and_aborts(eagle, plain, tree):
    """Retraction and HiCache load-backs bring target KV without hidden states: the head
    extends those positions from a zero feature; output unchanged, drafts still pass (a
    tree's accepted paths move their features too)."""
    target, head = eagle["copy_target"], eagle["copy_head"]
    check_retraction_starved_hicache_and_aborts(
        lambda **kw: make_llm(target, head, **{**kw, **tree}),
        lambda prompts, params: plain("copy_target", prompts, params),
        2.0 if tree else STEPS - 1.5)


def test_stops_inside_an_accepted_run(eagle, plain):
    prompt = repeating_prompts()[1]
    full = plain("copy_target", [prompt], greedy(40))[0]["output_ids"]
    cases = stop_cases(full)
    llm = make_llm(eagle["copy_target"], eagle["copy_head"], max_total_tokens=4096)
    assert_stops_cut_exactly(llm, prompt, cases, plain("copy_target", [prompt] * len(cases),
                                                       cases))


def test_sampling_distribution_matches_plain(eagle):
    target = eagle["copy_target"]
    prompt = [17, 42, 99, 5, 61, 8, 250]
    n = 500
    spec = make_llm(target, eagle["copy_head"], max_total_tokens=8192)
    a, b_out = sample_both(make_llm(target, None, max_total_tokens=8192), spec, prompt, n, 2000)
    assert sum(o["meta_info"]["spec_accept_token_num"] for o in b_out) > n // 2
    assert_same_distribution(a, b_out)
    drained(spec)


TREE = {"speculative_eagle_topk": 3, "speculative_num_draft_tokens": 8}


@pytest.mark.parametrize("target,head,page_size,chunk,kernel", [
    ("copy_target", "copy_head", 16, None, "1"), ("copy_target", "copy_head", 1, 8, "0"),
    ("llama", "random_head", 4, None, "1")])
def test_tree_drafts_equal_plain(eagle, plain, monkeypatch, target, head, page_size, chunk,
                                 kernel):
    """topk 3 over 3 steps, 7 drafts a tree: the head's tree steps attend through explicit
    key slots (the paged decode kernel, or the padded SDPA path), accepted paths leave the
    first branch (their KV and features move), output equals plain greedy."""
    from kvstrata.runner.spec import verify as spec_verify
    monkeypatch.setenv("KVSTRATA_CPU_PAGED_DECODE", kernel)
    moved = []
    real = spec_verify.move_accepted_kv
    monkeypatch.setattr(spec_verify, "move_accepted_kv", lambda pools, table, row, start, path: (
        moved.append(path != list(range(1, len(path) + 1))),
        real(pools, table, row, start, path)))
    prompts = repeating_prompts()
    params = greedy(40)
    ref = plain(target, prompts, params)
    llm = make_llm(eagle[target], eagle[head], page_size=page_size, max_total_tokens=8192,
                   chunked_prefill_size=chunk or -1, speculative_num_steps=3, **TREE)
    first, again = twice_equal_plain(llm, prompts, params, ref)
    assert moved, "no tree was verified"
    if head == "copy_head":
        assert any(moved), "no accepted path left the first branch"
        assert accept_length(first) > 2.5 and accept_length(again) > 2.5


def test_tree_sampling_distribution_matches_plain(eagle):
    target = eagle["copy_target"]
    prompt = [17, 42, 99, 5, 61, 8, 250]
    n = 500
    spec = make_llm(target, eagle["copy_head"], max_total_tokens=8192, speculative_num_steps=3,
                    **TREE)
    a, b_out = sample_both(make_llm(target, None, max_total_tokens=8192), spec, prompt, n, 4000)
    assert sum(o["meta_info"]["spec_accept_token_num"] for o in b_out) > n // 2
    assert_same_distribution(a, b_out)
    drained(spec)


def test_a_tree_holds_the_chain(eagle):
    """The head's tree steps (scratch slots, each node attending to the context and its
    ancestors, fed its parent's hidden state) agree with its chain steps: with every
    candidate kept, the chain's drafts are a path of the tree, and every fed node's best
    continuation recomputed as a chain through its branch is among its children. Two
    requests are built in one step, so a node fed another request's state shows."""
    from kvstrata.runner.forward_batch import ForwardBatch
    from kvstrata.runner.model_runner import ModelRunner
    from kvstrata.runner.spec.tree import build_trees

    runner = ModelRunner(eagle["llama"], dtype="float32", device="cpu",
                         draft_model_path=eagle["random_head"], draft_algorithm="EAGLE",
                         draft_tree=(3, 3))
    facts = runner.kv_facts()
    runner.allocate_kv(KVPlan(page_size=1, num_pages=64, num_rows=3, context_len=32,
                              components=facts.components,
                              draft_components=facts.draft_components))
    prompts = [[5, 17, 42, 99, 7, 250, 31, 64, 8, 120], [77, 3, 190, 45, 12, 9, 260]]
    for row, prompt in enumerate(prompts, 1):
        base = 1 + 20 * (row - 1)
        runner.req_to_token.write_many([row], [0], [list(range(base, base + 20))])
        fb = ForwardBatch.build([prompt], [row], [0], runner.device)
        fb.out_slots = runner.req_to_token.table[fb.token_rows, fb.positions]
        runner.model(fb)
        runner.draft.after_target_forward(fb.out_slots, runner.model)
    draft = runner.draft

    def plans():
        for row in (1, 2):
            draft.forget(f"r{row}")
        return [draft.catch_up_plan(f"r{row}", row, p, len(p))
                for row, p in enumerate(prompts, 1)]
    chains = draft.propose(plans(), [3, 3])
    everything = 3 + 2 * 9
    trees = build_trees(draft, plans(), [everything] * 2, 3, 3, draft.scratch_base)
    with torch.inference_mode():
        _, g0 = draft.extend(plans())
    for i, ((tokens, parents), chain) in enumerate(zip(trees, chains)):
        row, n = i + 1, len(prompts[i])
        assert len(tokens) == everything
        kids: dict[int, list[int]] = {}
        for j, p in enumerate(parents):
            kids.setdefault(p, []).append(j + 1)
        tok = dict(enumerate(tokens, 1))
        node = 0
        for d in chain:
            node = next(c for c in kids[node] if tok[c] == d)
        with torch.inference_mode():
            for c1 in kids[0]:
                l1, h1 = draft._forward([[tok[c1]]], [row], [n - 1], g0[i:i + 1])
                assert int(l1.argmax()) in {tok[c] for c in kids[c1]}
                for c2 in (c for c in kids[c1] if c in kids):
                    l2, _ = draft._forward([[tok[c2]]], [row], [n], h1)
                    assert int(l2.argmax()) in {tok[c] for c in kids[c2]}


def test_token_map_limits_drafts_to_hot_tokens(eagle, plain, monkeypatch, tmp_path):
    """FR-Spec (--speculative-token-map): the head scores only the mapped tokens. With the
    tokens of the answers mapped, the copy head still passes its drafts; every draft is a
    mapped token; output equals plain greedy."""
    from kvstrata.runner.spec import verify as spec_verify
    prompts = repeating_prompts()
    params = greedy(40)
    ref = plain("copy_target", prompts, params)
    hot = sorted({t for r in ref for t in r["output_ids"]})
    torch.save(torch.tensor(hot), tmp_path / "freq.pt")
    seen: set = set()
    real = spec_verify.verify
    monkeypatch.setattr(spec_verify, "verify", lambda sampler, logits, states, drafts, *a: (
        seen.update(t for d in drafts for t in d), real(sampler, logits, states, drafts, *a))[1])
    llm = make_llm(eagle["copy_target"], eagle["copy_head"], max_total_tokens=8192,
                   speculative_token_map=str(tmp_path / "freq.pt"))
    first, _ = twice_equal_plain(llm, prompts, params, ref)
    assert seen and seen <= set(hot)
    assert accept_length(first) > STEPS - 1
    with pytest.raises(ValueError, match="--speculative-token-map .*: no such file"):
        make_llm(eagle["copy_target"], eagle["copy_head"], max_total_tokens=1024,
                 speculative_token_map=str(tmp_path / "missing.pt"))
