"""The recurrent hybrids' linears on kvstrata's packed layers (runner/models/hybrid_packed.py,
the default on a CPU) and in int8 (`--quantization w8a8_int8`, runner/quant/hybrid_w8a8.py),
on tiny random checkpoints of every family (tests/helpers/hybrid_ckpt.py):

- packed: no weight a block names is left a float tensor (so no path can multiply one with
  F.linear), and the prefill logits equal the unpacked model's (KVSTRATA_CPU_PACKED_LINEAR=0)
  within float rounding -- float32 (oneDNN's layout), and bf16 (kvstrata's bf16 GEMM on an
  AVX512-BF16 CPU) within bf16's. Greedy tokens against transformers run packed in
  test_hybrid_models.py and the engine tests, which load through the same path.
- w8a8_int8: every named weight but the routers is an int8 layer, the weights take under
  half their float32 bytes, and the logits differ from the float model's (the int8 layers
  ran) by a few percent, the top token mostly kept.
"""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from helpers.hybrid_ckpt import (HYBRIDS, build_falcon_h1_checkpoint,
                                 build_nemotron_h_moe_checkpoint, hybrid_checkpoints,
                                 hybrid_runner)
from helpers.runner import forward_logits

ARCHS = (*HYBRIDS, "falcon_h1", "nemotron_h_moe")
PROMPT = [3, 17, 42, 99, 7, 150, 23, 64, 11, 5, 88, 120, 31, 2, 77, 45, 9, 133, 60, 14]
_logits: dict = {}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("tiny_hybrids_quant"))
    out = hybrid_checkpoints(root)
    out["falcon_h1"] = build_falcon_h1_checkpoint(os.path.join(root, "falcon_h1"))
    out["nemotron_h_moe"] = build_nemotron_h_moe_checkpoint(os.path.join(root, "moe"))
    return out


def _run(path: str, dtype: str, monkeypatch, packed: bool = True,
         quantization: str | None = None):
    """(model, prefill logits of PROMPT), the model loaded as the server loads it."""
    key = (path, dtype, packed, quantization)
    if key not in _logits:
        with monkeypatch.context() as m:
            m.setenv("KVSTRATA_CPU_PACKED_LINEAR", "1" if packed else "0")
            runner = hybrid_runner(path, num_pages=256, state_slots=4, dtype=dtype,
                                   quantization=quantization)
        _logits[key] = (runner.model, forward_logits(runner, PROMPT).float())
    return _logits[key]


def _named_weights(model):
    """(block, name, weight) of every weight the hybrid's blocks name, children included."""
    from kvstrata.runner.models.hybrid_packed import weight_blocks

    def of(block):
        for entry in (*block.pinned_weights, *block.pinned_expert_stacks):
            name = entry if isinstance(entry, str) else entry[0]
            if getattr(block, name) is not None:
                yield block, name, getattr(block, name)
        for child in getattr(block, "pinned_children", ()):
            if getattr(block, child) is not None:
                yield from of(getattr(block, child))

    for block in weight_blocks(model):
        yield from of(block)


def _layers(weight):
    return list(weight) if isinstance(weight, nn.ModuleList) else [weight]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_linear_is_packed_and_the_logits_hold(arch, paths, monkeypatch):
    from kvstrata.runner.cpu.packed_linear import PackedLinear

    model, packed = _run(paths[arch], "float32", monkeypatch)
    named = list(_named_weights(model))
    assert named and isinstance(model.lm_head, PackedLinear)
    for block, name, weight in named:
        assert all(isinstance(layer, PackedLinear) for layer in _layers(weight)), \
            f"{type(block).__name__}.{name} is not packed"
    plain_model, plain = _run(paths[arch], "float32", monkeypatch, packed=False)
    assert isinstance(plain_model.lm_head, torch.Tensor)  # the ablation packs nothing
    assert (packed - plain).abs().max().item() < 1e-4 * max(1.0, plain.abs().max().item())


