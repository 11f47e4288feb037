"""oneDNN-prepacked float32 / bf16 linear layers (runner/cpu/packed_linear.py): equal to F.linear
up to float rounding, on by default for the float32 (and, where oneDNN has bf16 kernels, bf16)
llama-family decoder on CPU, off with KVSTRATA_CPU_PACKED_LINEAR=0, and the same greedy tokens
either way."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvstrata.runner.cpu import _bf16_ops, f32_gemv
from kvstrata.runner.cpu.packed_linear import PackedLinear, packed_linear


@pytest.mark.parametrize("rows", [1, 5, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(97, 61, generator=g)
    b = torch.randn(97, generator=g) if bias else None
    x = torch.randn(rows, 61, generator=g)
    layer = PackedLinear(w, b)
    torch.testing.assert_close(packed_linear(x, layer), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x[:, :]), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert layer.nbytes == w.numel() * 4 + (97 * 4 if bias else 0)


@pytest.mark.parametrize("rows", [1, 32, 300])
def test_packed_bf16_equals_f_linear(rows):
    """Measured bit-identical on an AMX box; bf16 rounding of the output is the bound."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bf16 kernels on this CPU (the runner keeps F.linear)")
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(97, 64, generator=g).bfloat16()
    b = torch.randn(97, generator=g).bfloat16()
    x = torch.randn(rows, 64, generator=g).bfloat16()
    layer = PackedLinear(w, b)
    out = packed_linear(x, layer)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1.6e-2, atol=1e-2)
    assert layer.nbytes == (w.numel() + 97) * 2


def test_runner_packs_bf16_where_a_bf16_gemm_runs(tiny_checkpoints):
    """bf16 layers are packed where oneDNN has bf16 kernels or kvstrata's GEMM runs (its
    AVX2 body on an AVX2-only CPU); the output head's kernel is reported."""
    from kvstrata import LLM
    from kvstrata.runner.cpu import _bf16_ops
    from kvstrata.runner.cpu import packed_linear as module
    onednn = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    # the default kernels (deterministic inference, on by default at bf16 on an AVX2 CPU,
    # pins others: test_batch_invariance.py)
    with LLM(model_path=tiny_checkpoints["llama"], skip_tokenizer_init=True,
             dtype="bfloat16", max_total_tokens=1024,
             disable_deterministic_inference=True) as llm:
        model = llm.engine.runner.model
        packed = model.linear is module.packed_linear
        assert packed == (onednn or _bf16_ops.kernel_isa(2) > 0)
        if not packed:
            want = None
        elif module.own_bf16_fits(model.embed):
            want = {3: module.OWN_BF16_AMX_KERNEL, 2: module.OWN_BF16_KERNEL}.get(
                _bf16_ops.kernel_isa(3), module.OWN_BF16_AVX2_KERNEL)
            if module.split_layouts() and onednn:  # AMX: oneDNN's tiles above decode rows
                want += (f" up to {module.OWN_DECODE_MAX_ROWS} rows, above them "
                         f"{module.KERNEL}")
        else:
            want = module.KERNEL if onednn else module.PLAIN_KERNEL
        assert llm.server_info()["quantization_info"].get("kernel") == want


