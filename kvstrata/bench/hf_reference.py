"""Load a checkpoint into transformers (the reference and the benchmark baseline) without our
loader. GGUF goes through transformers' own GGUF reader (dequantise + q/k un-permute) into a
LlamaForCausalLM; from_pretrained(gguf_file=...) would need `accelerate`."""
from __future__ import annotations

import functools


def load_hf_model(model_path: str):
    import torch  # here, not at import: `kvstrata serve` builds this command's parser too
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from kvstrata.config.model_source import gguf_metadata_dir, resolve_model_path

    source = resolve_model_path(model_path)
    if source.kind != "gguf":
        return AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
    # transformers' own config class (the reference must not depend on our reader).
    config = AutoConfig.from_pretrained(gguf_metadata_dir(source))
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # transformers asks gguf for the same (arch, layers) name map once per module of the
    # model (~400 times, ~12 s of CPU for SmolLM2); the map is a pure function of its
    # arguments, so a cache changes nothing but the time.
    import gguf

    uncached = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(uncached)
    try:
        state = load_gguf_checkpoint(source.gguf_path, return_tensors=True,
                                     model_to_load=model)["tensors"]
    finally:
        gguf.get_tensor_name_map = uncached
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    # Non-persistent buffers (rotary inv_freq) were created on meta: rebuild them.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    return model.float().eval()
