"""DeepSeek-V2 / V3 / V3.2 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, Kimi-K2's V3
configs, DeepseekV32ForCausalLM): MLA attention, with the DSA lightning indexer and top-k
sparse attention on V3.2; a MoE FFN with shared experts after `first_k_dense_replace` dense
layers (moe.py: V2's softmax router, V3's sigmoid one). The contract is transformers'
modelling of each run in float32 on CPU (docs/dsa.md lists what of SGLang's CUDA DSA path,
FP8 indexer cache and Hadamard rotation, is not modelled and why).

Per layer, for the flattened batch (T tokens):
  q_resid = rms(q_a_proj x);  q = q_b_proj q_resid -> per head (nope, rope)
            (q_lora_rank None, V2-Lite: q = q_proj x)
  latent  = (rms(kv_a[:R]), rope(kv_a[R:]))     one [R + r] vector per token, all heads
  V3.2 indexer: q_i = wq_b q_resid, k_i = layernorm(wk x), rope on their first r dims,
           head weights = weights_proj x * Hi^-0.5
  attention in latent space: kv_b_proj's key half is folded into q, its value half expands
  the latent output; over every earlier token (attention/mla_dense.py) or, with DSA, over
  the top-k selected slots (attention/dsa_sparse.py).
RoPE: MLA rotates interleaved pairs (V3 with rope_interleave false: halves; V2's complex
product leaves the pairs interleaved where V3 de-interleaves them, the same dot products);
the indexer rotates halves (as the reference does).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.config.kv_plan import KVComponent, mla_components
from kvstrata.runner.forward_batch import ForwardBatch
from kvstrata.runner.models.decoder import rms_norm
from kvstrata.runner.models.deepseek_config import DeepseekDims, check_config
from kvstrata.runner.models.deepseek_weights import WeightMap
from kvstrata.runner.models.moe import DenseMLP, MoE
from kvstrata.runner.models.registry import architecture_name
from kvstrata.runner.models.rope import RotaryEmbedding, rope_parameters, yarn_mscale


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised: every parameter is overwritten by the loader (checked there).
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek MLA rope: pairs (x0, x1), (x2, x3)... rotated; output de-interleaved
    (evens then odds), as the reference writes it (q and k alike, so dots are unchanged)."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def rope_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DeepseekLayer(nn.Module):
    def __init__(self, d: DeepseekDims, layer_idx: int, dtype: torch.dtype,
                 device: torch.device, **moe_kw):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        h, nh = d.hidden_size, d.num_heads
        bias = d.attention_bias
        self.input_norm = _param(h, **kw)
        self.post_norm = _param(h, **kw)
        lora = d.q_lora_rank
        self.q_proj = _param(nh * d.qk_head_dim, h, **kw) if lora is None else None
        self.q_a_proj = _param(lora, h, **kw) if lora else None
        self.q_a_bias = _param(lora, **kw) if lora and bias else None
        self.q_a_norm = _param(lora, **kw) if lora else None
        self.q_b_proj = _param(nh * d.qk_head_dim, lora, **kw) if lora else None
        self.kv_a_proj = _param(d.kv_lora_rank + d.qk_rope_head_dim, h, **kw)
        self.kv_a_bias = _param(d.kv_lora_rank + d.qk_rope_head_dim, **kw) if bias else None
        self.kv_a_norm = _param(d.kv_lora_rank, **kw)
        self.kv_b_proj = _param(nh * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank, **kw)
        self.o_proj = _param(h, nh * d.v_head_dim, **kw)
        self.o_bias = _param(h, **kw) if bias else None
        dsa = d.uses_dsa
        self.index_wq_b = _param(d.index_n_heads * d.index_head_dim, lora, **kw) if dsa else None
        self.index_wk = _param(d.index_head_dim, h, **kw) if dsa else None
        self.index_k_norm = _param(d.index_head_dim, **kw) if dsa else None
        self.index_k_norm_bias = _param(d.index_head_dim, **kw) if dsa else None
        # Kept in float32 whatever the model dtype (the reference's _keep_in_fp32_modules).
        self.index_weights_proj = (_param(d.index_n_heads, h, dtype=torch.float32,
                                          device=device) if dsa else None)
        self.mlp = (MoE(d, dtype, device, **moe_kw) if d.mlp_layer_types[layer_idx] == "sparse"
                    else DenseMLP(h, d.intermediate_size, dtype, device))
        # Deterministic inference (deepseek_fixed.py): kv_b_proj's halves as one fixed GEMM
        # per head (ModuleLists of PackedLinear), in place of the einsums
        self.key_heads: nn.ModuleList | None = None
        self.value_heads: nn.ModuleList | None = None
        # Packed for serving (deepseek_packed.py): the halves as contiguous stacks for one
        # batched matmul each, key [H, nope, R] and value transposed [H, R, v]
        self.key_stack: torch.Tensor | None = None
        self.value_stack: torch.Tensor | None = None

    def absorbed(self, d: DeepseekDims) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: key half [H, nope, R], value half [H, v, R]."""
        w = self.kv_b_proj.view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
        return w[:, :d.qk_nope_head_dim], w[:, d.qk_nope_head_dim:]


