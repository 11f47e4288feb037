"""The config of a Mamba2, Nemotron-H (dense or MoE), Granite-4.0-H, Qwen3.5, Qwen3-Next or
Falcon-H1 GGUF file (llama.cpp archs `mamba2`, `nemotron_h`, `nemotron_h_moe`, `granitehybrid`,
`qwen35`, `qwen3next`, `falcon-h1`, written by convert_hf_to_gguf.py's Mamba2Model /
NemotronHModel / GraniteHybridModel / Qwen3_5TextModel / Qwen3NextModel / FalconH1Model) read
the way llama.cpp reads it (llama-model.cpp's hparams for these archs); transformers converts
none of these archs' configs, so every field the models read (runner/models/nemotron_h.py,
granite_hybrid.py, qwen3_next.py, falcon_h1.py) comes from the header (Nemotron-H MoE's expert
keys: config/gguf_nemotron_moe.py; Falcon-H1's attention, MLP and multipliers:
config/gguf_falcon_h1.py):

  - Mamba2 layers: ssm.inner_size (d_inner), ssm.time_step_rank (the head count: llama.cpp's
    n_head = dt_rank, head size d_inner / n_head), ssm.state_size, ssm.group_count,
    ssm.conv_kernel; attention.layer_norm_rms_epsilon (every RMSNorm, the gated group norm
    too); biases by the tensors the file holds (ssm_conv1d.bias, ssm_in.bias);
  - Nemotron-H's layer kinds from the per-layer arrays, as llama.cpp decides them: a layer
    with attention.head_count_kv 0 and feed_forward_length 0 is Mamba2, one with K/V heads
    attention, one with a feed-forward length the relu^2 MLP (nemotron_h_moe: a MoE; both at
    once: refused; an MTP block after the layers, nextn_predict_layers, not counted);
    attention.key_length is the head size (value_length must equal it), attention without
    rope at 1/sqrt(head size) (llama.cpp's rope type NONE for the arch);
  - Granite-4.0-H's: a layer with K/V heads is attention, the others Mamba2; rope (llama.cpp's
    interleaved pairs, the converter's q / k permutation) iff rope.scaling.finetuned, base
    rope.freq_base; attention.scale, embedding_scale, residual_scale, logit_scale as the
    multipliers (absent: llama.cpp applies none; the attention's then 1/sqrt(head size));
    expert_count / expert_used_count, the expert and shared MLP widths from their tensors;
  - Qwen3.5's: every full_attention_interval-th layer (default 4) full attention, the others
    Gated DeltaNet with ssm.group_count key heads of ssm.state_size and ssm.time_step_rank
    value heads of ssm.inner_size / time_step_rank; rope over rope.dimension_count of the
    head; an MTP block after the layers (nextn_predict_layers) is not counted; Qwen3-Next's
    likewise, every layer a MoE (llama.cpp's qwen3next has no dense FFN) of expert_count
    experts, expert_used_count per token (renormalised, as Qwen3-Next's norm_topk_prob), the
    expert and shared expert widths from their tensors;
  - the vocabulary size from token_embd's rows (a converter pads the token list, not the
    matrix), tied embeddings when there is no output.weight (llama.cpp then reads
    token_embd), the special ids from tokenizer.ggml.* (none: null, not a class default);
    context_length as max_position_embeddings, except the converter's placeholder 2**20.
What a file cannot say takes the HF config class's default, which is also what llama.cpp
computes: dt unclamped (time_step_limit (0, inf): llama.cpp's ssm_scan clamps nothing), the
gate applied before the group norm, SiLU in the mixer. Refused by key: a K/V head count or
feed-forward length that differs between layers, value_length != key_length, dt_b_c_rms
(Falcon-Mamba's extra norms), attention biases; Granite's rope scaling or partial rope, a head
size other than hidden / heads; Qwen3.5's rope scaling or experts (a MoE file is qwen35moe:
Qwen3.5's layers, Qwen3-Next's MoE in every layer, no feed_forward_length).
"""
from __future__ import annotations

from typing import Any

from kvstrata.config.gguf_falcon_h1 import falcon_h1_fields
from kvstrata.config.gguf_header import arch_getters
from kvstrata.config.gguf_nemotron_moe import NEMOTRON_MOE_KEYS, nemotron_moe_fields

