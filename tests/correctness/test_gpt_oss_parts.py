"""gpt-oss pieces against transformers' own modules, no attention needed: the MoE block
(router, clamped SwiGLU experts, weighted sum), YaRN RoPE (inverse frequencies, attention
factor, the rotation), the MXFP4 dequantizer, and the loader's MXFP4 path."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from helpers.gpt_oss import build_checkpoint, load_reference


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return build_checkpoint(str(tmp_path_factory.mktemp("gpt_oss") / "tiny"))


def _ours(path: str, dtype: str = "float32"):
    from kvstrata.config.model_source import load_hf_config, resolve_model_path
    from kvstrata.runner.models.loader import load_model

    source = resolve_model_path(path)
    return load_model(source, load_hf_config(source), dtype)


def test_moe_block_matches_transformers(tiny):
    """Every layer's MoE over 64 tokens: routes equal, output within float32 rounding; the
    clamps cut (the tiny config's limit is 1.5), so dropping one would fail."""
    hf, ours = load_reference(tiny), _ours(tiny)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    for i, layer in enumerate(hf.model.layers):
        with torch.no_grad():
            ref, _ = layer.mlp(x[None])
            gate_up = x @ layer.mlp.experts.gate_up_proj[0] + layer.mlp.experts.gate_up_proj_bias[0]
        assert (gate_up[:, ::2] > 1.5).any() and (gate_up[:, 1::2].abs() > 1.5).any()
        _, ref_ids = layer.mlp.router(x)[1:]
        ids, _ = ours.route(ours.layers[i], x)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(ours.moe(ours.layers[i], x), ref[0], atol=1e-5, rtol=0)


def test_moe_runs_each_chosen_expert_once(tiny, monkeypatch):
    """Grouped by expert: 64 tokens x top-2 of 4 experts is 4 expert calls, not 128."""
    from kvstrata.runner.models import gpt_oss

    ours, calls = _ours(tiny), []

    def counting(x, ids, weights, num_experts, expert, held=None, **kw):
        def counted(e, xs):
            calls.append((e, xs.shape[0]))
            return expert(e, xs)
        return routed_sum(x, ids, weights, num_experts, counted, held, **kw)

    routed_sum = gpt_oss.routed_sum
    monkeypatch.setattr(gpt_oss, "routed_sum", counting)
    ours.moe(ours.layers[0], torch.randn(64, 64, generator=torch.Generator().manual_seed(2)))
    assert sorted(e for e, _ in calls) == sorted(set(e for e, _ in calls))
    assert sum(n for _, n in calls) == 64 * 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pinned_moe_rows_do_not_depend_on_the_batch(tiny, dtype):
    """Deterministic inference's pieces for gpt-oss's experts (runner/cpu/fixed_experts.py;
    the flag itself stays refused until its attention sinks run the batch-invariant decode
    kernel): with the router and every expert on the fixed GEMM (biases inside), the GLU's
    sigmoid per row and the combine in top-k order, a token's MoE output is the same bits
    alone as beside 1..95 others, and close to the unpinned block's."""
    from kvstrata.runner.cpu.fixed_experts import pin_moe_layers
    from kvstrata.runner.cpu.fixed_linear import fixed_unsupported

    ours = _ours(tiny, dtype)
    weight = ours.layers[0].router_weight
    if fixed_unsupported(weight) is not None:
        pytest.skip(fixed_unsupported(weight))
    x = torch.randn(96, 64, generator=torch.Generator().manual_seed(4)).to(weight.dtype)
    with torch.inference_mode():
        plain = [ours.moe(layer, x) for layer in ours.layers]
        assert pin_moe_layers(ours) == len(ours.layers)
        for i, layer in enumerate(ours.layers):
            full = ours.moe(layer, x)
            alone = torch.cat([ours.moe(layer, x[j:j + 1]) for j in range(16)])
            assert torch.equal(full[:16], alone), f"layer {i}: 96 tokens vs one at a time"
            for m in list(range(2, 18)) + [33, 64, 95]:
                assert torch.equal(ours.moe(layer, x[:m]), full[:m]), f"layer {i}: {m}"
            tol = 1e-5 if dtype == "float32" else 0.05 * plain[i].abs().max().item()
            assert (full.float() - plain[i].float()).abs().max().item() <= tol


def test_moe_bfloat16_close_to_transformers_bfloat16(tiny):
    hf, ours = load_reference(tiny, torch.bfloat16), _ours(tiny, "bfloat16")
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.no_grad():
        ref, _ = hf.model.layers[2].mlp(x[None])
    out = ours.moe(ours.layers[2], x)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref[0].float()).abs().max() < 0.02 * ref.float().abs().max()


YARN = [
    {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
     "original_max_position_embeddings": 4096},  # gpt-oss's own
    {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
     "original_max_position_embeddings": 4096},  # truncate defaults to True
    {"factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 0.8,
     "rope_theta": 10000.0},
    {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
     "mscale_all_dim": 0.707, "rope_theta": 10000.0},
]


