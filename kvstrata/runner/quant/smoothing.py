"""Activation smoothing before int8 quantisation (SmoothQuant, alpha = 0.5), calibrated at load.

Per-token int8 activations lose most where a few input channels are much larger than the rest
(LLM activation outliers): those channels set the token's scale and crush the others. Measured
on SmolLM2-135M (docs/benchmarks.md): plain w8a8 raised perplexity on docs/architecture.md
by ~4.4%, almost all of it from the inputs of the qkv and output projections; smoothing brings
it to ~1.5-1.8%. Calibrating on random token ids made it worse (~5.6%), so the ranges come from a
fixed text (runner/quant/calibration_text.py) tokenised by the model's own tokenizer.

For each linear layer fed by an RMSNorm (qkv, gate|up, the output projection) and for down
(fed by silu(gate) * up), input channel j is divided by s_j = sqrt(max|x_j| / max|W_:,j|)
and the weight's column j multiplied by it: the product is unchanged in exact arithmetic, and
the outliers' range is split between activations and weights. The division is folded into
the norm's weight (or the up rows), so it costs nothing at run time. o_proj is left alone: its
input channels come from v heads shared by several query heads (GQA). An MoE layer
(runner/models/moe_decoder.py) smooths its qkv only: its post-norm feeds the float router and
every expert, so one factor per channel would have to fold into all of them and into the
router's weights (whose rounding then moves near-tied choices) -- not built, not measured.
DeepSeek's MLA models are quantized unsmoothed (runner/models/deepseek_w8a8.py).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

ALPHA = 0.5
CALIBRATION_TOKENS = 512


class _CausalAttention:
    """Plain causal attention over one sequence, for the calibration forward: it runs before
    the KV pool exists (the pool is sized from what the quantised weights leave)."""

    def __init__(self, num_heads: int, num_kv_heads: int):
        self.gqa = num_heads != num_kv_heads

    def init_forward_metadata(self, fb: Any) -> None:
        pass

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                fb: Any) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q.float().transpose(0, 1),
                                             k.float().transpose(0, 1),
                                             v.float().transpose(0, 1), is_causal=True,
                                             enable_gqa=self.gqa)
        return out.transpose(0, 1).reshape(q.shape[0], -1).to(q.dtype)


def activation_ranges(model: Any, token_ids: list[int]) -> dict[int, torch.Tensor]:
    """max |x| per input channel of every linear layer over one float forward of
    `token_ids`, keyed by id() of the layer's weight tensor."""
    from kvstrata.runner.forward_batch import ForwardBatch

    ranges: dict[int, torch.Tensor] = {}

    def recording_linear(x, weight, bias=None):
        seen = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        old = ranges.get(id(weight))
        ranges[id(weight)] = seen if old is None else torch.maximum(old, seen)
        if weight is model.lm_head:  # only its input range is needed: skip the vocab GEMM
            return x.new_zeros(x.shape[0], 1)
        # In float32 whatever the model's dtype: torch's bf16 F.linear and SDPA have no fast
        # body on a CPU without AVX-512 BF16 (the calibration forward took ~70 of the ~100
        # CPU-s of a bf16 SmolLM2 w8a8 load on an AVX2 EPYC, float32 a few), and the ranges
        # only need the activations' magnitudes.
        return F.linear(x.float(), weight.float(),
                        None if bias is None else bias.float()).to(x.dtype)

    saved_linear, saved_attn = model.linear, model.attn_backend
    model.linear = recording_linear
    model.attn_backend = _CausalAttention(model.dims.num_heads, model.dims.num_kv_heads)
    try:
        # Logits for every token (logits_idx None): the output projection's input range must
        # cover the whole text, not only the last token.
        model(ForwardBatch.build([list(token_ids)], [0], [0], model.device))
    finally:
        model.linear, model.attn_backend = saved_linear, saved_attn
    return ranges


def _factors(act_max: torch.Tensor, weight: torch.Tensor,
             over_ranks: Any = None) -> torch.Tensor:
    """`over_ranks`: a tensor-parallel model's max over ranks, for a weight whose rows are
    split (column-parallel): every rank then folds the one-rank model's factors."""
    w_max = weight.detach().abs().amax(dim=0).float()
    if over_ranks is not None:
        w_max = over_ranks(w_max)
    w_max = w_max.clamp(min=1e-5)
    s = act_max.clamp(min=1e-5).pow(ALPHA) / w_max.pow(1 - ALPHA)
    return s.clamp(min=1e-4, max=1e4).to(weight.dtype)


@torch.inference_mode()
def smooth_model(model: Any, token_ids: list[int]) -> torch.Tensor:
    """Fold smoothing factors into the model's float weights in place. Returns the factors of
    the output projection: the caller scales the (int8 copy of the) lm_head by them, since
    a tied embedding must stay as it is for the lookup."""
    ranges = activation_ranges(model, token_ids)
    rows_split = getattr(model, "max_over_ranks", None)  # tensor parallel: rows per rank
    for layer in model.layers:
        s = _factors(ranges[id(layer.qkv_weight)], layer.qkv_weight, rows_split)
        layer.input_norm.data.div_(s)
        layer.qkv_weight.data.mul_(s)
        if layer.gate_up_weight is None:  # an MoE layer: its FFN input is not smoothed
            continue
        s = _factors(ranges[id(layer.gate_up_weight)], layer.gate_up_weight, rows_split)
        layer.post_norm.data.div_(s)
        layer.gate_up_weight.data.mul_(s)
        s = _factors(ranges[id(layer.down_weight)], layer.down_weight)
        inter = layer.down_weight.shape[1]
        layer.gate_up_weight.data[inter:].div_(s[:, None])  # up rows: silu(gate) * up / s
        if layer.gate_up_bias is not None:
            layer.gate_up_bias.data[inter:].div_(s)
        layer.down_weight.data.mul_(s)
    s = _factors(ranges[id(model.lm_head)], model.lm_head, rows_split)
    model.final_norm.data.div_(s)
    return s


def calibration_token_ids(source: Any, vocab_size: int) -> tuple[list[int] | None, str]:
    """The calibration text in the model's own tokens, or (None, why not) when the model has
    no usable tokenizer (e.g. a bare test checkpoint): quantisation then runs unsmoothed."""
    from kvstrata.config.model_source import load_tokenizer
    from kvstrata.runner.quant.calibration_text import CALIBRATION_TEXT

    try:
        tokenizer = load_tokenizer(source)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        return None, f"none: no tokenizer to calibrate with ({type(exc).__name__})"
    ids = list(tokenizer(CALIBRATION_TEXT)["input_ids"])[:CALIBRATION_TOKENS]
    # A tokenizer without a vocabulary (transformers builds one from a bare config) gives
    # nothing useful; ids beyond the embedding mean it is not this model's tokenizer.
    if len(ids) < 64 or max(ids) >= vocab_size:
        return None, "none: the tokenizer does not fit the model"
    return ids, f"SmoothQuant alpha={ALPHA} over {len(ids)} calibration tokens"
