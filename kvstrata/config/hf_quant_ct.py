"""compressed-tensors' quantization_config (llm-compressor checkpoints) -> HfQuantScheme.

Built: weight-only integer schemes (W4A16 / W8A16: `config_groups.*.weights` type int,
4 or 8 bits, strategy group / channel / tensor, static) stored pack-quantized (values
packed into int32, `weight_packed`) or int-quantized (`weight` as int8), symmetric or, when
packed at 4 bits, with zero points; actorder group (weight_g_idx) or weight. Refused by
field: activation quantization (input_activations / output_activations: W8A8, FP8 W8A8),
float (FP8 / FP4) weights, block strategy, dynamic weights, sparsity, KV-cache schemes,
transforms, and groups that differ from one another.
"""
from __future__ import annotations

from kvstrata.config.hf_quant_scheme import HfQuantScheme, check_group_size, refuse

FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")


def compressed_tensors_scheme(cfg: dict, where: str) -> HfQuantScheme:
    fmt = str(cfg.get("format") or "").lower()
    groups = cfg.get("config_groups") or {}
    if not groups:
        raise refuse(where, "config_groups", groups, "at least one weight scheme")
    for key in ("kv_cache_scheme", "transform_config"):
        if cfg.get(key):
            raise refuse(where, key, cfg[key], "none")
    sparsity = cfg.get("sparsity_config") or {}
    if sparsity and str(sparsity.get("format", "dense")).lower() != "dense":
        raise refuse(where, "sparsity_config.format", sparsity.get("format"), "dense")
    schemes = []
    for name, group in groups.items():
        for act in ("input_activations", "output_activations"):
            if group.get(act):
                raise refuse(where, f"config_groups.{name}.{act}", group[act],
                              "none: weight-only schemes (W4A16, W8A16); activation "
                              "quantization is not built")
        group_fmt = str(group.get("format") or fmt).lower()
        schemes.append(_weights(group.get("weights") or {}, group_fmt,
                                f"config_groups.{name}", where))
    if len(set(schemes)) != 1:
        raise refuse(where, "config_groups", sorted(groups), "one weight scheme for every "
                      "group")
    return schemes[0]


def _weights(w: dict, fmt: str, at: str, where: str) -> HfQuantScheme:
    if fmt not in FORMATS:
        raise refuse(where, f"{at}.format" if fmt else "format", fmt or None,
                      ", ".join(FORMATS))
    if not w:
        raise refuse(where, f"{at}.weights", w, "an integer weight scheme")
    if str(w.get("type", "int")).lower() != "int":
        raise refuse(where, f"{at}.weights.type", w.get("type"), "int")
    bits = int(w.get("num_bits", 8))
    if bits not in (4, 8):
        raise refuse(where, f"{at}.weights.num_bits", bits, "4, 8")
    if w.get("dynamic"):
        raise refuse(where, f"{at}.weights.dynamic", w.get("dynamic"), "false")
    sym = bool(w.get("symmetric", True))
    if not sym and bits == 8:
        raise refuse(where, f"{at}.weights.symmetric", False,
                      "int8 symmetric only (GGUF Q8_0 has no zero point)")
    if not sym and fmt != "pack-quantized":
        raise refuse(where, f"{at}.weights.symmetric", False,
                      "asymmetric int4 in pack-quantized only")
    strategy = str(w.get("strategy", "tensor")).lower()
    if strategy == "group":
        group = check_group_size(where, f"{at}.weights.group_size",
                                 int(w.get("group_size") or 0))
    elif strategy in ("channel", "tensor"):
        group = -1
    else:
        raise refuse(where, f"{at}.weights.strategy", strategy, "group, channel, tensor")
    actorder = w.get("actorder")
    if actorder not in (None, False, True, "group", "weight", "static"):
        raise refuse(where, f"{at}.weights.actorder", actorder, "group, weight")
    # "group" (or True) stores weight_g_idx; "weight" reorders during calibration only.
    desc_act = actorder in (True, "group")
    return HfQuantScheme("compressed-tensors", bits, group, sym, desc_act,
                         "int-quantized" if fmt == "naive-quantized" else fmt, source=where)


__all__ = ["FORMATS", "compressed_tensors_scheme"]