ARCHITECTURES = {"mamba2": "Mamba2ForCausalLM", "nemotron_h": "NemotronHForCausalLM",
                 "nemotron_h_moe": "NemotronHForCausalLM",
                 "granitehybrid": "GraniteMoeHybridForCausalLM", "qwen35": "Qwen3_5ForCausalLM",
                 "qwen35moe": "Qwen3_5MoeForCausalLM", "qwen3next": "Qwen3NextForCausalLM",
                 "falcon-h1": "FalconH1ForCausalLM"}
MODEL_TYPES = {"mamba2": "mamba2", "nemotron_h": "nemotron_h", "nemotron_h_moe": "nemotron_h",
               "granitehybrid": "granitemoehybrid", "qwen35": "qwen3_5_text",
               "qwen35moe": "qwen3_5_moe_text", "qwen3next": "qwen3_next",
               "falcon-h1": "falcon_h1"}
# The converter writes context_length 2**20 for these archs ("arbitrary value; for those who
# use the default"): no trained context, so the config class's default stands (4096 for
# Nemotron-H; none for Mamba2: kvstrata's default), and --context-length sets another.
_PLACEHOLDER_CONTEXT = 2 ** 20
KEYS = ("block_count", "context_length", "embedding_length", "feed_forward_length",
        "attention.head_count", "attention.head_count_kv", "attention.key_length",
        "attention.value_length", "attention.layer_norm_rms_epsilon",
        "attention.layer_norm_epsilon", "ssm.conv_kernel",
        "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank", "ssm.group_count",
        "ssm.dt_b_c_rms", "rope.freq_base", "rope.dimension_count", "rope.scaling.type",
        "rope.scaling.finetuned", "expert_count", "expert_used_count", "attention.scale",
        "embedding_scale", "residual_scale", "logit_scale", "full_attention_interval",
        "nextn_predict_layers", *NEMOTRON_MOE_KEYS)
_ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base_train default