@pytest.mark.parametrize("params", YARN, ids=range(len(YARN)))
def test_yarn_rope_matches_transformers(params):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.gpt_oss.modeling_gpt_oss import (GptOssRotaryEmbedding,
                                                              apply_rotary_pos_emb)

    from kvstrata.runner.models.decoder import rope_qk
    from kvstrata.runner.models.rope import (RotaryEmbedding, compute_inv_freq,
                                             rope_attention_factor, rope_parameters)

    config = GptOssConfig(head_dim=64, max_position_embeddings=131072,
                          rope_parameters={"rope_type": "yarn", **params})
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    ours = rope_parameters(config)
    assert torch.equal(compute_inv_freq(64, ours), ref_inv)
    assert rope_attention_factor(ours) == ref_factor
    # The rotation itself: transformers' half-split cos/sin against our signed layout.
    positions = torch.tensor([0, 1, 5, 127, 128, 4095, 4096, 100000])
    q, k = torch.randn(8, 3, 64), torch.randn(8, 2, 64)
    cos, sin = GptOssRotaryEmbedding(config)(q, positions[None])
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                        cos, sin)
    c, s = RotaryEmbedding(64, ours, torch.device("cpu")).cos_sin(positions, torch.float32)
    got_q, got_k = rope_qk(torch.cat([q.flatten(1), k.flatten(1), k.flatten(1)], 1).clone(),
                           3, 2, 64, c, s)
    torch.testing.assert_close(got_q, ref_q[0].transpose(0, 1), atol=2e-6, rtol=0)
    torch.testing.assert_close(got_k, ref_k[0].transpose(0, 1), atol=2e-6, rtol=0)


def _random_mxfp4(shape_out: int, shape_in: int, experts: int, seed: int,
                  scale_range: tuple[int, int] = (118, 132)):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, shape_out, shape_in // 32, 16), generator=g,
                           dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(*scale_range, (experts, shape_out, shape_in // 32), generator=g,
                           dtype=torch.int32).to(torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantize_matches_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from kvstrata.runner.quant.mxfp4 import dequantize_mxfp4

    # Ordinary scales, and the extremes of E8M0 (2^-127 .. 2^127; 255 is NaN by the spec).
    for scale_range in ((118, 132), (0, 255)):
        blocks, scales = _random_mxfp4(48, 96, 3, seed=scale_range[1],
                                       scale_range=scale_range)
        ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        ours = dequantize_mxfp4(blocks, scales, dtype)
        assert ours.shape == ref.shape == (3, 96, 48) and ours.dtype == dtype
        assert torch.equal(ours, ref)


@pytest.fixture(scope="module")
def tiny_mx(tmp_path_factory) -> str:
    """Expert width 96: MXFP4 blocks of 32 need in-dims that are multiples of 32 (and at
    tp 2 a rank's 48 units are 1.5 blocks, as gpt-oss's 720 at tp 4 are 22.5)."""
    return build_checkpoint(str(tmp_path_factory.mktemp("gpt_oss") / "tiny96"),
                            intermediate_size=96)


@pytest.fixture(scope="module")
def mxfp4_pair(tiny_mx, tmp_path_factory):
    """(MXFP4 checkpoint, the same weights unquantized, the latter's tensors): the experts
    replaced by random MXFP4 blocks, and by transformers' dequantization of them."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    quant, plain = root / "mxfp4", root / "plain"
    for d in (quant, plain):
        shutil.copytree(tiny_mx, d)
    tensors = load_file(os.path.join(tiny_mx, "model.safetensors"))
    q_tensors, p_tensors = dict(tensors), dict(tensors)
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, n_in, n_out = tensors[key].shape
        blocks, scales = _random_mxfp4(n_out, n_in, e, seed=len(key))
        del q_tensors[key]
        q_tensors[key + "_blocks"], q_tensors[key + "_scales"] = blocks, scales
        p_tensors[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(q_tensors, str(quant / "model.safetensors"))
    save_file(p_tensors, str(plain / "model.safetensors"))
    cfg = json.loads((quant / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (quant / "config.json").write_text(json.dumps(cfg))
    return str(quant), str(plain), p_tensors


def test_mxfp4_checkpoint_loads_as_its_dequantized_weights(mxfp4_pair):
    """A checkpoint whose experts are MXFP4 (as released gpt-oss files are) loads to the
    weights transformers' dequantizer gives, in the split/transposed layout; the unquantized
    copy with those weights yields the same model."""
    quant, plain, p_tensors = mxfp4_pair
    a, b = _ours(quant), _ours(plain)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    w = p_tensors["model.layers.1.mlp.experts.gate_up_proj"]  # [E, in, out], interleaved
    assert torch.equal(a.layers[1].gate_up[:, :96], w[..., ::2].transpose(1, 2))
    assert torch.equal(a.layers[1].gate_up[:, 96:], w[..., 1::2].transpose(1, 2))


def test_mxfp4_tensor_parallel_matches_transformers(mxfp4_pair):
    """tp 2 over MXFP4 experts: each rank keeps its half of every dequantized expert (48
    units: not whole blocks); greedy tokens equal transformers' on the dequantized weights."""
    from helpers.compare import assert_tokens_match
    from kvstrata import LLM

    quant, plain, _ = mxfp4_pair
    prompts = [[5 + i * 7 % 290 for i in range(n)] for n in (3, 20, 41)]
    hf = load_reference(plain)
    greedy = {"max_new_tokens": 8, "min_new_tokens": 8, "temperature": 0}
    with LLM(model_path=quant, skip_tokenizer_init=True, dtype="float32", tp_size=2,
             page_size=4, max_total_tokens=1024) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params=greedy)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8,
                              min_new_tokens=8, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0)
        assert_tokens_match(out["output_ids"], ref.sequences[0, len(prompt):].tolist(),
                            [s[0] for s in ref.logits])


def test_mxfp4_half_a_pair_is_an_error(tiny_mx, tmp_path):
    from safetensors.torch import load_file, save_file

    tiny = tiny_mx
    shutil.copytree(tiny, tmp_path / "broken")
    tensors = load_file(os.path.join(tiny, "model.safetensors"))
    key = "model.layers.0.mlp.experts.down_proj"
    blocks, _ = _random_mxfp4(64, 96, 4, seed=3)
    del tensors[key]
    tensors[key + "_blocks"] = blocks
    save_file(tensors, str(tmp_path / "broken" / "model.safetensors"))
    with pytest.raises(ValueError, match="missing weights"):
        _ours(str(tmp_path / "broken"))
