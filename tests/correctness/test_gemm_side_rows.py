"""Rows a GEMM call prefetches while it multiplies (runner/cpu/csrc/gemm_panels.h side_rows, set by
_bf16_ops / _int8_ops.prefetch_rows_next): the next call on the same thread takes them,
whatever its body, and its output is the same bits as without them; the decode plan asks the
gate|up GEMM of layer i (bf16 or w8a8) for layer i + 1's K and V rows of the step's
requests."""
from __future__ import annotations

import threading

import pytest
import torch

from kvstrata.runner.cpu import _bf16_ops, _int8_ops, packed_linear
from kvstrata.runner.cpu.int8_linear import Int8MatmulLinear
from kvstrata.runner.cpu.isa import isa_cap
from kvstrata.runner.cpu.packed_linear import PackedLinear

OWN = _bf16_ops.kernel_isa(2) > 0


def _side(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> tuple:
    row_bytes = k[0].numel() * k.element_size()
    return k.data_ptr(), v.data_ptr(), row_bytes, slots.data_ptr(), slots.numel()


@pytest.mark.skipif(not OWN, reason="kvstrata's bf16 GEMM needs AVX512-BF16 or AVX2 + FMA")
@pytest.mark.parametrize("cap", [2, 1])
@pytest.mark.parametrize("m,k,n,silu", [(32, 576, 3072, True), (1, 576, 960, False),
                                        (5, 1536, 576, False), (33, 64, 96, True)])
def test_side_rows_change_nothing_and_are_taken_once(m, k, n, silu, cap):
    """Outputs equal bit for bit with and without a side job (AVX512-BF16 and AVX2 bodies,
    1-33 rows, fused silu), and one call takes the job: none is pending after it."""
    torch.manual_seed(m * k + n)
    layer = PackedLinear((torch.randn(n, k) / k ** 0.5).bfloat16(), None)
    if not layer.own:
        pytest.skip("oneDNN takes this layer here")
    x = torch.randn(m, k).bfloat16()
    pool_k, pool_v = torch.randn(2, 700, 3, 64).bfloat16()
    slots = torch.randperm(700)[:600].contiguous()

    def run() -> torch.Tensor:
        out = torch.empty(m, n // 2 if silu else n, dtype=torch.bfloat16)
        fn, args = layer.own_call(x, out, silu, threads=3, cap=cap)
        fn(*args)
        return out
    want = run()
    _bf16_ops.prefetch_rows_next(*_side(pool_k, pool_v, slots))
    assert _bf16_ops.rows_pending() == 600
    assert torch.equal(run(), want)
    assert _bf16_ops.rows_pending() == 0
    assert torch.equal(run(), want)


@pytest.mark.skipif(_int8_ops.kernel_isa(2) < 1, reason="the int8 GEMM's vector tiles")
@pytest.mark.parametrize("cap", [2, 1])
@pytest.mark.parametrize("m,silu", [(32, True), (3, False)])
def test_int8_side_rows_change_nothing_and_are_taken_once(m, silu, cap):
    """The int8 GEMM (VNNI and AVX2 tiles) takes a job the same way."""
    torch.manual_seed(m)
    layer = Int8MatmulLinear(torch.randn(3072, 576), torch.randn(3072))
    x = torch.randn(m, 576).bfloat16()
    pool_k, pool_v = torch.randn(2, 300, 3, 64).bfloat16()
    slots = torch.randperm(300)[:256].contiguous()

    def run() -> torch.Tensor:
        out = torch.empty(m, 1536 if silu else 3072, dtype=torch.bfloat16)
        fn, args = layer.own_call(x, m, 576, out, silu, threads=2, cap=cap)
        fn(*args)
        return out
    want = run()
    _int8_ops.prefetch_rows_next(*_side(pool_k, pool_v, slots))
    assert _int8_ops.rows_pending() == 256 and _bf16_ops.rows_pending() == 0
    assert torch.equal(run(), want)
    assert _int8_ops.rows_pending() == 0


def test_side_rows_belong_to_the_thread_that_set_them():
    pool = torch.zeros(4, 2, 8)
    slots = torch.arange(4)
    seen = []
    worker = threading.Thread(target=lambda: (_bf16_ops.prefetch_rows_next(
        *_side(pool, pool, slots)), seen.append(_bf16_ops.rows_pending())))
    worker.start()
    worker.join()
    assert seen == [4] and _bf16_ops.rows_pending() == 0


def test_side_rows_refuse_bad_arguments():
    with pytest.raises(ValueError, match="bad rows"):
        _bf16_ops.prefetch_rows_next(1, 1, 0, 1, 4)
    with pytest.raises(ValueError, match="bad rows"):
        _bf16_ops.prefetch_rows_next(1, 1, 64, 0, 4)  # slots without an address
    _bf16_ops.prefetch_rows_next(0, 0, 64, 0, 0)  # nothing to fetch: fine
    assert _bf16_ops.rows_pending() == 0
    # a call that fails still takes the job (its slot list may be freed before the next)
    slots = torch.arange(8)
    for gemm, bad in ((_bf16_ops, (0, 0, 0, 0, 0, 16, 0, 0, 0, 0, 1, 2)),
                      (_int8_ops, (0, 0, 0, 0, 1, 0, 16, 0, 0, 0, 0, 0, 1, 2))):
        gemm.prefetch_rows_next(0, 0, 64, slots.data_ptr(), 8)
        assert gemm.rows_pending() == 8
        with pytest.raises(ValueError, match="bad shape"):
            gemm.linear(*bad)
        assert gemm.rows_pending() == 0


@pytest.fixture(scope="module")
def tiny_llama_96(tmp_path_factory) -> str:
    """A tiny llama whose gate|up width (2 x 96) the int8 GEMM's fused silu pairs (the shared
    tiny checkpoints' 2 x 88 does not: their w8a8 gate|up runs the model's own call)."""
    import transformers as tf
    torch.manual_seed(96)
    config = tf.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
                            eos_token_id=2, pad_token_id=0)
    path = str(tmp_path_factory.mktemp("llama96"))
    tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


@pytest.mark.parametrize("quant,gemm", [(None, _bf16_ops), ("w8a8_int8", _int8_ops)])
def test_decode_plan_prefetches_the_next_layers_kv(tiny_llama_96, tiny_prompts, monkeypatch,
                                                   quant, gemm):
    """bf16 decode plans (bf16 and w8a8 layers): layer i's gate|up GEMM call is preceded by
    layer i + 1's K / V rows over the plan's key slots (the count rebound every forward),
    the last layer's by none; KVSTRATA_CPU_DECODE_KV_PREFETCH=0 makes plans without them,
    same tokens."""
    from kvstrata import LLM
    from kvstrata.runner.models import decode_plan
    if gemm.kernel_isa(min(isa_cap(), 2)) != 2 or (gemm is _bf16_ops
                                                   and gemm.kernel_isa(isa_cap()) != 2):
        pytest.skip("the plan asks for side rows on the AVX512-BF16 / VNNI bodies only")
    params = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    monkeypatch.setattr(packed_linear, "amx_bf16_ready", lambda: False)
    with LLM(model_path=tiny_llama_96, skip_tokenizer_init=True, dtype="bfloat16",
             quantization=quant, max_total_tokens=4096, disable_radix_cache=True) as llm:
        model = llm.engine.runner.model
        pool = model.attn_backend.kv_pool
        outputs = {}
        for flag in ("1", "0"):
            monkeypatch.setenv("KVSTRATA_CPU_DECODE_KV_PREFETCH", flag)
            model.__dict__.pop("_decode_plans", None)
            outputs[flag] = [o["output_ids"] for o in
                             llm.generate(input_ids=tiny_prompts, sampling_params=params)]
            # the last forward's plan (a decode step; plans are kept most recently used last:
            # with deterministic inference on, the default on some CPUs, a prompt-sized plan
            # is made too)
            plan = next(p for p in reversed(model.__dict__["_decode_plans"].values()) if p)
            layers = len(model.layers)
            if flag == "0":
                assert plan.side_args == []
                continue
            assert len(plan.side_args) == layers - 1
            # the last forward's key slots: the prompts plus all but the last new token
            n = sum(len(p) + params["max_new_tokens"] - 1 for p in tiny_prompts)
            for i, (side, calls) in enumerate(zip(plan.side_args, plan.layers)):
                assert side == [pool.k(i + 1).data_ptr(), pool.v(i + 1).data_ptr(),
                                pool.k(0)[0].numel() * pool.k(0).element_size(),
                                plan.slots.data_ptr(), n]
                fns = [fn for fn, _ in calls]
                at = fns.index(gemm.prefetch_rows_next)
                assert fns[at + 1] is gemm.linear and calls[at][1] is side
            assert gemm.prefetch_rows_next not in [fn for fn, _ in plan.layers[-1]]
        assert outputs["1"] == outputs["0"]
    assert decode_plan.enabled()
