"""The hybrid recurrent models by architecture name: Gated DeltaNet (qwen3_next.py) and
Mamba2 (nemotron_h.py, granite_hybrid.py, falcon_h1.py) hybrids, built on hybrid_base.py."""
from __future__ import annotations

from typing import Any

import torch

HYBRID_FAMILIES = ("qwen3_next", "nemotron_h", "granite_hybrid", "falcon_h1")


def hybrid_model(name: str, config: Any, dtype: torch.dtype, device: torch.device):
    from kvstrata.runner.models import (falcon_h1, granite_hybrid, nemotron_h,  # noqa: PLC0415
                                        qwen3_next)

    classes = {"Qwen3NextForCausalLM": qwen3_next.Qwen3NextForCausalLM,
               "Qwen3_5ForCausalLM": qwen3_next.Qwen3_5ForCausalLM,
               "Qwen3_5MoeForCausalLM": qwen3_next.Qwen3_5MoeForCausalLM,
               "NemotronHForCausalLM": nemotron_h.NemotronHForCausalLM,
               "Mamba2ForCausalLM": nemotron_h.Mamba2ForCausalLM,
               "GraniteMoeHybridForCausalLM": granite_hybrid.GraniteMoeHybridForCausalLM,
               "FalconH1ForCausalLM": falcon_h1.FalconH1ForCausalLM}
    return classes[name](config, dtype, device)
