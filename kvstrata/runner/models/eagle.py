"""An EAGLE-2 draft head: HF checkpoints of `LlamaForCausalLMEagle` form (SGLang's
`--speculative-algorithm EAGLE`).

Per position i the head reads the target's final-normed hidden state h_i and the embedding
of the *next* token x_{i+1}: fc(cat(embed(x_{i+1}), h_i)) -> its decoder layer(s) -> the
residual stream without a final norm -> the target's output head, which predicts x_{i+2}.
As in SGLang (and the EAGLE reference code) the first layer reads its input unnormalised
(no input_layernorm), and the embedding and output head are the target's own: a
checkpoint's `embed_tokens` / `lm_head` / `norm` tensors are not used. Rotary positions are
the target's (position i), so the head's KV sits in the target's slots, one table for both.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.runner.forward_batch import ForwardBatch
from kvstrata.runner.models.decoder import (ArchSpec, DecoderForCausalLM, DecoderLayer,
                                            ModelDims, _param)
from kvstrata.runner.models.rope import RotaryEmbedding, rope_parameters

EAGLE_ARCHITECTURES = ("LlamaForCausalLMEagle",)
# Checkpoint tensors an EAGLE head may carry that the target's own replace (SGLang shares
# the target's embedding and head with the draft; classic EAGLE heads have no final norm).
_SHARED_OR_UNUSED = ("embed_tokens.weight", "lm_head.weight", "norm.weight",
                     "layers.0.input_layernorm.weight")



class EagleHead(DecoderForCausalLM):
    def __init__(self, config: Any, target: DecoderForCausalLM, dtype: torch.dtype,
                 device: torch.device):
        nn.Module.__init__(self)
        arch = (getattr(config, "architectures", None) or ["?"])[0]
        if arch not in EAGLE_ARCHITECTURES:
            raise ValueError(f"--speculative-draft-model-path: an EAGLE head is a "
                             f"{' or '.join(EAGLE_ARCHITECTURES)} checkpoint, this one is "
                             f"{arch}")
        self.config = config
        self.spec = ArchSpec()
        self.dims = dims = ModelDims.from_config(config)
        t = getattr(target, "full_dims", target.dims)  # a tensor-parallel rank's: the whole
        if dims.hidden_size != t.hidden_size or dims.vocab_size != t.vocab_size:
            raise ValueError(f"--speculative-draft-model-path: the EAGLE head's hidden size "
                             f"{dims.hidden_size} / vocabulary {dims.vocab_size} differ from "
                             f"the target's ({t.hidden_size} / {t.vocab_size}): it was "
                             f"trained for another model")
        self.dtype, self.device = dtype, device
        kw = dict(dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(dims, self.spec, dtype, device)
                                    for _ in range(dims.num_layers))
        self.fc_weight = _param(dims.hidden_size, 2 * dims.hidden_size, **kw)
        self.fc_bias: nn.Parameter | None = _param(dims.hidden_size, **kw)
        self.rotary = RotaryEmbedding(dims.head_dim, rope_parameters(config), device)
        self.attn_backend = None
        self.linear = F.linear
        self.capture_hidden = False
        # The head borrows the target's embedding and output head through the target's own
        # calls (not registered as the head's parameters, so memory accounting counts them
        # once; a tensor-parallel rank's hold a vocabulary slice and gather the rest, every
        # rank running the head in step).
        self.target_embed, self.target_logits = target.embed_tokens, target.output_logits
        self.hot_head: torch.Tensor | None = None  # FR-Spec: the hot rows of the head
        self.hot_ids: torch.Tensor | None = None  # FR-Spec token map (use_token_map)
        self.feature_size = dims.hidden_size  # the target's final hidden state

    def use_token_map(self, hot_ids: torch.Tensor, head_weight: torch.Tensor) -> None:
        """FR-Spec (--speculative-token-map): the head scores only `hot_ids`, through
        those rows of the target's output matrix; other tokens get -inf, so drafts (argmax,
        top-k) are always hot tokens while the logits keep the target's vocabulary."""
        vocab = self.dims.vocab_size
        if hot_ids.ndim != 1 or not len(hot_ids) or int(hot_ids.min()) < 0 or \
                int(hot_ids.max()) >= vocab:
            raise ValueError(f"--speculative-token-map: expected a 1-D list of token ids in "
                             f"[0, {vocab}), got shape {tuple(hot_ids.shape)}")
        self.hot_ids = hot_ids.to(torch.int64).to(self.device)
        self.hot_head = head_weight[self.hot_ids].to(self.dtype).contiguous()
        if self.linear is not F.linear:  # packed (runner/cpu/packed_linear.py): the hot rows too
            from kvstrata.runner.cpu.packed_linear import PackedLinear  # noqa: PLC0415
            self.hot_head = PackedLinear(self.hot_head)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, features: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """`fb.input_ids[j]` is x_{i+1} and `features[j]` h_i for the token at position i.
        Returns (float32 logits, head hidden states) at fb.logits_idx."""
        self.attn_backend.init_forward_metadata(fb)
        cos, sin = self.rotary.cos_sin(fb.positions, self.dtype)
        x = self.target_embed(fb.input_ids)
        x = self.linear(torch.cat([x, features.to(x.dtype)], dim=-1), self.fc_weight,
                        self.fc_bias)
        for i, layer in enumerate(self.layers):
            x = self.layer_forward(i, layer, x, cos, sin, fb, input_norm=i > 0)
        if fb.logits_idx is not None:
            x = x.index_select(0, fb.logits_idx)
        if self.hot_ids is None:
            return self.target_logits(x), x
        logits = self.linear(x, self.hot_head).float()
        full = logits.new_full((logits.shape[0], self.dims.vocab_size), float("-inf"))
        full[:, self.hot_ids] = logits
        return full, x

    # ------------------------------------------------------------------ weight loading
    def load_weight(self, name: str, tensor: torch.Tensor) -> list[str]:
        name = name.removeprefix("model.")
        if name in _SHARED_OR_UNUSED:
            return []
        if name == "fc.weight":
            return self._copy(self.fc_weight, tensor, "fc.weight", name)
        if name == "fc.bias":
            return self._copy(self.fc_bias, tensor, "fc.bias", name)
        return super().load_weight("model." + name, tensor)

    def expected_keys(self) -> set[str]:
        keys = super().expected_keys() - {"embed", "final_norm", "lm_head",
                                          "layers.0.input_norm"}
        return keys | {"fc.weight"}

    def finish_load(self, loaded: list[str]) -> None:
        """fc's bias is optional (SGLang's nn.Linear default has one; most heads store it)."""
        if "fc.bias" not in loaded:
            self.fc_bias = None
        with torch.no_grad():  # never read (input_norm=False), but keep it finite
            self.layers[0].input_norm.fill_(1.0)


def load_eagle_head(source: Any, config: Any, target: DecoderForCausalLM, algorithm: str):
    """The EAGLE (EagleHead) or EAGLE3 (Eagle3Head) head of `source`, checked against the
    algorithm asked for."""
    from kvstrata.runner.models.eagle3 import EAGLE3_ARCHITECTURES, Eagle3Head
    from kvstrata.runner.models.loader import fill_weights

    arch = (getattr(config, "architectures", None) or ["?"])[0]
    want = EAGLE3_ARCHITECTURES if algorithm == "EAGLE3" else EAGLE_ARCHITECTURES
    if arch not in want:
        raise ValueError(f"--speculative-draft-model-path: --speculative-algorithm "
                         f"{algorithm} needs a {' or '.join(want)} checkpoint, this one is "
                         f"{arch}")
    cls = Eagle3Head if algorithm == "EAGLE3" else EagleHead
    head = cls(config, target, target.dtype, target.device)
    return fill_weights(head, source, config, what="EAGLE head ")

__all__ = ["EagleHead", "load_eagle_head"]
