"""The recurrent layers' kernels (runner/recurrent/) against transformers' torch references,
which we did not write: Gated DeltaNet's chunk rule and decode step vs
`torch_recurrent_gated_delta_rule` (the per-token loop), Mamba2's chunked SSD and decode step
vs `mamba2_selective_state_update` run token by token, the conv vs `causal_conv1d_fn` /
`causal_conv1d_update`. Lengths below, at and across the 64-token chunk, with and without an
initial state, heads grouped (GVA / n_groups), decays strong enough that the state matters.

float32: atol 2e-5 relative to the output scale (observed ~1e-6). bfloat16 inputs: the
kernels compute in float32, so against the reference on the same (rounded) inputs the
outputs agree to bf16 rounding, atol 1e-2 relative; a state kept in bfloat16
(--mamba-ssm-dtype bfloat16) over 40 decode steps stays within 3e-2 relative.
"""
from __future__ import annotations

import pytest
import torch

from kvstrata.runner.recurrent.conv import conv_chunk, conv_step
from kvstrata.runner.recurrent.gated_delta import (chunk_gated_delta, gated_delta_step,
                                                   gated_delta_steps)
from kvstrata.runner.recurrent.ssd import discretize_dt, ssd_chunk_scan, ssd_step, ssd_steps

LENGTHS = (1, 17, 64, 150)
F32_RTOL = 2e-5
BF16_RTOL = 1e-2


def _hf():
    from transformers.models.mamba2 import modeling_mamba2 as mamba2
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    return qwen3_next, mamba2


