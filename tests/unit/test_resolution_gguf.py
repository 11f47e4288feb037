"""Step 0-: how a GGUF file's weights load (config/rules/gguf_weights.py). `--quantization
gguf` and `--load-format gguf` keep them in their quantized blocks, `--load-format
gguf_dequantize` loads them as float, `--load-format auto` follows KEPT_QUANTIZED_BY_DEFAULT;
what cannot be honoured is refused by name. (No file is read: a path ending in .gguf that
does not exist counts as a GGUF file, a directory path as a safetensors checkpoint.)"""
from __future__ import annotations

import pytest

from kvstrata.config import ModelInfo, ServerArgs, resolve
from kvstrata.config.rules import gguf_weights
from kvstrata.platform import simulated

GGUF = "/nonexistent/model-Q4_K_M.gguf"


def run(**kwargs):
    resolved, res = resolve(ServerArgs(**kwargs), simulated("cpu"), ModelInfo(), env={})
    return resolved, {r.field: r for r in res}


@pytest.mark.parametrize("kept_by_default", [False, True])
def test_load_format_auto_follows_the_default(kept_by_default, monkeypatch):
    monkeypatch.setattr(gguf_weights, "KEPT_QUANTIZED_BY_DEFAULT", kept_by_default)
    resolved, res = run(model_path=GGUF)
    if kept_by_default:
        assert resolved.quantization == "gguf"
        assert res["quantization"].rule == gguf_weights.RULE
        assert resolved.dtype == "float32"  # the packed matmul's output (platform defaults)
    else:
        assert resolved.quantization is None and "quantization" not in res
    # not a GGUF file: nothing to keep quantized, whatever the default
    resolved, res = run(model_path="/nonexistent/llama-dir")
    assert resolved.quantization is None and "quantization" not in res


def test_the_spellings_that_keep_or_dequantize():
    resolved, res = run(model_path=GGUF, load_format="gguf")  # SGLang's / vLLM's spelling
    assert resolved.quantization == "gguf" and res["quantization"].rule == gguf_weights.RULE
    assert "--load-format gguf" in res["quantization"].reason
    resolved, res = run(model_path=GGUF, quantization="gguf")
    assert resolved.quantization == "gguf" and resolved.dtype == "float32"
    resolved, _ = run(model_path=GGUF, load_format="gguf_dequantize")
    assert resolved.quantization is None
    # w8a8_int8 re-quantizes the dequantized weights: not turned into gguf
    resolved, _ = run(model_path=GGUF, load_format="gguf", quantization="w8a8_int8")
    assert resolved.quantization == "w8a8_int8"


@pytest.mark.parametrize("kwargs,message", [
    (dict(model_path="/nonexistent/llama-dir", quantization="gguf"),
     "--quantization gguf: --model-path '/nonexistent/llama-dir' is not a GGUF file"),
    (dict(model_path="/nonexistent/llama-dir", load_format="gguf_dequantize"),
     "--load-format gguf_dequantize: --model-path"),
    (dict(model_path=GGUF, quantization="gguf", load_format="gguf_dequantize"),
     "contradict each other"),
    (dict(model_path=GGUF, quantization="gguf", tp_size=2),
     "--tp-size 2 with GGUF weights kept quantized (--quantization gguf) is not implemented"),
    (dict(model_path=GGUF, load_format="gguf", tp_size=2),
     "--tp-size 2 with GGUF weights kept quantized"),
])
def test_refused_by_name(kwargs, message):
    with pytest.raises(ValueError) as e:
        run(**kwargs)
    assert message in str(e.value)


@pytest.mark.parametrize("spelling", [dict(quantization="gguf"), dict(load_format="gguf")])
def test_weights_kept_quantized_take_deterministic_inference(spelling):
    """The GGUF kernels are batch-invariant, the float segments go on the fixed GEMM
    (runner/quant/gguf_pinned.py): the flag is taken and names the packed kernels."""
    from kvstrata.config.rules import deterministic

    resolved, res = run(model_path=GGUF, enable_deterministic_inference=True, **spelling)
    assert resolved.quantization == "gguf"
    assert resolved.deterministic_linear_kernel == deterministic.PACKED_LINEAR_KERNEL
    assert "gguf_matmul.py" in resolved.deterministic_linear_kernel


def test_weights_dequantized_at_load_serve_tp_and_deterministic():
    resolved, _ = run(model_path=GGUF, load_format="gguf_dequantize", tp_size=2)
    assert resolved.tp_size == 2 and resolved.quantization is None
    resolved, _ = run(model_path=GGUF, load_format="gguf_dequantize",
                      enable_deterministic_inference=True)
    assert resolved.deterministic_linear_kernel is not None
