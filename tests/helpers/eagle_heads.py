"""EAGLE-2 heads (HF `LlamaForCausalLMEagle` checkpoints) for tests, built with transformers.

- `random_head`: a random one-layer head for a target (most drafts fail: exactness must not
  depend on them). Saved as EAGLE heads are published: `fc.weight` / `fc.bias`,
  `layers.0.*` without an input_layernorm, and an `embed_tokens.weight` the engine ignores.
- `copy_head` + `copyable_target`: a one-layer llama target whose embedding rows have unit
  RMS and whose norms are ones, and a head that is the target's own layer behind
  fc = [I | 0]. The head then sees embed(x_{i+1}) at position i, which is exactly what the
  target's layer sees at position i + 1 (RoPE depends on relative positions only; a norm of
  a unit-RMS row is the row); only x_0 is missing from its context, so nearly every draft
  passes -- accepted runs, stops inside them, and the rejection rule get exercised.
"""
from __future__ import annotations

import json
import os

import torch


def _eagle_config(target_config, **over):
    import transformers as tf

    # (a target's per-layer fields -- a windowed model's layer_types -- do not describe the
    # head's one plain llama layer)
    fields = {k: v for k, v in target_config.to_dict().items() if k != "layer_types"}
    cfg = tf.LlamaConfig(**{**fields, "num_hidden_layers": 1, **over})
    cfg.architectures = ["LlamaForCausalLMEagle"]
    return cfg


def save_head(path: str, config, layer_state: dict, fc_weight, fc_bias, embed) -> str:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {f"layers.0.{k}": v for k, v in layer_state.items()
               if not k.startswith("input_layernorm")}
    tensors.update({"fc.weight": fc_weight, "fc.bias": fc_bias, "embed_tokens.weight": embed})
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()},
              os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config.to_dict(), f)
    return path


def random_head(target_path: str, path: str, seed: int = 7):
    """(head path, the HF modules it was made of: a one-layer LlamaModel and fc)."""
    import transformers as tf

    target_cfg = tf.AutoConfig.from_pretrained(target_path)
    cfg = _eagle_config(target_cfg)
    torch.manual_seed(seed)
    hf = tf.LlamaModel(cfg).float().eval()
    h = cfg.hidden_size
    fc = torch.nn.Linear(2 * h, h)
    with torch.no_grad():
        fc.weight.normal_(0, 0.1)
        fc.bias.normal_(0, 0.1)
        for n, p in hf.layers[0].named_parameters():
            if "layernorm" in n:
                p.normal_(1.0, 0.2)  # a dropped or misplaced norm weight must show
    layer_state = hf.layers[0].state_dict()
    save_head(path, cfg, layer_state, fc.weight, fc.bias, hf.embed_tokens.weight)
    return path, hf, fc


def copyable_target(base_path: str, path: str) -> str:
    """A one-layer llama built from the tiny llama config: unit-RMS embedding rows, norms
    ones, tied head (see the module doc)."""
    import transformers as tf

    cfg = tf.AutoConfig.from_pretrained(base_path)
    cfg.num_hidden_layers = 1
    torch.manual_seed(11)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        e = model.model.embed_tokens.weight
        e[0].normal_()  # the padding row starts as zeros
        e.copy_(e / e.pow(2).mean(-1, keepdim=True).sqrt())
    model.save_pretrained(path, safe_serialization=True)
    return path


def copy_head(target_path: str, path: str) -> str:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32)
    cfg = _eagle_config(model.config)
    h = cfg.hidden_size
    fc_weight = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    return save_head(path, cfg, model.model.layers[0].state_dict(), fc_weight,
                     torch.zeros(h), model.model.embed_tokens.weight)


def random_eagle3_head(target_path: str, path: str, draft_vocab: int = 200, seed: int = 9,
                       **over):
    """A random EAGLE-3 head (SGLang's checkpoint names: midlayer.*, fc, norm, lm_head over
    a draft vocabulary, d2t / t2d) for a target; returns (path, its tensors). `over`: config
    fields of the head (gpt-oss: no attention bias, its aux layers)."""
    import transformers as tf
    from safetensors.torch import save_file

    target_cfg = tf.AutoConfig.from_pretrained(target_path)
    cfg = _eagle_config(target_cfg, draft_vocab_size=draft_vocab, **over)
    cfg.architectures = ["LlamaForCausalLMEagle3"]
    g = torch.Generator().manual_seed(seed)
    h, v = cfg.hidden_size, cfg.vocab_size
    hd = h // cfg.num_attention_heads
    nq, nkv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size

    def rnd(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale
    hot = torch.randperm(v, generator=g)[:draft_vocab].sort().values
    t = {"midlayer.input_layernorm.weight": 1 + rnd(h), "midlayer.hidden_norm.weight": 1 + rnd(h),
         "midlayer.post_attention_layernorm.weight": 1 + rnd(h),
         "midlayer.self_attn.q_proj.weight": rnd(nq * hd, 2 * h),
         "midlayer.self_attn.k_proj.weight": rnd(nkv * hd, 2 * h),
         "midlayer.self_attn.v_proj.weight": rnd(nkv * hd, 2 * h),
         "midlayer.self_attn.o_proj.weight": rnd(h, nq * hd),
         "midlayer.mlp.gate_proj.weight": rnd(inter, h), "midlayer.mlp.up_proj.weight": rnd(inter, h),
         "midlayer.mlp.down_proj.weight": rnd(h, inter), "fc.weight": rnd(h, 3 * h, scale=0.1),
         "norm.weight": 1 + rnd(h), "lm_head.weight": rnd(draft_vocab, h),
         "d2t": hot - torch.arange(draft_vocab), "t2d": torch.zeros(v, dtype=torch.bool),
         "embed_tokens.weight": rnd(v, h)}
    t["t2d"][hot] = True
    os.makedirs(path, exist_ok=True)
    save_file({k: x.contiguous() for k, x in t.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f)
    return path, t, hot


def runner_after_prompt(target: str, head: str, algorithm: str, prompt: list[int]):
    """A ModelRunner with the head as its draft (a small page-1 pool), after one target
    forward over `prompt` in row 1 (slots 1..): its features are stored. (runner, fb)."""
    from kvstrata.config.kv_plan import KVPlan
    from kvstrata.runner.forward_batch import ForwardBatch
    from kvstrata.runner.model_runner import ModelRunner

    runner = ModelRunner(target, dtype="float32", device="cpu", draft_model_path=head,
                         draft_algorithm=algorithm)
    facts = runner.kv_facts()
    runner.allocate_kv(KVPlan(page_size=1, num_pages=64, num_rows=2, context_len=64,
                              pool_kind=facts.pool_kind, components=facts.components,
                              draft_components=facts.draft_components))
    runner.req_to_token.write_many([1], [0], [list(range(1, len(prompt) + 3))])
    fb = ForwardBatch.build([prompt], [1], [0], runner.device)
    fb.out_slots = runner.req_to_token.table[fb.token_rows, fb.positions]
    runner.model(fb)
    runner.draft.after_target_forward(fb.out_slots, runner.model)
    return runner, fb
