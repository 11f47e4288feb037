"""The decode plan (runner/models/decode_plan.py) runs the same kernels with the same arguments
as the per-op layer loop: every forward's logits are bit-identical with it on and off (tiny
random checkpoints, fp32 and bf16, GQA, q/k/v biases, an MLP width whose silu is a pass of
its own, w8a8 int8 layers, more fp32 rows than the GEMV takes), it runs for every decode
step of a model without per-head q/k norms, and a linear it cannot bind as a C call runs
the model's own linear into the plan's buffer."""
from __future__ import annotations

import types

import pytest
import torch

from kvstrata.runner.cpu import f32_gemv
from kvstrata.runner.cpu.packed_linear import PackedLinear
from kvstrata.runner.models import decode_plan

PARAMS = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def _plan_expected(model) -> bool:
    """Whether decode steps take the plan: every model without per-head q/k norms (its
    linears are C calls or the model's own linear into its buffers)."""
    return model.layers[0].q_norm is None


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


def _runs_plan_on_and_off(llm, prompts, monkeypatch) -> dict:
    """KVSTRATA_CPU_DECODE_PLAN "1" and "0" -> (output ids, every forward's logits, whether
    each forward took the plan) of the same greedy requests on the same engine."""
    model = llm.engine.runner.model
    forward, build = model.forward, decode_plan.build
    runs = {}
    for flag in ("1", "0"):
        logits, plans = [], []
        monkeypatch.setenv("KVSTRATA_CPU_DECODE_PLAN", flag)
        monkeypatch.setattr(decode_plan, "build", _record(model, forward, build, logits, plans))
        outs = llm.generate(input_ids=prompts, sampling_params=PARAMS)
        runs[flag] = ([o["output_ids"] for o in outs], logits, plans)
    return runs


@pytest.mark.parametrize("arch,dtype,quant,copies", [
    ("llama", "float32", None, 1), ("llama", "bfloat16", None, 1), ("qwen2", "float32", None, 1),
    ("mistral", "bfloat16", None, 1), ("qwen3", "float32", None, 1),
    ("llama", "float32", "w8a8_int8", 1), ("qwen2", "bfloat16", "w8a8_int8", 1),
    # 24 rows a step: more than the fp32 GEMV takes, so oneDNN's layer runs inside the plan
    ("llama", "float32", None, 3)])
def test_plan_logits_are_bit_identical_to_the_layer_loop(tiny_checkpoints, tiny_prompts,
                                                         monkeypatch, arch, dtype, quant,
                                                         copies):
    from kvstrata import LLM
    tiny_prompts = tiny_prompts * copies
    with LLM(model_path=tiny_checkpoints[arch], skip_tokenizer_init=True, dtype=dtype,
             quantization=quant, max_total_tokens=4096, disable_radix_cache=True) as llm:
        model = llm.engine.runner.model
        runs = _runs_plan_on_and_off(llm, tiny_prompts, monkeypatch)
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


def _model(linear):
    return type("Model", (), {"linear": staticmethod(linear)})()


def test_linears_without_a_c_call_run_the_models_linear_into_the_buffer(monkeypatch):
    """More fp32 rows than the GEMV takes (oneDNN's layout where the fp32 GEMM does not take
    them: KVSTRATA_CPU_F32_GEMV=gemv, or AVX-512), a plain weight (F.linear), an
    fbgemm int8 layer and a scalar ISA pin: the plan's call is the model's own linear, its
    result copied into the plan's buffer (the same values); the GEMV, the bf16 GEMM and
    kvstrata's int8 GEMM are C calls with bound pointers."""
    import torch.nn.functional as F

    from kvstrata.runner.cpu.int8_linear import Int8MatmulLinear
    from kvstrata.runner.cpu.packed_linear import packed_linear
    from kvstrata.runner.quant.w8a8 import W8A8Int8Linear, quantized_linear
    w = torch.randn(64, 32)
    lin = PackedLinear(w, None, gemv=True)
    model = _model(packed_linear)
    top = f32_gemv.max_rows()

    def check(model, layer, x, c_call: bool, silu: bool = False):
        want = layer.linear_silu_mul(x) if silu else model.linear(x, layer, None)
        out = torch.full_like(want, float("nan"))
        fn, args = decode_plan._linear_call(model, layer, None, x, out, 1, 1, silu=silu)
        assert isinstance(fn, types.BuiltinFunctionType) == c_call, fn
        fn(*args)
        assert torch.equal(out, want)
    if lin.gemv is not None and f32_gemv._vector_isa():
        check(model, lin, torch.randn(top, 32), c_call=True)
    # more rows: kvstrata's fp32 GEMM over the same panels where the layer takes it (no
    # AVX-512), else oneDNN's layout through the model's call
    check(model, lin, torch.randn(top + 1, 32), c_call=lin.gemm_f32 and f32_gemv._vector_isa())
    monkeypatch.setenv("KVSTRATA_CPU_F32_GEMV", "gemv")
    gemv_only = PackedLinear(w, None, gemv=True)
    assert not gemv_only.gemm_f32
    check(model, gemv_only, torch.randn(top + 1, 32), c_call=False)
    monkeypatch.delenv("KVSTRATA_CPU_F32_GEMV")
    check(_model(F.linear), w, torch.randn(3, 32), c_call=False)
    int8 = W8A8Int8Linear(w)
    check(_model(quantized_linear), int8, torch.randn(5, 32), c_call=False)
    own8 = Int8MatmulLinear(torch.randn(64, 32), torch.randn(64))
    if own8.own:  # kvstrata's int8 GEMM (AVX512-VNNI, or AVX2 without VNNI): its C call
        for x8 in (torch.randn(3, 32), torch.randn(2, 32).bfloat16()):
            check(_model(quantized_linear), own8, x8, c_call=True)
            check(_model(quantized_linear), own8, x8, c_call=True, silu=True)
    bf16 = PackedLinear(torch.randn(64, 32).bfloat16(), None)
    xb = torch.randn(2, 32).bfloat16()
    if bf16.own:
        check(model, bf16, xb, c_call=True)
        check(model, bf16, xb, c_call=True, silu=True)
    if bf16.own and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        # own_decode: the C call up to 64 rows (fused silu too), oneDNN's layout above
        monkeypatch.setenv("KVSTRATA_CPU_BF16_GEMM", "own_decode")
        split = PackedLinear(torch.randn(64, 32).bfloat16(), None)
        top = split.own_max_rows
        assert split.onednn is not None and top == 64
        assert decode_plan._fused_silu(split, top) and not decode_plan._fused_silu(split, top + 1)
        check(model, split, torch.randn(top, 32).bfloat16(), c_call=True)
        check(model, split, torch.randn(top, 32).bfloat16(), c_call=True, silu=True)
        check(model, split, torch.randn(top + 1, 32).bfloat16(), c_call=False)
        monkeypatch.delenv("KVSTRATA_CPU_BF16_GEMM")
    monkeypatch.setenv("KVSTRATA_CPU_ISA", "scalar")
    check(model, lin, torch.randn(1, 32), c_call=False)


