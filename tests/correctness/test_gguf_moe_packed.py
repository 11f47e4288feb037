"""MoE GGUF files kept packed (--quantization gguf): Qwen3-MoE, Qwen2-MoE (gated shared
expert), Mixtral (q/k rows permuted) and GLM-4.5 (sigmoid router with a correction bias, a
dense first layer, shared experts), each a tiny random model from transformers' own config
class written as llama.cpp's converter writes its arch (tests/helpers/family_gguf.py), 8
experts top-2, hidden 256 and experts 256 wide so that every packed type fits: Q4_0, Q4_1,
Q8_0, Q4_K, Q5_K and Q6_K across expert stacks, attention, the routers of two files, the
shared experts and the dense layer (TYPES below; K-quants as random blocks: gguf has no
K-quantizer).

- Loaded kept packed, every quantized matrix is a packed layer: attention, each expert's
  gate|up and down (one GgufLinear per expert), the router where the file quantized it, the
  shared experts; every expert's product equals the dequantized matrix's; the model's
  weight bytes are the file's (no float copy anywhere); the served model reports every
  quantized type of its file as packed (none fell back to dequantization).
- One forward of one prompt (batch 1) and of three prompts together (a batch whose tokens
  reach every expert): logits close to the same file dequantized at load and to
  transformers on the file's values (float32).
- Served (the engine, four requests decoded together): greedy tokens equal transformers'.
- --enable-deterministic-inference: the MoE block gives each row the same bits whatever the
  rows beside it, and each request equals its cold run alone under chunked, mixed batches.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from helpers.compare import assert_tokens_match
from helpers.family_gguf import EXPERTS, VOCAB, write_family_gguf
from helpers.gemma_ckpt import hf_greedy
from helpers.runner import make_runner
from tests.correctness.test_deterministic_inference import (cold_runs, drive, make_llm, params,
                                                            prompts_with_prefix)

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe")
DIMS = dict(hidden=256, expert_width=256)
# Per family, over family_gguf.TYPES ("<layer>.<key>": that layer's). o_proj of qwen3_moe /
# glm4_moe reads 64 values (heads x head_dim 16): no whole K-quant super-block there.
TYPES = {
    "qwen3_moe": {  # a Q4_K_M file's mix in layer 0; layer 1 other types and a Q8_0 router
        "q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_1",
        "experts.gate": "Q4_K", "experts.up": "Q4_K", "experts.down": "Q6_K",
        "1.experts.gate": "Q5_K", "1.experts.up": "Q4_0", "1.experts.down": "Q8_0",
        "1.gate": "Q8_0", "embed_tokens": "Q4_K", "lm_head": "Q6_K"},
    "qwen2_moe": {  # K-quant shared expert, Q4_1 / F32 / Q4_0 experts, float router
        "q_proj": "Q8_0", "k_proj": "Q4_0", "v_proj": "Q8_0", "o_proj": "Q5_K",
        "gate_proj": "Q4_K", "up_proj": "Q5_K", "down_proj": "Q6_K",
        "experts.gate": "Q4_1", "experts.up": "F32", "experts.down": "Q4_0"},
    "mixtral": {  # a quantized router in both layers
        "q_proj": "Q4_0", "k_proj": "Q4_0", "v_proj": "Q8_0", "o_proj": "Q5_K",
        "experts.gate": "Q8_0", "experts.up": "Q5_K", "experts.down": "Q4_K", "gate": "Q4_0"},
    "glm4_moe": {  # dense layer 0 in K-quants, layer 1's shared expert in Q8_0
        "q_proj": "Q4_K", "k_proj": "Q8_0", "v_proj": "Q8_0", "o_proj": "Q4_0",
        "gate_proj": "Q4_K", "up_proj": "Q4_K", "down_proj": "Q6_K",
        "1.gate_proj": "Q8_0", "1.up_proj": "Q8_0", "1.down_proj": "Q8_0",
        "experts.gate": "Q5_K", "experts.up": "Q6_K", "experts.down": "Q4_1"},
}
# per MoE layer: the segments of an expert's gate|up (1: gate and up of one type, joined;
# Qwen2-MoE's up rows a float segment: its file stores ffn_up_exps in F32)
GATE_UP_PARTS = {"qwen3_moe": (1, 2), "qwen2_moe": (2, 2), "mixtral": (2, 2), "glm4_moe": (2,)}
# packed layers multiply gguf's dequantized values in float32 (runner/cpu/gguf_matmul.py
# `matmul`): the float model's logits up to summation order (test_gguf_packed.py's bound)
LOGITS_ATOL = 5e-2
NEW_TOKENS = 6
RNG = random.Random(5)
PROMPTS = [[RNG.randrange(4, VOCAB) for _ in range(n)] for n in (7, 30, 45, 5)]
KW = dict(skip_tokenizer_init=True, dtype="float32", page_size=16, max_total_tokens=512)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """family -> (GGUF path, transformers' float32 model on the file's values)."""
    root = tmp_path_factory.mktemp("gguf_moe_packed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(root / "cache"))  # config/model_source.py's cache
        yield {family: (str(root / f"{family}.gguf"),
                        write_family_gguf(family, str(root / f"{family}.gguf"),
                                          types=TYPES[family], **DIMS))
               for family in FAMILIES}


def _logits(runner, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Every prompt's logits from one forward of all of them together (prompt i in
    req_to_token row i + 1, its KV in slots of its own pages: no request is live)."""
    from kvstrata.runner.forward_batch import ForwardBatch

    table, page = runner.model.attn_backend.req_to_token, KW["page_size"]
    slots, at = [], page  # page 0: the padding sink
    for row, prompt in enumerate(prompts, start=1):
        table.write(row, 0, list(range(at, at + len(prompt))))
        slots.extend(range(at, at + len(prompt)))
        at += -(-len(prompt) // page) * page
    fb = ForwardBatch.build(prompts, list(range(1, len(prompts) + 1)), [0] * len(prompts),
                            runner.device, out_slots=torch.tensor(slots))
    return list(runner.model(fb).split([len(p) for p in prompts]))


def _assert_packed(model, family: str) -> None:
    from kvstrata.runner.quant.gguf_linear import GgufLinear

    for i, layer in enumerate(model.layers):
        assert type(layer.qkv_weight) is GgufLinear and type(layer.o_weight) is GgufLinear
        moe = layer.moe
        if moe is None:  # GLM-4.5's dense first layer
            assert type(layer.gate_up_weight) is GgufLinear, family
            continue
        for stack in (moe.gate_up, moe.down):  # one packed layer per expert
            assert len(stack) == EXPERTS and all(type(e) is GgufLinear for e in stack)
        # gate and up of one type: one packed matrix per expert, else two segments
        assert len(moe.gate_up[0].parts) == GATE_UP_PARTS[family][i - (family == "glm4_moe")]
        router_packed = family == "mixtral" or (family == "qwen3_moe" and i == 1)
        assert (type(moe.router) is GgufLinear) == router_packed, (family, i)
        if moe.shared is not None:
            assert type(moe.shared.gate_up) is GgufLinear, family


def _tensor_bytes(path: str, layers: int) -> int:
    """Bytes of the file's tensors outside blocks past `layers` (a NextN block)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors
               if not (t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers))


def _quantized_types(path: str) -> set[str]:
    """The GGML types of the file's quantized tensors (F32 ones aside)."""
    import gguf

    return {t.tensor_type.name for t in gguf.GGUFReader(path).tensors
            if t.tensor_type != gguf.GGMLQuantizationType.F32}


def test_the_files_hold_every_packed_type(files):
    """Between them the four files put each type the packed kernels serve in an expert stack
    (and elsewhere: attention, routers, shared experts, the dense layer), and a float one."""
    import gguf

    stacks = {t.tensor_type.name for path, _ in files.values()
              for t in gguf.GGUFReader(path).tensors if "_exps." in t.name}
    assert stacks == {"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F32"}


def _assert_experts_equal(packed, floats) -> None:
    """Every expert's packed gate|up and down (and a packed router) multiply as the same
    file's dequantized matrices do (packed for serving in their float layers, as a dequantized
    model's experts are: fixed_experts.pack_moe_layers), whichever experts a batch reaches."""
    import torch.nn.functional as F

    x = torch.randn(5, DIMS["hidden"], generator=torch.Generator().manual_seed(1))
    for ours, theirs in zip(packed.layers, floats.layers):
        if ours.moe is None:
            continue
        pairs = [(ours.moe.router, theirs.moe.router, x)]
        for e in range(EXPERTS):
            pairs += [(ours.moe.gate_up[e], theirs.moe.gate_up[e], x),
                      (ours.moe.down[e], theirs.moe.down[e], x[:, :DIMS["expert_width"]])]
        for weight, matrix, inputs in pairs:
            want = (matrix(inputs) if isinstance(matrix, torch.nn.Module)
                    else F.linear(inputs, matrix.float()))
            got = weight(inputs) if isinstance(weight, torch.nn.Module) else F.linear(
                inputs, weight)
            torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_logits_close_to_dequantized_and_transformers(family, files, monkeypatch):
    from kvstrata.runner.quant.gguf_linear import weight_bytes

    path, hf = files[family]
    monkeypatch.delenv("KVSTRATA_GGUF_INT8_ACTIVATIONS", raising=False)
    packed = make_runner(path, quantization="gguf", **KW)
    model = packed.model
    _assert_packed(model, family)
    info = model.gguf_info
    # the bytes of the file's tensors the model reads (GLM-4.5's NextN block is not), no
    # float copy beside them; and about the file's size
    held, file_bytes = weight_bytes(model), os.path.getsize(path)
    assert 0.995 * _tensor_bytes(path, 2) <= held <= 1.005 * _tensor_bytes(path, 2), held
    assert held >= (0.75 if family == "glm4_moe" else 0.97) * file_bytes, (held, file_bytes)
    assert info["weight_bytes_packed"] >= 0.95 * held
    # the batch's tokens reach many experts in every MoE layer
    routed: dict[int, set[int]] = {}
    for i, layer in enumerate(model.layers):
        if layer.moe is not None:
            route = layer.moe.route

            def recording(x, i=i, route=route):
                ids, weights = route(x)
                routed.setdefault(i, set()).update(ids.flatten().tolist())
                return ids, weights
            monkeypatch.setattr(layer.moe, "route", recording)
    alone = _logits(packed, PROMPTS[:1])
    together = _logits(packed, PROMPTS[:3])
    assert routed and all(len(ids) >= EXPERTS // 2 for ids in routed.values()), routed
    floats = make_runner(path, load_format="gguf_dequantize", **KW)
    assert not hasattr(floats.model, "gguf_info")
    _assert_experts_equal(model, floats.model)
    want_alone = _logits(floats, PROMPTS[:1])
    want_together = _logits(floats, PROMPTS[:3])
    torch.testing.assert_close(alone[0], want_alone[0], atol=LOGITS_ATOL, rtol=0)
    for ours, theirs, prompt in zip(together, want_together, PROMPTS):
        torch.testing.assert_close(ours, theirs, atol=LOGITS_ATOL, rtol=0)
        with torch.no_grad():
            reference = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours, reference, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_served_packed_greedy_equals_transformers(family, files):
    from kvstrata import LLM

    path, hf = files[family]
    refs = hf_greedy(hf, PROMPTS, NEW_TOKENS)
    greedy = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "temperature": 0}
    with LLM(model_path=path, quantization="gguf", chunked_prefill_size=16, **KW) as llm:
        info = llm.server_info()["quantization_info"]
        outs = llm.generate(input_ids=PROMPTS, sampling_params=greedy)
        llm.engine.check_integrity()
    assert info["quantization"] == "gguf" and info["packed_layers"] > 2 * EXPERTS  # an expert: 2
    assert info["packed_types"] == sorted(_quantized_types(path))  # none dequantized at load
    for i, (out, (tokens, logits)) in enumerate(zip(outs, refs)):
        assert_tokens_match(out["output_ids"], tokens, logits, tie_tol=LOGITS_ATOL,
                            label=f"{family} packed GGUF prompt {i}")


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_deterministic_inference_pins_the_moe_blocks(family, files):
    """Qwen2-MoE: a float router, shared-expert gate and experts' up rows (fixed GEMM),
    packed experts' gate / down and shared expert; Mixtral: its routers packed, nothing
    float left in its blocks."""
    path, _ = files[family]
    llm = make_llm(path, quantization="gguf", dtype="float32", chunked_prefill_size=7,
                   max_total_tokens=1024)
    try:
        info = llm.server_info()["quantization_info"]
        assert info["batch_invariant"] and info["pinned_moe_layers"] == 2
        # qwen2_moe: per layer its router and its shared expert's gate, and each expert's
        # float up rows (a segment of its gate|up)
        assert info["pinned_float_linears"] == (4 if family == "qwen2_moe" else 0)
        assert info["pinned_float_segments"] == (2 * EXPERTS if family == "qwen2_moe" else 0)
        block = llm.engine.runner.model.layers[1].moe
        assert block.batch_invariant
        x = torch.randn(24, DIMS["hidden"], generator=torch.Generator().manual_seed(2))
        with torch.inference_mode():
            one_at_a_time = torch.cat([block(x[i:i + 1]) for i in range(x.shape[0])])
            for m in (2, 7, 24):
                assert torch.equal(block(x[:m]), one_at_a_time[:m]), m
        prompts = prompts_with_prefix(4, 18, [3, 12, 25])
        work = [(i, p, params(6, None if i % 2 else 31 + i)) for i, p in enumerate(prompts)]
        assert drive(llm, work) == cold_runs(llm, work)  # mixed, chunked, a radix hit
    finally:
        llm.shutdown()
