"""The unflagged DeepSeek path on kvstrata's packed linears (runner/models/deepseek_packed.py):
DeepSeek-V3 and V2-Lite's shape (helpers/moe_ckpt.py, tiny random checkpoints) at bfloat16.

- every matmul is packed: the MLA projections, kv_b_proj's absorbed halves (contiguous
  stacks for one batched matmul each), the dense MLP, the router, each routed expert (one layout: no oneDNN copy beside
  kvstrata's GEMM) and the shared experts; /server_info says so;
  KVSTRATA_CPU_PACKED_LINEAR=0 keeps torch's F.linear (the control);
- prefill logits at bf16 against transformers' float32: in the median token no further than
  the unpacked bf16 path's (float32, where packing is oneDNN's layout, is
  test_deepseek_families.py's 1e-4, unchanged; the NEXTN draft's layer:
  test_speculative_mtp_mla.py).
"""
from __future__ import annotations

import pytest
import torch

from helpers.family_checks import (assert_packed_as_close_as_unpacked,
                                   bf16_runners_by_switch, random_prompts)
from helpers.moe_ckpt import VOCAB, build_moe_checkpoint, hf_moe

ARCHS = ("deepseek_v3", "deepseek_v2_lite")
# bf16 logits against float32 transformers: the packed path's median token error at most
# this times the unpacked path's (both round every activation to bf16; summation orders differ)
MEDIAN_ERROR_RATIO = 1.25
# Wider than helpers/moe_ckpt.py's defaults, so that kvstrata's bf16 GEMM sums long enough
# rows to differ from F.linear's (at hidden 64 both gave the same bf16 logits)
WIDER = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
             kv_lora_rank=64)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mla_packed")
    return {a: build_moe_checkpoint(a, str(root / a), **WIDER) for a in ARCHS}


@pytest.fixture(scope="module")
def runners(paths):
    """(arch, packed) -> a bf16 runner; packed False: KVSTRATA_CPU_PACKED_LINEAR=0."""
    return bf16_runners_by_switch(paths, "KVSTRATA_CPU_PACKED_LINEAR")


@pytest.mark.parametrize("arch", ARCHS)
def test_every_matmul_is_packed(arch, runners):
    from kvstrata.runner.cpu.packed_linear import PackedLinear, own_bf16_fits

    model = runners[arch, True].model
    d = model.dims
    info = runners[arch, True].quantization_info
    assert (info["packed_moe_layers"], info["packed_absorbed_heads"]) == (2, d.num_heads)
    assert isinstance(model.lm_head, PackedLinear)
    for layer in model.layers:
        projections = (["q_proj"] if arch == "deepseek_v2_lite" else ["q_a_proj", "q_b_proj"])
        for name in projections + ["kv_a_proj", "o_proj"]:
            assert isinstance(getattr(layer, name), PackedLinear), name
        # the absorbed halves as contiguous stacks for one bmm each
        key, value = layer.absorbed(d)
        assert layer.key_heads is None and torch.equal(layer.key_stack, key)
        assert torch.equal(layer.value_stack, value.transpose(1, 2))
        assert layer.key_stack.is_contiguous() and layer.value_stack.is_contiguous()
    dense, moe = model.layers[0].mlp, model.layers[1].mlp
    assert isinstance(dense.gate_up, PackedLinear) and isinstance(dense.down, PackedLinear)
    assert isinstance(moe.router, PackedLinear) and isinstance(moe.shared.down, PackedLinear)
    assert len(moe.gate_up) == len(moe.down) == d.n_routed_experts
    for expert in [*moe.gate_up, *moe.down]:
        assert isinstance(expert, PackedLinear) and expert.onednn is None  # one layout
        # kvstrata's bf16 GEMM wherever it takes the weight (AVX512-BF16 / AMX / AVX2 CPUs)
        assert expert.own == own_bf16_fits(torch.empty(expert.out_features,
                                                       expert.in_features,
                                                       dtype=torch.bfloat16))
    assert not moe.batch_invariant  # the serving combine, not deterministic inference's
    control = runners[arch, False].model
    assert control.linear is torch.nn.functional.linear
    assert not isinstance(control.layers[1].mlp.router, PackedLinear)
    assert "packed_absorbed_heads" not in runners[arch, False].quantization_info


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_logits_as_close_to_transformers_as_unpacked(arch, paths, runners):
    """Per token, the largest logit error against transformers' float32: packed no worse than
    unpacked, in the median over tokens (helpers/family_checks.py)."""
    assert_packed_as_close_as_unpacked(runners[arch, True], runners[arch, False],
                                       hf_moe(paths[arch]), random_prompts(11, (9, 40), VOCAB),
                                       arch, MEDIAN_ERROR_RATIO)