class DeepseekForCausalLM(nn.Module):
    pool_kind = "mla"
    # How a weight is applied: F.linear, or packed_linear once the layers were packed for
    # kvstrata's GEMMs (deepseek_packed.py; deterministic inference: the fixed GEMM,
    # deepseek_fixed.py)
    linear = staticmethod(F.linear)
    # A layer's 2-D linear weights and their biases (packed_linear.pack_model); absent
    # ones (V2-Lite's q_a / q_b, the indexer of V2 / V3) are None
    packed_linears = (("q_proj", None), ("q_a_proj", "q_a_bias"), ("q_b_proj", None),
                      ("kv_a_proj", "kv_a_bias"), ("o_proj", "o_bias"), ("index_wq_b", None),
                      ("index_wk", None), ("index_weights_proj", None))

    def __init__(self, config: Any, raw_config: dict | None, dtype: torch.dtype,
                 device: torch.device, dims: DeepseekDims | None = None, **moe_kw):
        """`dims` / `moe_kw`: a tensor-parallel rank's shapes (runner/parallel/)."""
        super().__init__()
        self.arch = arch = architecture_name(config)
        if raw_config is not None:
            check_config(arch, raw_config)
        self.config = config
        self.dims = d = dims or DeepseekDims.from_config(config, arch)
        self.dtype, self.device = dtype, device
        kw = dict(dtype=dtype, device=device)
        self.embed = _param(d.vocab_size, d.hidden_size, **kw)
        self.layers = nn.ModuleList(DeepseekLayer(d, i, dtype, device, **moe_kw)
                                    for i in range(d.num_layers))
        self.final_norm = _param(d.hidden_size, **kw)
        self.lm_head = self.embed if d.tie_word_embeddings else _param(
            d.vocab_size, d.hidden_size, **kw)
        params = rope_parameters(config)
        self.rotary = RotaryEmbedding(d.qk_rope_head_dim, params, device,
                                      getattr(config, "max_position_embeddings", None))
        self.rope = rope_interleaved if d.rope_interleave else rope_halves
        self.scaling = d.qk_head_dim ** -0.5
        if params["rope_type"] != "default" and params.get("mscale_all_dim"):
            m = yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
            self.scaling *= m * m
        # MLADenseBackend, or DSASparseMLABackend with the indexer; set by the runner
        self.attn_backend = None
        self.fixed_rope = None  # deterministic inference's cos / sin (deepseek_fixed.py)
        self.capture_hidden = False  # keep last_hidden (an MTP draft's features)
        self.last_hidden: torch.Tensor | None = None
        self.weights = WeightMap(self)

    def kv_components(self) -> tuple[KVComponent, ...]:
        d = self.dims
        return mla_components(d.num_layers, d.kv_lora_rank + d.qk_rope_head_dim,
                              str(self.dtype).removeprefix("torch."), d.index_head_dim)
        # (index_head_dim None: no indexer keys beside the latent)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [len(fb.logits_idx), V] in float32 (every token when logits_idx is None).
        With `capture_hidden` set (an MTP draft reads them), `last_hidden` keeps every
        token's final-normed hidden state."""
        d = self.dims
        self.attn_backend.init_forward_metadata(fb)
        cos, sin = self.rope_cos_sin(fb)
        x = self.embed_tokens(fb.input_ids)
        for i, layer in enumerate(self.layers):
            x = self.layer_forward(layer, i, x, cos, sin, fb, self.attn_backend)
        if self.capture_hidden:
            x = rms_norm(x, self.final_norm, d.rms_norm_eps)
            self.last_hidden = x
            if fb.logits_idx is not None:
                x = x.index_select(0, fb.logits_idx)
        else:
            if fb.logits_idx is not None:
                x = x.index_select(0, fb.logits_idx)
            x = rms_norm(x, self.final_norm, d.rms_norm_eps)
        return self.output_logits(x)

    # A tensor-parallel rank (runner/parallel/) overrides these, as on the llama decoder.
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed)

    def output_logits(self, x: torch.Tensor) -> torch.Tensor:
        # a packed head (deepseek_packed.py) writes float32 logits in its one pass
        as_float = getattr(self.lm_head, "linear_float", None)
        logits = as_float(x) if as_float is not None else None
        return logits if logits is not None else self.linear(x, self.lm_head).float()

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial

    def rope_cos_sin(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        # deterministic inference: a table in fixed blocks (deepseek_fixed.BlockedCosSin)
        rope = self.fixed_rope or self.rotary.plain_cos_sin
        cos, sin = rope(fb.positions)
        return cos.to(self.dtype), sin.to(self.dtype)

    def layer_forward(self, layer: "DeepseekLayer", pool_layer: int, x: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch,
                      backend) -> torch.Tensor:
        """One decoder layer over the flattened batch; its KV in `backend`'s pool at layer
        `pool_layer` (an MTP draft runs the same layer over its own pool)."""
        d = self.dims
        t = x.shape[0]
        R, nope = d.kv_lora_rank, d.qk_nope_head_dim
        cos_h, sin_h = cos[:, None, :], sin[:, None, :]
        h = rms_norm(x, layer.input_norm, d.rms_norm_eps)
        linear = self.linear
        if layer.q_proj is not None:
            q_resid, q = None, linear(h, layer.q_proj)
        else:
            q_resid = rms_norm(linear(h, layer.q_a_proj, layer.q_a_bias), layer.q_a_norm,
                               d.rms_norm_eps)
            q = linear(q_resid, layer.q_b_proj)
        q = q.view(t, d.num_heads, d.qk_head_dim)
        kv = linear(h, layer.kv_a_proj, layer.kv_a_bias)
        latent = torch.cat((rms_norm(kv[:, :R], layer.kv_a_norm, d.rms_norm_eps),
                            self.rope(kv[:, R:], cos, sin)), dim=-1)
        q_latent = self._absorb_keys(layer, q[..., :nope])
        q_full = torch.cat((q_latent, self.rope(q[..., nope:], cos_h, sin_h)), -1)
        if d.uses_dsa:
            index_q, index_k, index_w = self._indexer(layer, h, q_resid, cos, sin)
            out_latent = backend.forward(pool_layer, q_full, latent, index_q, index_k,
                                         index_w, fb)
        else:
            out_latent = backend.forward(pool_layer, q_full, latent, fb)
        attn = self._expand_values(layer, out_latent).reshape(t, -1)
        x = x + self.reduce(linear(attn, layer.o_proj, layer.o_bias))
        return x + self.reduce(layer.mlp(rms_norm(x, layer.post_norm, d.rms_norm_eps)))

    def _absorb_keys(self, layer: DeepseekLayer, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, nope] -> [T, H, R]: kv_b_proj's key half folded into the query."""
        if layer.key_stack is not None:
            return torch.bmm(q_nope.transpose(0, 1), layer.key_stack).transpose(0, 1)
        if layer.key_heads is None:
            return torch.einsum("thn,hnr->thr", q_nope, layer.absorbed(self.dims)[0])
        return torch.stack([self.linear(q_nope[:, i].contiguous(), head)
                            for i, head in enumerate(layer.key_heads)], dim=1)

    def _expand_values(self, layer: DeepseekLayer, out_latent: torch.Tensor) -> torch.Tensor:
        """out_latent [T, H, R] -> [T, H, v]: kv_b_proj's value half."""
        if layer.value_stack is not None:
            return torch.bmm(out_latent.transpose(0, 1), layer.value_stack).transpose(0, 1)
        if layer.value_heads is None:
            return torch.einsum("thr,hvr->thv", out_latent, layer.absorbed(self.dims)[1])
        return torch.stack([self.linear(out_latent[:, i].contiguous(), head)
                            for i, head in enumerate(layer.value_heads)], dim=1)

    def _indexer(self, layer: DeepseekLayer, h: torch.Tensor, q_resid: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.dims
        t, r = h.shape[0], d.qk_rope_head_dim
        q = self.linear(q_resid, layer.index_wq_b).view(t, d.index_n_heads, d.index_head_dim)
        k = F.layer_norm(self.linear(h, layer.index_wk), (d.index_head_dim,), layer.index_k_norm,
                         layer.index_k_norm_bias, 1e-6)
        q = torch.cat((rope_halves(q[..., :r], cos[:, None, :], sin[:, None, :]), q[..., r:]), -1)
        k = torch.cat((rope_halves(k[:, :r], cos, sin), k[:, r:]), -1)
        weights = self.linear(h.float(), layer.index_weights_proj) * d.index_n_heads ** -0.5
        return q, k, weights

    # ------------------------------------------------------------------ weight loading
    def load_weight(self, name: str, tensor: torch.Tensor) -> list[str]:
        return self.weights.load(name, tensor)

    def expected_keys(self) -> set[str]:
        return self.weights.expected_keys()