@pytest.mark.parametrize("arch", ["qwen3_5", "nemotron_h", "granite", "nemotron_h_moe"])
def test_bf16_packed_logits_match_the_unpacked_bf16_model(arch, paths, monkeypatch):
    """bf16 runs kvstrata's bf16 GEMM (or oneDNN's bf16 layout): both sum in float32 and round
    to bf16 once, as F.linear does, in another order; measured against float32 the packed
    model is no further off than the unpacked one (up to bf16 rounding noise)."""
    _, reference = _run(paths[arch], "float32", monkeypatch)
    _, packed = _run(paths[arch], "bfloat16", monkeypatch)
    _, plain = _run(paths[arch], "bfloat16", monkeypatch, packed=False)
    scale = reference.abs().max().item()
    packed_err = (packed - reference).abs().max().item()
    plain_err = (plain - reference).abs().max().item()
    assert packed_err < 2 * plain_err + 0.01 * scale, (packed_err, plain_err, scale)


@pytest.mark.parametrize("arch", ARCHS)
def test_w8a8_int8_quantizes_every_projection(arch, paths, monkeypatch):
    from kvstrata.runner.cpu.int8_linear import Int8MatmulLinear
    from kvstrata.runner.quant.hybrid_w8a8 import FLOAT_WEIGHTS
    from kvstrata.runner.quant.w8a8 import W8A8Int8Linear, weight_bytes

    model, quantized = _run(paths[arch], "float32", monkeypatch, quantization="w8a8_int8")
    int8 = (Int8MatmulLinear, W8A8Int8Linear)
    assert isinstance(model.lm_head, int8)
    for block, name, weight in _named_weights(model):
        if name in FLOAT_WEIGHTS:
            assert isinstance(weight, torch.Tensor)
        else:
            assert all(isinstance(layer, int8) for layer in _layers(weight)), \
                f"{type(block).__name__}.{name} is not int8"
    _, float_logits = _run(paths[arch], "float32", monkeypatch)
    plain_model, _ = _run(paths[arch], "float32", monkeypatch, packed=False)
    # int8 weights and scales: under half of the float32 model's bytes (the embedding
    # lookup and the norms stay float)
    assert weight_bytes(model) < 0.5 * weight_bytes(plain_model)
    diff = (quantized - float_logits).abs()
    assert diff.max().item() > 1e-4  # the int8 layers ran (a bypass would give float's bits)
    # closely: these random checkpoints are drawn large (hybrid_ckpt.py), which amplifies
    # int8 rounding, and an MoE router (kept float) may send a token to another expert when
    # its input moved (measured: mean error 3-13% of the mean |logit|, the top token kept at
    # 75-100% of the positions)
    assert diff.mean().item() < 0.2 * float_logits.abs().mean().item()
    agree = (quantized.argmax(-1) == float_logits.argmax(-1)).float().mean().item()
    assert agree >= 0.7, agree


def test_w8a8_int8_serves_through_the_engine(paths):
    """The flag through resolution (rules/recurrent.py lets it by) and the engine: chunked
    prompts, the pools and state slots whole after the drain; the int8 model's greedy tokens
    against the float model's agree on most steps."""
    from helpers.hybrid_ckpt import assert_drained_whole
    from kvstrata import LLM

    prompts = [PROMPT, PROMPT[:12] + [4, 8, 15]]
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    runs = {}
    for quantization in (None, "w8a8_int8"):
        with LLM(paths["nemotron_h"], skip_tokenizer_init=True, dtype="float32", page_size=1,
                 chunked_prefill_size=8, max_total_tokens=1024, max_mamba_cache_size=24,
                 quantization=quantization) as llm:
            info = llm.server_info()["quantization_info"]
            assert info["quantization"] == quantization
            runs[quantization] = [o["output_ids"] for o in llm.generate(
                input_ids=prompts, sampling_params=greedy)]
            assert_drained_whole(llm)
    pairs = [(a, b) for x, y in zip(runs[None], runs["w8a8_int8"]) for a, b in zip(x, y)]
    assert sum(a == b for a, b in pairs) >= 0.5 * len(pairs), runs