@pytest.mark.parametrize("int8_activations", [False, True])
def test_gguf_layers_kept_packed_are_bound_kernel_calls(int8_activations):
    """A GGUF layer kept packed (runner/quant/gguf_linear.py) is its segments' kernel calls with
    bound pointers: one packed segment a C call, two or more one tuple of them, each writing
    its columns; a float segment or a bias: the model's linear into the buffer. The same
    values as the layer's own forward (batch 1 and 5 rows)."""
    import numpy as np

    from kvstrata.bench.gguf_blocks import weight_rows
    from kvstrata.runner.quant.gguf_linear import GgufLinear, gguf_linear
    from kvstrata.runner.quant.packed_rows import PackedRows

    rng = np.random.default_rng(5)
    q4, q8 = (PackedRows(t, weight_rows(t, n, 64, rng), 64) for t, n in ((2, 24), (8, 12)))
    one = GgufLinear(24, 64, [(0, 24, q4)], int8_activations=int8_activations)
    two = GgufLinear(36, 64, [(0, 24, q4), (24, 36, q8)], int8_activations=int8_activations)
    mixed = GgufLinear(40, 64, [(0, 24, q4), (24, 40, torch.randn(16, 64))],
                       int8_activations=int8_activations)
    biased = GgufLinear(24, 64, [(0, 24, q4)], bias=torch.randn(24),
                        int8_activations=int8_activations)
    model = _model(gguf_linear)
    for layer, kind in ((one, "c"), (two, "tuple"), (mixed, "model"), (biased, "model")):
        for rows in (1, 5):
            x = torch.randn(rows, 64)
            want = layer(x)
            out = torch.full_like(want, float("nan"))
            fn, args = decode_plan._linear_call(model, layer, None, x, out, 1, 3)
            assert isinstance(fn, types.BuiltinFunctionType) == (kind == "c"), fn
            assert (fn is decode_plan._run_calls) == (kind == "tuple")
            fn(*args)
            assert torch.equal(out, want), (kind, rows)


@pytest.fixture(scope="module")
def packed_gguf(tmp_path_factory):
    from helpers.decoder_gguf import write_decoder_gguf

    root = tmp_path_factory.mktemp("plan_gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(root / "cache"))  # config/model_source.py's cache
        path = str(root / "llama.gguf")
        write_decoder_gguf("llama", path)
        yield path


@pytest.mark.parametrize("int8_activations", ["0", "1"])
def test_plan_logits_with_gguf_layers_kept_packed(packed_gguf, tiny_prompts, monkeypatch,
                                                  int8_activations):
    """--quantization gguf (a Q4_K / Q6_K layer, a layer of Q4_0 | F32 | Q8_0 q|k|v
    segments, Q5_K, Q8_0, a Q4_0 tied embedding): every decode step takes the plan, its
    logits bit-identical to the layer loop's."""
    from kvstrata import LLM
    monkeypatch.setenv("KVSTRATA_GGUF_INT8_ACTIVATIONS", int8_activations)
    prompts = [[t % 300 for t in p] for p in tiny_prompts]
    with LLM(model_path=packed_gguf, skip_tokenizer_init=True, quantization="gguf",
             max_total_tokens=1024, disable_radix_cache=True) as llm:
        model = llm.engine.runner.model
        runs = _runs_plan_on_and_off(llm, prompts, monkeypatch)
        plan = next(iter(model._decode_plans.values()))
        assert plan is not None
        # layer 0: every linear a bound kernel call (no copy through the model's linear)
        assert sum(fn.__name__ == "copy_out" for fn, _ in plan.layers[0]) == 0
    (ids_on, logits_on, plans_on), (ids_off, logits_off, _) = runs["1"], runs["0"]
    assert ids_on == ids_off
    assert len(logits_on) == len(logits_off)
    for got, want in zip(logits_on, logits_off):
        assert torch.equal(got, want)
    assert PARAMS["max_new_tokens"] - 1 <= sum(plans_on) < len(plans_on)