def test_runner_packs_by_default_and_env_turns_it_off(tiny_checkpoints, tiny_prompts,
                                                      monkeypatch):
    from kvstrata import LLM
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    outs, kinds, small, decode = {}, {}, {}, {}
    # "1": packed, with the fp32 GEMV's copies where the CPU runs it (decode at 1-8 rows);
    # "nogemv": packed, oneDNN for every row count; "0": F.linear.
    for flag, gemv in (("1", "auto"), ("nogemv", "off"), ("0", "auto")):
        monkeypatch.setenv("KVSTRATA_CPU_PACKED_LINEAR", "0" if flag == "0" else "1")
        monkeypatch.setenv("KVSTRATA_CPU_F32_GEMV", gemv)
        with LLM(model_path=tiny_checkpoints["qwen2"], skip_tokenizer_init=True,
                 dtype="float32", max_total_tokens=1024) as llm:
            model = llm.engine.runner.model
            kinds[flag] = (type(model.layers[0].qkv_weight).__name__, model.linear)
            info = llm.server_info()["quantization_info"]
            small[flag] = info.get("small_batch_kernel")
            decode[flag] = (info.get("decode_batch_kernel"), f32_gemv.gemm_above())
            outs[flag] = llm.generate(input_ids=tiny_prompts, sampling_params=params)
    assert kinds["1"] == kinds["nogemv"] == ("PackedLinear", packed_linear)  # q/k/v biases too
    assert kinds["0"] == ("Parameter", F.linear)
    assert small["1"] == (f32_gemv.KERNEL if f32_gemv._vector_isa() else None)
    assert small["nogemv"] is None
    # and the fp32 GEMM above the GEMV's rows where the rule takes it (no AVX-512)
    gemm_kernel, rule = decode["1"]
    assert gemm_kernel == (f32_gemv.GEMM_KERNEL if small["1"] and rule else None)
    assert decode["nogemv"][0] is None
    for on, nogemv, off in zip(outs["1"], outs["nogemv"], outs["0"]):
        assert nogemv["output_ids"] == off["output_ids"]
        assert on["output_ids"] == off["output_ids"]
        got = [lp for lp, _ in on["meta_info"]["output_token_logprobs"]]
        want = [lp for lp, _ in off["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4


@pytest.mark.skipif(not _bf16_ops.kernel_isa(2), reason="needs AVX512-BF16 or AVX2 + FMA")
def test_split_layouts_serve_prefill_on_onednn_and_decode_on_ours(tiny_checkpoints,
                                                                 tiny_prompts, monkeypatch):
    """The AMX split (KVSTRATA_CPU_BF16_GEMM=own_decode here; auto on an AMX-BF16 CPU) in a
    whole engine: a batched prefill's rows (190 > 64) go to oneDNN's layout, decode rows to
    kvstrata's GEMM; greedy tokens and logprobs as with kvstrata's GEMM alone, up to the
    bf16 rounding of another accumulation order. Where oneDNN has no bf16 kernels (AVX2) its
    two ops are stood in for by F.linear over the plain weight."""
    from kvstrata import LLM
    from kvstrata.runner.cpu import packed_linear as module
    onednn_rows = []
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        monkeypatch.setattr(module, "_onednn_bf16", lambda: True)
        monkeypatch.setattr(module, "_onednn_pack", lambda w: w.detach().clone())
        inner = F.linear
    else:
        inner = module._onednn_linear

    def spy(x, packed, bias):
        onednn_rows.append((x.numel() // x.shape[-1], id(packed)))  # (oneDNN's: opaque)
        return inner(x, packed, bias)
    monkeypatch.setattr(module, "_onednn_linear", spy)
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    outs = {}
    for gemm in ("own_decode", "own"):
        monkeypatch.setenv("KVSTRATA_CPU_BF16_GEMM", gemm)
        with LLM(model_path=tiny_checkpoints["llama"], skip_tokenizer_init=True,
                 dtype="bfloat16", max_total_tokens=1024,
                 disable_deterministic_inference=True) as llm:  # the default layouts
            model = llm.engine.runner.model
            split = {id(lin.onednn) for layer in model.layers
                     for lin in (layer.qkv_weight, layer.o_weight, layer.gate_up_weight,
                                 layer.down_weight) if lin.onednn is not None}
            assert bool(split) == (gemm == "own_decode")  # (the tiny head: out % 16 != 0)
            onednn_rows.clear()
            outs[gemm] = llm.generate(input_ids=tiny_prompts, sampling_params=params)
            llm.check_integrity()
        rows = [m for m, ptr in onednn_rows if ptr in split]
        # own_decode: each layer's 4 linears see the prefill's 190 rows on oneDNN's layout,
        # never a decode batch's 8
        assert rows == ([190] * 4 * len(model.layers) if gemm == "own_decode" else []), rows
    for split, own in zip(outs["own_decode"], outs["own"]):
        got = [lp for lp, _ in split["meta_info"]["output_token_logprobs"]]
        want = [lp for lp, _ in own["meta_info"]["output_token_logprobs"]]
        assert split["output_ids"] == own["output_ids"]
        assert max(abs(a - b) for a, b in zip(got, want)) < 0.05