def hybrid_fields(meta: dict[str, Any], dims: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """config.json fields of a mamba2 / nemotron_h / granitehybrid / qwen35 / qwen3next file
    from its metadata and tensor table
    (name -> ne); {} for other archs."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        return {}

    get, need = arch_getters(meta, arch)

    if get("ssm.dt_b_c_rms"):
        raise ValueError(f"GGUF {arch}: ssm.dt_b_c_rms (RMS norms on dt, B and C) is not "
                         f"supported")
    n_layer, n_embd = int(need("block_count")), int(need("embedding_length"))
    # Qwen3.5's and Nemotron-H MoE's MTP block follows the model's layers (_Qwen35MtpMixin,
    # NemotronHModel): not read, as an HF checkpoint's mtp.* is not
    # (runner/models/gguf_hybrid_weights.py skips its tensors); per-layer arrays cover it too
    n_layer -= int(get("nextn_predict_layers", 0) or 0)
    d_inner, n_head = int(need("ssm.inner_size")), int(need("ssm.time_step_rank"))
    n_group = int(need("ssm.group_count"))
    if n_head <= 0 or d_inner % n_head or n_head % n_group:
        raise ValueError(f"GGUF {arch}: ssm.inner_size {d_inner} is not a whole number of "
                         f"ssm.time_step_rank {n_head} heads, or they of {n_group} groups")
    conv_bias = any(n.endswith("ssm_conv1d.bias") for n in dims)
    proj_bias = any(n.endswith("ssm_in.bias") for n in dims)
    # Nemotron-H's converter (TextModel's keys) writes its config's layer_norm_epsilon as
    # attention.layer_norm_epsilon, the others an rms epsilon; either is the RMSNorm eps
    eps = get("attention.layer_norm_rms_epsilon")
    eps = float(need("attention.layer_norm_epsilon") if eps is None else eps)
    fields: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]], "model_type": MODEL_TYPES[arch],
        "num_hidden_layers": n_layer, "hidden_size": n_embd, **_vocabulary(arch, dims)}
    context = int(get("context_length") or 0)
    if context and context != _PLACEHOLDER_CONTEXT:
        fields["max_position_embeddings"] = context
    if arch == "falcon-h1":
        return {**fields, **falcon_h1_fields(arch, get, need, n_layer, n_embd, dims),
                "rms_norm_eps": eps, "mamba_d_ssm": d_inner, "mamba_n_heads": n_head,
                "mamba_d_head": d_inner // n_head, "mamba_d_state": int(need("ssm.state_size")),
                "mamba_n_groups": n_group, "mamba_d_conv": int(need("ssm.conv_kernel")),
                "mamba_conv_bias": conv_bias, "mamba_proj_bias": proj_bias}
    if arch == "granitehybrid":
        return {**fields, **_granite(arch, get, need, n_layer, n_embd, dims), "rms_norm_eps": eps,
                "mamba_n_heads": n_head, "mamba_d_head": d_inner // n_head,
                "mamba_expand": _expand(arch, d_inner, n_embd),
                "mamba_d_state": int(need("ssm.state_size")), "mamba_n_groups": n_group,
                "mamba_d_conv": int(need("ssm.conv_kernel")), "mamba_conv_bias": conv_bias,
                "mamba_proj_bias": proj_bias}
    if arch in ("qwen35", "qwen35moe", "qwen3next"):
        return {**fields, **_qwen35(arch, get, need, n_layer, n_embd, dims), "rms_norm_eps": eps,
                "linear_num_key_heads": n_group, "linear_num_value_heads": n_head,
                "linear_key_head_dim": int(need("ssm.state_size")),
                "linear_value_head_dim": d_inner // n_head,
                "linear_conv_kernel_dim": int(need("ssm.conv_kernel"))}
    fields.update(conv_kernel=int(need("ssm.conv_kernel")), n_groups=n_group,
                  use_conv_bias=conv_bias, use_bias=proj_bias, layer_norm_epsilon=eps)
    if arch == "mamba2":
        return {**fields, "num_heads": n_head, "head_dim": d_inner // n_head,
                "expand": _expand(arch, d_inner, n_embd),
                "state_size": int(need("ssm.state_size")), "hidden_act": "silu",
                "residual_in_fp32": True}
    layers = _nemotron_h_layers(arch, get, need, n_layer, n_embd, dims)
    if arch == "nemotron_h_moe":
        layers.update(nemotron_moe_fields(arch, get, need, layers, dims))
    return {**fields, **layers,
            "mamba_num_heads": n_head, "mamba_head_dim": d_inner // n_head,
            "mamba_proj_bias": proj_bias, "ssm_state_size": int(need("ssm.state_size")),
            "mamba_hidden_act": "silu", "mlp_hidden_act": "relu2"}


def _expand(arch: str, d_inner: int, n_embd: int) -> int:
    if d_inner % n_embd:
        raise ValueError(f"GGUF {arch}: ssm.inner_size {d_inner} is not a multiple of "
                         f"embedding_length {n_embd}")
    return d_inner // n_embd


def _per_layer(arch: str, key: str, value: Any, n_layer: int, extra: int = 0) -> list[int]:
    """A per-layer key's values for the model's layers (`extra`: MTP blocks after them that
    the array covers too, dropped)."""
    values = value if isinstance(value, list) else [value] * n_layer
    if len(values) not in (n_layer, n_layer + extra):
        raise ValueError(f"GGUF {arch}: {key} has {len(values)} entries for {n_layer} layers")
    return [int(v) for v in values[:n_layer]]


def _one_size(arch: str, key: str, values: list[int]) -> int | None:
    """The one non-zero value of a per-layer array (None when every layer has 0)."""
    sizes = sorted(set(values) - {0})
    if len(sizes) > 1:
        raise ValueError(f"GGUF {arch}: {key} differs between layers ({sizes}); one size for "
                         f"every layer of its kind is supported")
    return sizes[0] if sizes else None


def _nemotron_h_layers(arch: str, get, need, n_layer: int, n_embd: int,
                       dims: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """Layer kinds and attention / MLP sizes, as llama.cpp's nemotron_h hparams and graph
    read them."""
    mtp = int(get("nextn_predict_layers", 0) or 0)
    kv = _per_layer(arch, "attention.head_count_kv", get("attention.head_count_kv", 0), n_layer,
                    mtp)
    ff = _per_layer(arch, "feed_forward_length", get("feed_forward_length", 0), n_layer, mtp)
    kinds = []
    for i, (n_kv, n_ff) in enumerate(zip(kv, ff)):
        if n_kv and n_ff:
            raise ValueError(f"GGUF {arch}: layer {i} has both K/V heads ({n_kv}) and a "
                             f"feed-forward length ({n_ff}); a layer is one of Mamba2, "
                             f"attention or MLP")
        # nemotron_h_moe: every feed-forward layer a MoE (llama.cpp builds experts wherever
        # the arch has them; a dense "-" layer cannot be told apart there)
        ffn = "moe" if arch == "nemotron_h_moe" else "mlp"
        kinds.append("full_attention" if n_kv else ffn if n_ff else "linear_attention")
    heads, n_kv, head_dim = _attention(arch, get, kv, n_layer, n_embd, dims, mtp)
    mlp = _one_size(arch, "feed_forward_length", ff)
    return {"layers_block_type": kinds, "num_attention_heads": heads,
            "num_key_value_heads": n_kv, "head_dim": head_dim,
            "attention_bias": False, "intermediate_size": mlp or 0,
            "mlp_bias": any(n.endswith("ffn_up.bias") for n in dims)}


def _attention(arch: str, get, kv: list[int], n_layer: int, n_embd: int,
               dims: dict[str, tuple[int, ...]], mtp: int = 0) -> tuple[int, int, int]:
    """(heads, K/V heads, head size) of the attention layers (kv: K/V heads per layer)."""
    n_head = get("attention.head_count")
    heads = _one_size(arch, "attention.head_count", _per_layer(
        arch, "attention.head_count", n_head if n_head is not None else 0, n_layer, mtp))
    n_kv = _one_size(arch, "attention.head_count_kv", kv)
    if n_kv is not None and heads is None:
        raise ValueError(f"GGUF {arch}: attention layers without attention.head_count")
    heads = heads or 1  # no attention layer: nothing reads the head shape
    head_dim = int(get("attention.key_length", n_embd // heads))
    value_dim = int(get("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise ValueError(f"GGUF {arch}: attention.value_length {value_dim} != key_length "
                         f"{head_dim} is not supported")
    biases = [name for name in ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias")
              if any(n.endswith(name) for n in dims)]
    if biases:
        raise ValueError(f"GGUF {arch}: attention biases ({', '.join(biases)}) are not "
                         f"supported")
    return heads, n_kv or heads, head_dim


def _granite(arch: str, get, need, n_layer: int, n_embd: int,
             dims: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """Granite-4.0-H as llama.cpp's granitehybrid hparams read it: a layer with K/V heads is
    attention, the others Mamba2; rope iff rope.scaling.finetuned (default true); each
    multiplier from its *_scale key (absent: none applied, i.e. 1; the attention's absent:
    1/sqrt(head size)); the expert and shared MLP widths from their tensors (ne[1])."""
    kv = _per_layer(arch, "attention.head_count_kv", get("attention.head_count_kv", 0), n_layer)
    heads, n_kv, head_dim = _attention(arch, get, kv, n_layer, n_embd, dims)
    if head_dim * heads != n_embd:
        raise ValueError(f"GGUF {arch}: attention.key_length {head_dim} x {heads} heads != "
                         f"embedding_length {n_embd} is not supported (Granite's head size is "
                         f"hidden / heads)")
    rope = bool(get("rope.scaling.finetuned", True))
    scaling = get("rope.scaling.type", "none")
    if rope and scaling != "none":
        raise ValueError(f"GGUF {arch}: rope.scaling.type {scaling!r} is not supported")
    rot = int(get("rope.dimension_count", head_dim))
    if rope and rot != head_dim:
        raise ValueError(f"GGUF {arch}: rope.dimension_count {rot} (a rope over part of the "
                         f"head of {head_dim}) is not supported")
    experts = int(get("expert_count", 0) or 0)
    shared = dims.get("blk.0.ffn_gate_shexp.weight" if experts else "blk.0.ffn_gate.weight")
    if shared is None:
        raise ValueError(f"GGUF {arch}: no shared MLP (ffn_gate_shexp / ffn_gate) in layer 0")
    fields = {
        "layer_types": ["attention" if n else "mamba" for n in kv],
        "num_attention_heads": heads, "num_key_value_heads": n_kv, "attention_bias": False,
        "hidden_act": "silu", "position_embedding_type": "rope" if rope else "nope",
        "rope_parameters": {"rope_type": "default",
                            "rope_theta": float(get("rope.freq_base", _ROPE_BASE))},
        "attention_multiplier": float(get("attention.scale") or head_dim ** -0.5),
        "embedding_multiplier": float(get("embedding_scale") or 1.0),
        "residual_multiplier": float(get("residual_scale") or 1.0),
        "logits_scaling": float(get("logit_scale") or 1.0),
        "num_local_experts": experts, "shared_intermediate_size": int(shared[1])}
    if experts:
        gate = dims.get("blk.0.ffn_gate_exps.weight")
        if gate is None:
            raise ValueError(f"GGUF {arch}: expert_count {experts} but no ffn_gate_exps")
        fields.update(num_experts_per_tok=int(need("expert_used_count")),
                      intermediate_size=int(gate[1]))
    return fields


def _qwen35(arch: str, get, need, n_layer: int, n_embd: int,
            dims: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """Qwen3.5 (dense), Qwen3.5-MoE and Qwen3-Next as llama.cpp's qwen35 / qwen35moe /
    qwen3next hparams read them:
    every full_attention_interval-th layer (default 4) full attention, the others Gated
    DeltaNet (ssm.group_count key heads, ssm.time_step_rank value heads, ssm.state_size the
    key head size); rope over rope.dimension_count of the head (partial_rotary_factor),
    NEOX-style (text positions: Qwen3.5's MRoPE sections do not matter)."""
    experts = int(get("expert_count", 0) or 0)
    if arch == "qwen35" and experts:
        raise ValueError(f"GGUF {arch}: expert_count (a MoE Qwen3.5 is arch qwen35moe) is not "
                         f"supported")
    scaling = get("rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"GGUF {arch}: rope.scaling.type {scaling!r} is not supported")
    interval = int(get("full_attention_interval", 4))
    kv = _per_layer(arch, "attention.head_count_kv", need("attention.head_count_kv"), n_layer)
    heads, n_kv, head_dim = _attention(arch, get, kv, n_layer, n_embd, dims)
    rot = int(get("rope.dimension_count", head_dim))
    moe = {} if arch == "qwen35" else _qwen3_next_moe(arch, need, experts, dims)
    # Qwen3.5-MoE has no dense MLP and its converter writes no feed_forward_length
    ffn = need("feed_forward_length") if arch != "qwen35moe" else get("feed_forward_length")
    return {**moe, **({"intermediate_size": int(ffn)} if ffn else {}),
            "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                            for i in range(n_layer)],
            "num_attention_heads": heads, "num_key_value_heads": n_kv, "head_dim": head_dim,
            "attention_bias": False, "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default",
                                "rope_theta": float(get("rope.freq_base", _ROPE_BASE)),
                                "partial_rotary_factor": rot / head_dim}}


def _qwen3_next_moe(arch: str, need, experts: int, dims: dict[str, tuple[int, ...]]
                    ) -> dict[str, Any]:
    """Qwen3-Next's MoE as llama.cpp's qwen3next (and qwen35moe) builds it: every layer a MoE
    (the arch has no dense FFN tensors) with top-k weights renormalised and a sigmoid-gated
    shared expert; the expert and shared widths from their tensors (ne[1])."""
    gate, shared = dims.get("blk.0.ffn_gate_exps.weight"), dims.get("blk.0.ffn_gate_shexp.weight")
    if not experts or gate is None:
        raise ValueError(f"GGUF {arch}: no experts (expert_count, ffn_gate_exps): every "
                         f"{arch} layer is a MoE")
    return {"num_experts": experts, "num_experts_per_tok": int(need("expert_used_count")),
            "moe_intermediate_size": int(gate[1]),
            "shared_expert_intermediate_size": int(shared[1]) if shared else 0,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}


# config.json's special ids -> the tokenizer keys that hold them
TOKEN_IDS = {"bos_token_id": "tokenizer.ggml.bos_token_id",
             "eos_token_id": "tokenizer.ggml.eos_token_id",
             "pad_token_id": "tokenizer.ggml.padding_token_id"}


def _vocabulary(arch: str, dims: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    if "token_embd.weight" not in dims:
        raise ValueError(f"GGUF {arch}: no token_embd.weight")
    return {"vocab_size": int(dims["token_embd.weight"][1]),
            "tie_word_embeddings": "output.weight" not in dims}


def token_ids(meta: dict[str, Any]) -> dict[str, Any]:
    """The special ids the file names; the others null (a config class's default id would be
    a token the file never said was special)."""
    return {field: meta.get(key) for field, key in TOKEN_IDS.items()}


__all__ = ["ARCHITECTURES", "KEYS", "TOKEN_IDS", "hybrid_fields", "token_ids"]
