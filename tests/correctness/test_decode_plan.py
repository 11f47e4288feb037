"""The decode plan (runner/models/decode_plan.py) runs the same kernels with the same arguments
as the per-op layer loop: every forward's logits are bit-identical with it on and off (tiny
random checkpoints, fp32 and bf16, GQA, q/k/v biases, an MLP width whose silu is a pass of
its own), it runs wherever its kernels do, and it stays out of what it does not cover."""
from __future__ import annotations

import pytest
import torch

from kvstrata.runner import f32_gemv
from kvstrata.runner.models import decode_plan
from kvstrata.runner.packed_linear import PackedLinear

PARAMS = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def _plan_expected(model) -> bool:
    """Whether this machine runs the plan's kernels for the model's layers (the bf16 GEMM
    or the fp32 GEMV), so that a decode step of up to 8 rows (any CPU) must take it."""
    lin = model.layers[0].qkv_weight
    if not isinstance(lin, PackedLinear) or model.layers[0].q_norm is not None:
        return False
    return lin.own or (lin.gemv is not None and f32_gemv._vector_isa())


def _record(model, forward, build, logits: list, plans: list):

    def recording_forward(fb):
        out = forward(fb)
        logits.append(out.clone())
        return out

    def counting_build(*args, **kwargs):
        plan = build(*args, **kwargs)
        plans.append(plan is not None)
        return plan
    model.forward = recording_forward
    return counting_build


@pytest.mark.parametrize("arch,dtype", [("llama", "float32"), ("llama", "bfloat16"),
                                        ("qwen2", "float32"), ("mistral", "bfloat16"),
                                        ("qwen3", "float32")])
def test_plan_logits_are_bit_identical_to_the_layer_loop(tiny_checkpoints, tiny_prompts,
                                                         monkeypatch, arch, dtype):
    from kvstrata import LLM
    with LLM(model_path=tiny_checkpoints[arch], skip_tokenizer_init=True, dtype=dtype,
             max_total_tokens=2048, disable_radix_cache=True) as llm:
        model = llm.engine.runner.model
        forward, build = model.forward, decode_plan.build
        runs = {}
        for flag in ("1", "0"):
            logits, plans = [], []
            monkeypatch.setenv("KVSTRATA_CPU_DECODE_PLAN", flag)
            monkeypatch.setattr(decode_plan, "build", _record(model, forward, build, logits,
                                                              plans))
            outs = llm.generate(input_ids=tiny_prompts, sampling_params=PARAMS)
            runs[flag] = ([o["output_ids"] for o in outs], logits, plans)
    (ids_on, logits_on, plans_on), (ids_off, logits_off, plans_off) = runs["1"], runs["0"]
    assert ids_on == ids_off
    assert len(logits_on) == len(logits_off) >= PARAMS["max_new_tokens"]
    for got, want in zip(logits_on, logits_off):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert not any(plans_off)
    # every decode step took the plan where its kernels run here (qwen3's per-head q/k
    # norms: never); the prefills never do
    if _plan_expected(model):
        assert PARAMS["max_new_tokens"] - 1 <= sum(plans_on) < len(plans_on)
    else:
        assert not any(plans_on)


def test_plans_are_kept_per_batch_size_and_grow_with_the_contexts(tiny_checkpoints,
                                                                  tiny_prompts, monkeypatch):
    """A plan is made once per decode batch size and reused while the contexts fit its room;
    a forward whose contexts outgrow it gets a new one, still bit-identical to the loop."""
    from kvstrata import LLM
    if not f32_gemv._vector_isa():
        pytest.skip("the fp32 GEMV's vector code does not run here")
    made = []
    real_make, spare_room = decode_plan._make, decode_plan.slot_room
    monkeypatch.setattr(decode_plan, "_make",
                        lambda model, key, room: made.append((key[0], room))
                        or real_make(model, key, room))
    with LLM(model_path=tiny_checkpoints["llama"], skip_tokenizer_init=True, dtype="float32",
             max_total_tokens=2048, disable_radix_cache=True) as llm:
        model = llm.engine.runner.model
        forward, build = model.forward, decode_plan.build
        logits = {}
        for run, flag, room in (("spare", "1", spare_room), ("exact", "1", lambda n: n),
                                ("loop", "0", spare_room)):
            monkeypatch.setenv("KVSTRATA_CPU_DECODE_PLAN", flag)
            monkeypatch.setattr(decode_plan, "slot_room", room)
            monkeypatch.setattr(decode_plan, "build",
                                _record(model, forward, build, logits.setdefault(run, []), []))
            model.__dict__.pop("_decode_plans", None)
            made.clear()
            llm.generate(input_ids=tiny_prompts, sampling_params=PARAMS)
            if run == "spare":  # one batch size, room to spare: one plan for every step
                assert made == [(len(tiny_prompts), 4096)]
            elif run == "exact":  # no room to grow: every step outgrows the last plan
                assert len(made) == PARAMS["max_new_tokens"] - 1
                assert len(model.__dict__["_decode_plans"]) == 1  # replaced, one batch size
    for run in ("spare", "exact"):
        assert len(logits[run]) == len(logits["loop"])
        for got, want in zip(logits[run], logits["loop"]):
            assert torch.equal(got, want)


def test_plan_leaves_what_it_does_not_cover(monkeypatch):
    """More fp32 rows than the GEMV takes (oneDNN's layout), a layer that is not a
    PackedLinear (w8a8's int8 layers, F.linear), and a scalar ISA pin: no call, so `build`
    gives None."""
    w = torch.randn(64, 32)
    lin = PackedLinear(w, None, gemv=True)
    top = f32_gemv.max_rows()
    out = torch.empty(top + 1, 64)
    if lin.gemv is not None and f32_gemv._vector_isa():
        assert decode_plan._linear_call(lin, torch.randn(top, 32), out[:top], 1, 1) is not None
    assert decode_plan._linear_call(lin, torch.randn(top + 1, 32), out, 1, 1) is None
    assert decode_plan._linear_call(w, torch.randn(1, 32), out[:1], 1, 1) is None
    monkeypatch.setenv("KVSTRATA_CPU_ISA", "scalar")
    assert decode_plan._linear_call(lin, torch.randn(1, 32), out[:1], 1, 0) is None
    bf16 = PackedLinear(w.bfloat16(), None)
    assert decode_plan._linear_call(bf16, torch.randn(1, 32).bfloat16(), out[:1].bfloat16(),
                                    1, 0) is None