def _close(ours: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    scale = float(ref.abs().max()) or 1.0
    err = float((ours.float() - ref.float()).abs().max())
    assert err <= rtol * scale, f"max error {err:.3g} at output scale {scale:.3g}"


def _gdn_inputs(length: int, dtype=torch.float32, b: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed + length)
    hk, hv, dk, dv = 2, 4, 8, 12

    def r(*shape):
        return torch.randn(*shape, generator=g)

    return dict(q=r(b, length, hk, dk).to(dtype), k=r(b, length, hk, dk).to(dtype),
                v=r(b, length, hv, dv).to(dtype),
                g=(-torch.rand(b, length, hv, generator=g) * 0.7).to(dtype),
                beta=torch.rand(b, length, hv, generator=g).to(dtype)), r(b, hv, dk, dv)


def _gdn_reference(qwen3_next, x: dict, state):
    return qwen3_next.torch_recurrent_gated_delta_rule(
        x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=state,
        output_final_state=True, use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("with_state", [False, True])
def test_gated_delta_chunk_rule_matches_the_recurrent_loop(length, with_state):
    qwen3_next, _ = _hf()
    x, state = _gdn_inputs(length)
    state = state if with_state else None
    ref, ref_final = _gdn_reference(qwen3_next, x, state)
    out, final = chunk_gated_delta(**x, state=state)
    _close(out, ref, F32_RTOL)
    _close(final, ref_final, F32_RTOL)
    # every step's state (a speculative verify's) ends where the chunk rule does
    steps_out, states = gated_delta_steps(*x.values(), state)
    _close(steps_out, ref, F32_RTOL)
    _close(states[:, -1], ref_final, F32_RTOL)


def test_gated_delta_decode_step_and_bf16():
    qwen3_next, _ = _hf()
    x, state = _gdn_inputs(1, b=5)
    ref, ref_final = _gdn_reference(qwen3_next, x, state)
    out, final = gated_delta_step(*(t[:, 0] for t in x.values()), state)
    _close(out, ref[:, 0], F32_RTOL)
    _close(final, ref_final, F32_RTOL)
    xb, _ = _gdn_inputs(70, torch.bfloat16)
    ref, ref_final = _gdn_reference(qwen3_next, xb, state[:2])
    out, final = chunk_gated_delta(**xb, state=state[:2].bfloat16())
    _close(out, ref, BF16_RTOL)
    _close(final, ref_final, BF16_RTOL)


def test_gated_delta_state_kept_in_bf16_stays_close():
    x, state = _gdn_inputs(40, b=2)
    s32, s16 = state, state.bfloat16()
    for t in range(40):
        step = [v[:, t] for v in x.values()]
        o32, s32 = gated_delta_step(*step, s32)
        o16, s16 = gated_delta_step(*step, s16)
        s16 = s16.bfloat16()
    _close(o16, o32, 3e-2)


def _ssd_inputs(length: int, dtype=torch.float32, b: int = 2):
    g = torch.Generator().manual_seed(100 + length)
    h, p, groups, n = 8, 6, 2, 16

    def r(*shape):
        return torch.randn(*shape, generator=g)

    return dict(x=r(b, length, h, p).to(dtype), dt=r(b, length, h).to(dtype),
                A=-torch.rand(h, generator=g) * 2 - 0.1, B=r(b, length, groups, n).to(dtype),
                C=r(b, length, groups, n).to(dtype), D=r(h), dt_bias=r(h) * 0.5), r(b, h, p, n)


def _ssd_reference(mamba2, x, dt, A, B, C, D, dt_bias, state):
    """transformers' selective_state_update token by token (its decode path)."""
    b, length, h, p = x.shape
    s = state.clone() if state is not None else torch.zeros(b, h, p, B.shape[-1])
    ys = []
    for t in range(length):
        ys.append(mamba2.mamba2_selective_state_update(
            s, x[:, t].float(), dt[:, t, :, None].float().expand(-1, -1, p),
            A[:, None, None].expand(-1, p, B.shape[-1]), B[:, t].float(), C[:, t].float(),
            D[:, None].expand(-1, p), dt_bias=dt_bias[:, None].expand(-1, p),
            dt_softplus=True))
    return torch.stack(ys, 1), s


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("with_state", [False, True])
def test_ssd_chunked_scan_matches_the_sequential_scan(length, with_state):
    _, mamba2 = _hf()
    x, state = _ssd_inputs(length)
    state = state if with_state else None
    ref, ref_final = _ssd_reference(mamba2, **x, state=state)
    dt = discretize_dt(x["dt"], x["dt_bias"], (0.0, float("inf")))
    args = (x["x"], dt, x["A"], x["B"], x["C"], x["D"])
    out, final = ssd_chunk_scan(*args, state)
    _close(out, ref, F32_RTOL)
    _close(final, ref_final, F32_RTOL)
    steps_out, states = ssd_steps(*args, state)
    _close(steps_out, ref, F32_RTOL)
    _close(states[:, -1], ref_final, F32_RTOL)


def test_ssd_decode_step_and_bf16_inputs():
    _, mamba2 = _hf()
    x, state = _ssd_inputs(1, b=5)
    ref, ref_final = _ssd_reference(mamba2, **x, state=state)
    dt = discretize_dt(x["dt"][:, 0], x["dt_bias"], (0.0, float("inf")))
    out, final = ssd_step(x["x"][:, 0], dt, x["A"], x["B"][:, 0], x["C"][:, 0], x["D"], state)
    _close(out, ref[:, 0], F32_RTOL)
    _close(final, ref_final, F32_RTOL)
    xb, _ = _ssd_inputs(70, torch.bfloat16)
    ref, ref_final = _ssd_reference(mamba2, **xb, state=state[:2])
    dt = discretize_dt(xb["dt"], xb["dt_bias"], (0.0, float("inf")))
    out, final = ssd_chunk_scan(xb["x"], dt, xb["A"], xb["B"], xb["C"], xb["D"], state[:2])
    _close(out, ref, BF16_RTOL)
    _close(final, ref_final, BF16_RTOL)


@pytest.mark.parametrize("split", [1, 3, 30])
def test_conv_over_a_window_is_the_whole_sequence_conv(split):
    """A chunk's conv after `split` tokens, reading the window the first part left, is the
    whole sequence's conv (transformers' causal_conv1d_fn); one token at a time too
    (causal_conv1d_update)."""
    qwen3_next, _ = _hf()
    g = torch.Generator().manual_seed(split)
    cd, kernel, length = 20, 4, 40
    x, w, bias = (torch.randn(length, cd, generator=g), torch.randn(cd, kernel, generator=g),
                  torch.randn(cd, generator=g))
    ref = qwen3_next.causal_conv1d_fn(x.t()[None], w, bias, activation="silu")[0].t()
    first, full = conv_chunk(x[:split], w, bias, None)
    second, _ = conv_chunk(x[split:], w, bias, full[:, -(kernel - 1):])
    _close(torch.cat([first, second]), ref, F32_RTOL)
    window = full[:, -(kernel - 1):][None].clone()
    hf_state = torch.cat([torch.zeros(1, cd, 1), window], dim=2)  # transformers keeps K
    for t in range(split, min(split + 5, length)):
        out, window = conv_step(x[t][None], w, bias, window)
        hf = qwen3_next.causal_conv1d_update(x[t][None, :, None], hf_state, w, bias,
                                             activation="silu")
        _close(out, hf[:, :, 0], F32_RTOL)
        _close(out[0], ref[t], F32_RTOL)


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_decode_step_updates_the_pool_in_place(isa, dtype, monkeypatch):
    """The C step (fused_step.py) against the torch step above on the same slots of a pool,
    under each ISA cap (a cap above the CPU runs the widest body it has): same outputs, the
    rows' slots hold the new state (bf16: the torch state rounded once), other slots
    untouched."""
    from kvstrata.runner.recurrent import fused_step

    monkeypatch.setenv("KVSTRATA_CPU_ISA", isa)
    g = torch.Generator().manual_seed(7)
    slots, others = torch.tensor([7, 2, 5]), [0, 1, 3, 4, 6, 8, 9]
    x, _ = _gdn_inputs(1, b=3)
    pool = torch.randn(10, 4, 8, 12, generator=g).to(dtype)
    step = [t[:, 0] for t in x.values()]
    ref, ref_state = gated_delta_step(*step, pool[slots])
    ours_pool = pool.clone()
    out = fused_step.gated_delta_step(ours_pool, slots, *step)
    _close(out, ref, F32_RTOL)
    _close(ours_pool[slots], ref_state, F32_RTOL if dtype == torch.float32 else 4e-3)
    assert torch.equal(ours_pool[others], pool[others])
    s, _ = _ssd_inputs(1, b=3)
    pool = torch.randn(10, 8, 6, 16, generator=g).to(dtype)
    dt = discretize_dt(s["dt"][:, 0], s["dt_bias"], (0.0, float("inf")))
    args = (s["x"][:, 0], dt, s["A"], s["B"][:, 0], s["C"][:, 0], s["D"])
    ref, ref_state = ssd_step(*args, pool[slots])
    ours_pool = pool.clone()
    _close(fused_step.ssd_step(ours_pool, slots, *args), ref, F32_RTOL)
    _close(ours_pool[slots], ref_state, F32_RTOL if dtype == torch.float32 else 4e-3)
    assert torch.equal(ours_pool[others], pool[others])
