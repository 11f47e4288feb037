"""The llama-family MoE blocks on kvstrata's packed linears, unflagged (runner/cpu/
fixed_experts.pack_moe_layers): Qwen3-MoE, Qwen2-MoE (gated shared expert), Mixtral and
GLM-4.5 (grouped sigmoid router, shared experts), tiny random checkpoints wide enough that
kvstrata's bf16 GEMM sums rows long enough to differ from F.linear's.

- the router, each routed expert (one layout: no oneDNN copy beside kvstrata's GEMM) and the
  shared experts are PackedLinears and /server_info counts the blocks;
  KVSTRATA_CPU_PACKED_EXPERTS=0 keeps the path before (experts on F.linear over the plain
  stacks, attention packed);
- one forward of a packed block runs the router once over every token and each chosen
  expert's gate|up and down once, over exactly the tokens routed to it (one GEMM per
  expert per step), and equals a per-(token, expert) textbook sum over the plain weights --
  at float32 (oneDNN's layout) with the unpacked block's expert choice, at bf16 (kvstrata's
  GEMM) within bf16 rounding: a bypassed layer or a token sent to the wrong expert fails;
- bf16 prefill logits against transformers' float32: in the median token no further than
  the unpacked bf16 path's (float32 against transformers: test_moe_families.py, 1e-4).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from helpers.family_checks import (assert_packed_as_close_as_unpacked,
                                   bf16_runners_by_switch, random_prompts)
from helpers.moe_ckpt import MOES, VOCAB, build_moe_checkpoint, hf_moe

WIDER = {"qwen3_moe": dict(hidden_size=256, moe_intermediate_size=128, intermediate_size=256),
         "qwen2_moe": dict(hidden_size=256, moe_intermediate_size=128, intermediate_size=256,
                           shared_expert_intermediate_size=192),
         "mixtral": dict(hidden_size=256, intermediate_size=128),
         "glm4_moe": dict(hidden_size=256, moe_intermediate_size=128, intermediate_size=256)}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe_packed")
    return {a: build_moe_checkpoint(a, str(root / a), **WIDER[a]) for a in MOES}


@pytest.fixture(scope="module")
def runners(paths):
    """(arch, packed) -> a bf16 runner; packed False: KVSTRATA_CPU_PACKED_EXPERTS=0."""
    return bf16_runners_by_switch(paths, "KVSTRATA_CPU_PACKED_EXPERTS")


def _blocks(model) -> list:
    return [layer.moe for layer in model.layers if layer.moe is not None]


@pytest.mark.parametrize("arch", MOES)
def test_router_experts_and_shared_experts_are_packed(arch, runners):
    from kvstrata.runner.cpu.packed_linear import PackedLinear, own_bf16_fits, packed_linear

    runner = runners[arch, True]
    blocks = _blocks(runner.model)
    assert runner.quantization_info["packed_moe_layers"] == len(blocks) > 0
    for moe in blocks:
        assert moe.linear is packed_linear and not moe.batch_invariant
        assert isinstance(moe.router, PackedLinear)
        assert len(moe.gate_up) == len(moe.down) == 8
        for expert in [*moe.gate_up, *moe.down]:
            assert isinstance(expert, PackedLinear) and expert.onednn is None  # one layout
            assert expert.own == own_bf16_fits(torch.empty(
                expert.out_features, expert.in_features, dtype=torch.bfloat16))
        if arch in ("qwen2_moe", "glm4_moe"):
            assert isinstance(moe.shared.gate_up, PackedLinear)
            assert isinstance(moe.shared.down, PackedLinear)
        if arch == "qwen2_moe":
            assert isinstance(moe.shared_gate, PackedLinear)
    control = runners[arch, False]
    assert "packed_moe_layers" not in control.quantization_info
    moe = _blocks(control.model)[0]
    assert isinstance(moe.gate_up, torch.nn.Parameter) and moe.linear is F.linear
    assert isinstance(control.model.layers[0].qkv_weight, PackedLinear)  # the path before


def _expert_ref(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    gate, up = (x @ gate_up.float().T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down.float().T


def textbook(plain, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum over a token's chosen experts, one (token, expert) pair at a time, in float32 over
    the unpacked block's plain weights; plus the shared experts (Qwen2-MoE's gated)."""
    xf = x.float()
    out = torch.zeros_like(xf)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            out[t] += float(weights[t, j]) * _expert_ref(plain.gate_up[e], plain.down[e], xf[t])
    shared = getattr(plain, "shared", None)
    if shared is not None:
        part = _expert_ref(shared.gate_up, shared.down, xf)
        gate = getattr(plain, "shared_gate", None)
        out += part if gate is None else torch.sigmoid(xf @ gate.float().T) * part
    return out


def _spy(moe, calls: list, monkeypatch) -> None:
    """Record (layer, rows) of every GEMM the block runs: its `linear` and the fused
    silu(gate) * up of a gate|up layer (swiglu_of calls that one directly)."""
    inner = moe.linear

    def linear(x, layer, bias=None):
        calls.append((id(layer), x.shape[0]))
        return inner(x, layer, bias)
    monkeypatch.setattr(moe, "linear", linear)
    for layer in moe.gate_up:
        fused = layer.linear_silu_mul

        def silu(x, layer=layer, fused=fused):
            out = fused(x)
            if out is not None:
                calls.append((id(layer), x.shape[0]))
            return out
        monkeypatch.setattr(layer, "linear_silu_mul", silu)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("arch", MOES)
def test_each_chosen_expert_runs_once_over_its_tokens(arch, dtype, runners, monkeypatch):
    from kvstrata.runner.cpu.fixed_experts import pack_block

    plain = _blocks(runners[arch, False].model)[-1]
    if dtype == torch.bfloat16:  # the served block (the spy undone after the test)
        moe = _blocks(runners[arch, True].model)[-1]
    else:  # the same weights widened, on oneDNN's fp32 layout
        plain = copy.deepcopy(plain).float()
        moe = copy.deepcopy(plain)
        pack_block(moe)
    torch.manual_seed(5)
    x = torch.randn(23, plain.gate_up.shape[-1]).to(dtype)
    ids, weights = moe.route(x)
    if dtype == torch.float32:  # the same choice as F.linear's router
        assert torch.equal(ids.sort(dim=-1)[0], plain.route(x)[0].sort(dim=-1)[0])
    calls: list = []
    _spy(moe, calls, monkeypatch)
    with torch.no_grad():
        out = moe(x)
    counts = torch.bincount(ids.reshape(-1), minlength=8).tolist()
    routed = [(id(layer), n) for e, n in enumerate(counts) if n
              for layer in (moe.gate_up[e], moe.down[e])]
    expert_ids = {id(layer) for layer in [*moe.gate_up, *moe.down]}
    assert sorted(c for c in calls if c[0] in expert_ids) == sorted(routed)
    assert calls.count((id(moe.router), 23)) == 1
    want = textbook(plain, x, ids, weights)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(out.float(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("arch", MOES)
def test_bf16_logits_as_close_to_transformers_as_unpacked(arch, paths, runners):
    assert_packed_as_close_as_unpacked(runners[arch, True], runners[arch, False],
                                       hf_moe(paths[arch]), random_prompts(11, (9, 33), VOCAB),
                                       arch)
