"""The scheme a quantized HF checkpoint is saved in (config/hf_quant.py parses it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

INT_GROUP_MULTIPLE = 32  # the GGUF block (Q4_1 / Q8_0) each group is cut into


@dataclass(frozen=True)
class HfQuantScheme:
    method: str                  # gptq | awq | compressed-tensors | fp8
    bits: int = 0                # 4 or 8 for the integer methods; 8 for fp8
    group_size: int = -1         # -1 = one group per output channel (the whole row)
    sym: bool = True
    desc_act: bool = False       # GPTQ act-order / compressed-tensors actorder "group"
    checkpoint_format: str = ""  # gptq | gptq_v2 (GPTQ); pack-quantized | int-quantized (CT)
    block: tuple[int, int] | None = None  # fp8 weight_block_size (rows, cols); None = per tensor
    source: str = "config.json"  # where it was read, for messages

    @property
    def is_int(self) -> bool:
        """Weights stay packed (runner/quant/packed_rows.py), not dequantized at load."""
        return self.method != "fp8"

    def describe(self) -> str:
        if self.method == "fp8":
            blocks = "x".join(map(str, self.block)) if self.block else None
            return f"fp8 e4m3, {'block ' + blocks if blocks else 'per-tensor'} scales"
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        extra = f", {self.checkpoint_format}" if self.checkpoint_format else ""
        act = ", act-order" if self.desc_act else ""
        return (f"{self.method} int{self.bits} W{self.bits}A16 ({group}, "
                f"{'sym' if self.sym else 'asym'}{act}{extra})")


def refuse(where: str, field: str, value: Any, built: str) -> ValueError:
    return ValueError(f"{where}: quantization_config.{field} = {value!r} is not supported "
                      f"(built: {built})")


def check_group_size(where: str, field: str, group: int) -> int:
    if group != -1 and (group <= 0 or group % INT_GROUP_MULTIPLE):
        raise refuse(where, field, group, f"-1 or a multiple of {INT_GROUP_MULTIPLE}: each "
                      f"group becomes whole GGUF blocks of {INT_GROUP_MULTIPLE}")
    return group


__all__ = ["INT_GROUP_MULTIPLE", "HfQuantScheme", "check_group_size", "refuse"]
