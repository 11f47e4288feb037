"""The recurrent layers' one-token decode step as one C call a layer (csrc/recurrent_step.c),
in place on the CPU state pool: each (row, head) state is read once and written once, where
the torch step (gated_delta.py, ssd.py) gathers the slots, runs five full-size ops and
scatters them back. Returns None where it does not apply (not a CPU pool of fp32 / bf16,
KVSTRATA_CPU_RECURRENT_STEP=0); the caller then runs the torch step."""
from __future__ import annotations

import torch

from kvstrata import envs
from kvstrata.runner.cpu.isa import isa_cap
from kvstrata.runner.recurrent import _recurrent_step
from kvstrata.runner.recurrent.gated_delta import prepare_qk

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def applies(states: torch.Tensor) -> bool:
    """`states`: one layer's [slots, ...] view of the pool."""
    return (envs.KVSTRATA_CPU_RECURRENT_STEP.get() and states.device.type == "cpu"
            and states.dtype in _DTYPES and states.is_contiguous())


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous()


def gated_delta_step(states: torch.Tensor, slots: torch.Tensor, q, k, v, g, beta
                     ) -> torch.Tensor | None:
    """As gated_delta.gated_delta_step for rows reading and leaving their state in
    states[slots]; returns o [N, Hv, Dv] float32."""
    if not applies(states):
        return None
    n, hv, dv = v.shape
    q, k = (t.contiguous() for t in prepare_qk(q, k, hv))
    v, g, beta = _f32(v), _f32(g), _f32(beta)
    out = torch.empty(n, hv, dv, dtype=torch.float32)
    slots = slots.contiguous()
    _recurrent_step.gated_delta_step(
        states.data_ptr(), slots.data_ptr(), n, q.data_ptr(), k.data_ptr(), v.data_ptr(),
        g.data_ptr(), beta.data_ptr(), out.data_ptr(), hv, q.shape[-1], dv,
        _DTYPES[states.dtype], torch.get_num_threads(), isa_cap())
    return out


def ssd_step(states: torch.Tensor, slots: torch.Tensor, x, dt, A, B, C, D
             ) -> torch.Tensor | None:
    """As ssd.ssd_step for rows reading and leaving their state in states[slots]; returns
    y [N, H, P] float32."""
    if not applies(states):
        return None
    n, heads, p = x.shape
    x, dt, A, B, C, D = (_f32(t) for t in (x, dt, A, B, C, D))
    out = torch.empty(n, heads, p, dtype=torch.float32)
    slots = slots.contiguous()
    _recurrent_step.ssd_step(
        states.data_ptr(), slots.data_ptr(), n, x.data_ptr(), dt.data_ptr(), A.data_ptr(),
        B.data_ptr(), C.data_ptr(), D.data_ptr(), out.data_ptr(), heads, p, B.shape[-1],
        B.shape[-2], _DTYPES[states.dtype], torch.get_num_threads(), isa_cap())
    return out
