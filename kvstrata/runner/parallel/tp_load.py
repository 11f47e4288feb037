"""One rank's share of a checkpoint (runner/parallel/tensor_parallel.py: the llama family;
tp_deepseek.py: DeepSeek V2 / V3 / V3.2; tp_gpt_oss.py: gpt-oss; tp_moe.py: Qwen3-MoE,
Qwen2-MoE, Mixtral, GLM-4.5; tp_hybrid.py: the recurrent hybrids)."""
from __future__ import annotations

import torch

from kvstrata.config.model_source import load_hf_config, resolve_model_path
from kvstrata.runner.models import loader
from kvstrata.runner.models.hybrids import HYBRID_FAMILIES
from kvstrata.runner.parallel.tensor_parallel import TPDecoderForCausalLM, TPGroup
from kvstrata.runner.parallel.tp_deepseek import TPDeepseek
from kvstrata.runner.parallel.tp_gpt_oss import TPGptOss
from kvstrata.runner.parallel.tp_hybrid import tp_hybrid_model
from kvstrata.runner.parallel.tp_moe import TPMoeDecoder


def load_tp_model(model_path: str, group: TPGroup, dtype: str = "float32",
                  device: str = "cpu") -> TPDecoderForCausalLM | TPDeepseek:
    """Rank `group.rank`'s share of the checkpoint at `model_path`."""
    source = resolve_model_path(model_path)
    return load_tp_shard(source, load_hf_config(source), group, dtype, device)


def load_tp_shard(source, config, group: TPGroup, dtype: str = "float32",
                  device: str | torch.device = "cpu"
                  ) -> TPDecoderForCausalLM | TPDeepseek | TPGptOss:
    """Rank `group.rank`'s share, read through the usual loader: the model's read_spec
    says which rows / columns of each tensor it holds, and only those are read."""
    name, spec = loader.arch_spec(config)
    dev = torch.device(device)
    if spec.family in ("gpt_oss", "moe", "deepseek") and source.kind == "gguf":
        raise ValueError(f"{name}: --tp-size {group.size} with a GGUF file is not built "
                         f"(a rank reads its share of the HF safetensors layout); serve "
                         f"the GGUF at --tp-size 1 or the HF checkpoint")
    if spec.family in HYBRID_FAMILIES:
        model = tp_hybrid_model(name, config, loader.resolve_dtype(dtype, config, dev), dev,
                                group)
        return loader.fill_weights(model, source, config)
    if spec.family == "gpt_oss":
        model = TPGptOss(config, spec, loader.resolve_dtype(dtype, config, dev), dev, group)
        return loader.fill_weights(model, source, config)
    if spec.family not in ("decoder", "deepseek", "moe"):
        raise ValueError(f"--tp-size {group.size}: tensor parallelism is not implemented for "
                         f"{name} (the llama-family decoder and its MoE members, gpt-oss, "
                         f"DeepSeek V2 / V3 / V3.2 and the recurrent hybrids have it)")
    if spec.family == "deepseek":
        model = TPDeepseek.build(source, config, loader.resolve_dtype(dtype, config, dev),
                                 dev, group)
        return loader.fill_weights(model, source, config, spec.gguf_permute_qk)
    cls = TPMoeDecoder if spec.family == "moe" else TPDecoderForCausalLM
    model = cls(config, spec, loader.resolve_dtype(dtype, config, dev), dev, group)
    return loader.fill_weights(model, source, config, spec.gguf_permute_qk)


__all__ = ["load_tp_model", "load_tp_shard"]
