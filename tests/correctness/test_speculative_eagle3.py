"""EAGLE3 speculative decoding (an EAGLE-3 head reading three of the target's residual
streams, its own output matrix over a draft vocabulary mapped by d2t).

The target's captured streams are checked against transformers' hidden_states, the head's
logits against a torch reference built on transformers' rotary and norm modules, and the
engine's output against plain greedy with a random head (chain and tree)."""
from __future__ import annotations

import pytest
import torch

from kvstrata.config.kv_plan import EAGLE_HIDDEN
from tests.correctness.test_speculative import greedy, repeating_prompts
from tests.correctness.test_speculative_eagle import make_llm
from tests.correctness.test_speculative_standalone import twice_equal_plain
from tests.helpers.eagle_heads import random_eagle3_head, runner_after_prompt


@pytest.fixture(scope="module")
def head3(tiny_checkpoints, tmp_path_factory):
    path, tensors, hot = random_eagle3_head(tiny_checkpoints["llama"],
                                            str(tmp_path_factory.mktemp("eagle3") / "h"))
    return path, tensors, hot


def _reference(target_path: str, tensors: dict, hot: torch.Tensor, prompt: list[int],
               layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux features from transformers' hidden_states, the head's logits over positions
    0 .. n-2 reading x_{i+1}), in plain torch around transformers' modules."""
    import transformers as tf
    from transformers.models.llama import modeling_llama as ml

    target = tf.AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32)
    cfg = target.config
    with torch.no_grad():
        hs = target.model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        aux = torch.cat([hs[i][0] for i in layers], dim=-1)      # stream entering layer i

        def norm(x, w):
            n = ml.LlamaRMSNorm(x.shape[-1], eps=cfg.rms_norm_eps)
            n.weight.copy_(w)
            return n(x)
        n = len(prompt) - 1
        emb = target.model.embed_tokens.weight[torch.tensor(prompt[1:])]
        h = aux[:-1] @ tensors["fc.weight"].T
        a = torch.cat([norm(emb, tensors["midlayer.input_layernorm.weight"]),
                       norm(h, tensors["midlayer.hidden_norm.weight"])], dim=-1)
        nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        hd = cfg.hidden_size // nq
        q = (a @ tensors["midlayer.self_attn.q_proj.weight"].T).view(n, nq, hd).transpose(0, 1)
        k = (a @ tensors["midlayer.self_attn.k_proj.weight"].T).view(n, nkv, hd).transpose(0, 1)
        v = (a @ tensors["midlayer.self_attn.v_proj.weight"].T).view(n, nkv, hd).transpose(0, 1)
        cos, sin = ml.LlamaRotaryEmbedding(cfg)(v, torch.arange(n)[None])
        q, k = ml.apply_rotary_pos_emb(q[None], k[None], cos, sin)
        k, v = (t.repeat_interleave(nq // nkv, dim=1) for t in (k, v[None]))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)[0]
        x = h + o.transpose(0, 1).reshape(n, -1) @ tensors["midlayer.self_attn.o_proj.weight"].T
        m = norm(x, tensors["midlayer.post_attention_layernorm.weight"])
        m = torch.nn.functional.silu(m @ tensors["midlayer.mlp.gate_proj.weight"].T) * (
            m @ tensors["midlayer.mlp.up_proj.weight"].T)
        x = x + m @ tensors["midlayer.mlp.down_proj.weight"].T
        draft = norm(x, tensors["norm.weight"]) @ tensors["lm_head.weight"].T
        full = torch.full((n, cfg.vocab_size), float("-inf"))
        full[:, hot] = draft
    return aux, full


def test_streams_and_head_match_transformers(tiny_checkpoints, head3):
    from kvstrata.runner.forward_batch import ForwardBatch

    path, tensors, hot = head3
    prompt = [5, 17, 42, 99, 7, 250, 31, 64, 8, 120]
    n = len(prompt)
    runner, fb = runner_after_prompt(tiny_checkpoints["llama"], path, "EAGLE3", prompt)
    component = runner.plan.draft_components[-1]
    assert (component.name, component.token_shape) == (EAGLE_HIDDEN, (3 * 64,))
    layers = list(runner.model.capture_layers)
    assert layers == [0, 1, 2]  # [2, 3 // 2, 3 - 3] for the 3-layer target, ascending
    aux, ref = _reference(tiny_checkpoints["llama"], tensors, hot, prompt, layers)
    torch.testing.assert_close(runner.draft.features[fb.out_slots], aux, atol=1e-4, rtol=1e-4)
    draft = runner.draft
    with torch.inference_mode():
        ext = ForwardBatch.build([prompt[1:]], [1], [0], runner.device)
        ext.out_slots = runner.req_to_token.table[ext.token_rows, ext.positions]
        logits, _ = draft.model(ext, draft.features[ext.out_slots])
    hot_cols = hot.tolist()
    torch.testing.assert_close(logits[:, hot_cols], ref[:, hot_cols], atol=1e-4, rtol=1e-4)
    assert torch.isinf(logits).sum() == (n - 1) * (300 - len(hot_cols))


@pytest.mark.parametrize("tree", [{}, {"speculative_eagle_topk": 3,
                                       "speculative_num_draft_tokens": 8}])
def test_greedy_equals_plain(tiny_checkpoints, head3, tree):
    from tests.correctness.test_speculative import make_llm as plain_llm

    prompts = repeating_prompts()
    params = greedy(32)
    target = tiny_checkpoints["llama"]
    ref = plain_llm(target, False, max_total_tokens=4096).generate(input_ids=prompts,
                                                                   sampling_params=params)
    llm = make_llm(target, head3[0], page_size=4, max_total_tokens=4096,
                   speculative_algorithm="EAGLE3", speculative_num_steps=3, **tree)
    twice_equal_plain(llm, prompts, params, ref)
