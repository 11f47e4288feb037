"""Tiny random-weight DeepSeek-V3.2 checkpoints (MLA + DSA indexer + MoE), with an MTP layer
when asked: what the DSA and NEXTN tests build in fixtures, and what `kvstrata bench pd
--speculative-algorithm NEXTN` serves (no real DSA checkpoint fits this machine).

Odd sizes, 2 dense then 2 MoE layers, YaRN rope with mscale != mscale_all_dim. 16 indexer
heads: an indexer score is exactly 0 when every head's relu is 0, and with 4 heads such
exact ties landed on the top-k boundary, where transformers itself breaks them differently
in prefill and decode.
"""
from __future__ import annotations

import json
import os
import shutil


def tiny_dsa_config(vocab_size: int, index_topk: int, max_position_embeddings: int,
                    num_hidden_layers: int = 4, bos: int = 1, eos: int = 2, heads: int = 3):
    import transformers as tf  # noqa: PLC0415 - heavy; bench tooling only

    return tf.DeepseekV32Config(
        vocab_size=vocab_size, hidden_size=72, intermediate_size=88, moe_intermediate_size=40,
        num_hidden_layers=num_hidden_layers, num_attention_heads=heads,
        num_key_value_heads=heads,
        n_shared_experts=1, n_routed_experts=6, kv_lora_rank=28, q_lora_rank=36,
        qk_rope_head_dim=8, v_head_dim=20, qk_nope_head_dim=12, n_group=2, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=2, index_topk=index_topk,
        index_head_dim=24, index_n_heads=16, max_position_embeddings=max_position_embeddings,
        initializer_range=0.2, bos_token_id=bos, eos_token_id=eos, pad_token_id=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 1.0})


def save_tiny_dsa(config, path: str, seed: int = 4321) -> str:
    """Random weights for `config` (the near-identity init of norms and router biases made
    to matter), saved as safetensors."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.indexer.k_norm.bias.normal_(0, 0.5)
            layer.self_attn.indexer.k_norm.weight.normal_(1, 0.3)
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.normal_(0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return path


def add_mtp_layer(src: str, dst: str, config_with_one_more_layer,
                  index_share: bool | None = True, seed: int = 8765) -> str:
    """A copy of checkpoint `src` (a DeepSeek V3 or V3.2) with one MTP layer (random weights)
    stored the way DeepSeek's releases store it: layer `num_hidden_layers` with enorm / hnorm /
    eh_proj / shared_head.{norm,head} / embed_tokens beside an ordinary decoder layer (MoE
    here). `config_with_one_more_layer`: src's config with num_hidden_layers + 1 (the donor).
    `index_share`: V3.2's index_share_for_mtp_iteration (None: not written, as for V3)."""
    import torch  # noqa: PLC0415
    from safetensors.torch import load_file, save_file  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    shutil.copytree(src, dst)
    n = config_with_one_more_layer.num_hidden_layers - 1
    torch.manual_seed(seed)
    donor = AutoModelForCausalLM.from_config(config_with_one_more_layer, dtype=torch.float32)
    donor.save_pretrained(f"{dst}.donor", safe_serialization=True)  # checkpoint names
    donated = load_file(f"{dst}.donor/model.safetensors")
    shutil.rmtree(f"{dst}.donor")
    tensors = load_file(f"{dst}/model.safetensors")
    pre = f"model.layers.{n}."
    tensors.update({k: v for k, v in donated.items() if k.startswith(pre)})
    h = config_with_one_more_layer.hidden_size
    tensors[pre + "enorm.weight"] = torch.randn(h).mul_(0.2).add_(1.0)
    tensors[pre + "hnorm.weight"] = torch.randn(h).mul_(0.2).add_(1.0)
    tensors[pre + "eh_proj.weight"] = torch.randn(h, 2 * h) * 0.1
    tensors[pre + "shared_head.norm.weight"] = torch.randn(h).mul_(0.2).add_(1.0)
    tensors[pre + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors[pre + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, f"{dst}/model.safetensors",
              metadata={"format": "pt"})
    with open(f"{dst}/config.json") as f:
        raw = json.load(f)
    raw.update(num_nextn_predict_layers=1)
    if index_share is not None:
        raw.update(index_share_for_mtp_iteration=index_share)
    with open(f"{dst}/config.json", "w") as f:
        json.dump(raw, f, indent=1)
    return dst


def build_bench_model(path: str, index_topk: int = 64) -> str:
    """The tiny DSA model with an MTP layer and SmolLM2's tokenizer (the benchmark client
    sends text), built once into `path`."""
    from kvstrata.config.model_source import load_tokenizer, resolve_model_path  # noqa: PLC0415

    if os.path.isdir(path):
        return path
    tok = load_tokenizer(resolve_model_path("smollm2-135m"))
    kw = dict(vocab_size=len(tok), index_topk=index_topk, max_position_embeddings=512,
              bos=tok.bos_token_id, eos=tok.eos_token_id)
    base = save_tiny_dsa(tiny_dsa_config(**kw), path + ".base")
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    add_mtp_layer(base, tmp, tiny_dsa_config(num_hidden_layers=5, **kw))
    shutil.rmtree(base)
    tok.save_pretrained(tmp)
    os.replace(tmp, path)
    return path


__all__ = ["add_mtp_layer", "build_bench_model", "save_tiny_dsa", "tiny_dsa_config"]
