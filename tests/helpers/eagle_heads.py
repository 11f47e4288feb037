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

    cfg = tf.LlamaConfig(**{**target_config.to_dict(), "num_hidden_layers": 1, **over})
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
