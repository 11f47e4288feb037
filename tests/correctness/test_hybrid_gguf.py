"""Mamba2, Nemotron-H (dense and MoE), Granite-4.0-H, Qwen3.5 (dense and MoE), Qwen3-Next and
Falcon-H1 GGUF files (llama.cpp archs `mamba2`, `nemotron_h`, `nemotron_h_moe`,
`granitehybrid`, `qwen35`, `qwen35moe`, `qwen3next`, `falcon-h1`): tiny random models (tests/helpers/hybrid_ckpt.py) written as
llama.cpp's converter writes them with --outtype q8_0 (tests/helpers/hybrid_gguf.py and
hybrid_gguf_extra.py: -exp(A_log), reshaped A / D / norm, squeezed conv1d, permuted q / k,
Granite's gate / up halves apart, Qwen3.5's 1 + w norms and value heads tiled by key head,
Qwen3-Next's in_proj_qkvz split and experts stacked, Nemotron-H MoE's experts stacked and its
correction bias as exp_probs_b, Falcon-H1's muP multipliers folded into the weights, Q8_0
matrices beside F32 / F16 tensors) are served from the file:

- the config comes from the header (transformers converts none of these archs) and equals
  the HF config where the model reads it (Falcon-H1's: every multiplier 1, the weights left
  folded, as llama.cpp runs the file; folding then setting them to 1 is the same model:
  test_falcon_h1_folded_multipliers_are_the_same_model); resolution sees the recurrent layers
  from the header;
- every converter transform is undone exactly: the model loaded from the GGUF holds, parameter
  for parameter, what the model loaded from an HF checkpoint of the file's values holds (A_log
  from log(-A) within a float32 rounding of the original);
- greedy tokens equal transformers' on the file's values (float32), prompts in chunks of 16 at
  page size 16; a prompt sharing 40 tokens of an earlier one resumes at the snapshot at 32;
  the pools and the state slots are whole after the drain;
- a Qwen3.5 file's MTP block (block_count + 1) is not read;
- weights kept in their blocks (--quantization gguf) are GgufLinear layers with the float
  model's logits; the recurrent archs whose tensors are not mapped, and header fields not
  built, are refused by name (tests/unit/test_gguf_config.py).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from helpers.hybrid_ckpt import VOCAB, HFGreedy, build_hybrid_checkpoint
from helpers.hybrid_ckpt import (assert_drained_whole, build_falcon_h1_checkpoint,
                                 build_nemotron_h_moe_checkpoint, build_qwen3_5_moe_checkpoint)
from helpers.hybrid_gguf import write_hybrid_gguf
from helpers.hybrid_gguf_extra import write_hybrid_gguf_extra

ARCHS = ("mamba2", "nemotron_h", "granite", "qwen3_5", "qwen3_next", "nemotron_h_moe",
         "falcon_h1", "qwen3_5_moe")
# the archs tests/helpers/hybrid_gguf_extra.py writes, and their tiny checkpoints as the
# converter can write them: one router group (it writes no expert_group_used_count), and
# Falcon-H1 without in_proj / projector biases (its fold cannot scale a bias's blocks,
# llama.cpp reads no ssm_out bias) and with the gate before the group norm (llama.cpp's
# order)
_EXTRA = {"nemotron_h_moe": lambda p: build_nemotron_h_moe_checkpoint(p, n_group=1,
                                                                      topk_group=1),
          "falcon_h1": lambda p: build_falcon_h1_checkpoint(
              p, mamba_proj_bias=False, projectors_bias=False, mamba_norm_before_gate=False)}
# llama.cpp's qwen3next has no dense FFN tensors: every layer a MoE (the shared tiny Qwen3-Next
# has one every 2nd layer)
_VARIANT = {"qwen3_next": {"decoder_sparse_step": 1}}
NEW = 8
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
LENS = (5, 29, 70)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Per arch: (HF checkpoint, its GGUF, an HF checkpoint of the GGUF's values); the
    converted metadata under a private cache."""
    root = tmp_path_factory.mktemp("hybrid_gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(root / "cache"))  # config/model_source.py's cache
        out = {}
        for arch in ARCHS:
            ref, gguf = str(root / f"{arch}-ref"), str(root / f"{arch}.gguf")
            if arch in _EXTRA:
                hf = _EXTRA[arch](str(root / arch))
                out[arch] = (hf, write_hybrid_gguf_extra(arch, hf, gguf, ref), ref)
                continue
            hf = (build_qwen3_5_moe_checkpoint(str(root / arch)) if arch == "qwen3_5_moe" else
                  build_hybrid_checkpoint(arch, str(root / arch), **_VARIANT.get(arch, {})))
            out[arch] = (hf, write_hybrid_gguf(arch, hf, gguf, ref), ref)
        yield out


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(17)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENS]


_MAMBA = ("n_groups", "conv_kernel", "use_conv_bias", "use_bias", "time_step_limit")
_FIELDS = {
    "mamba2": (*_MAMBA, "num_heads", "head_dim", "expand", "state_size", "hidden_act",
               "residual_in_fp32", "layer_norm_epsilon"),
    "nemotron_h": (*_MAMBA, "layers_block_type", "num_attention_heads", "num_key_value_heads",
                   "head_dim", "intermediate_size", "mamba_num_heads", "mamba_head_dim",
                   "ssm_state_size", "mlp_hidden_act", "mamba_hidden_act", "mlp_bias",
                   "residual_in_fp32", "layer_norm_epsilon"),
    "granite": ("layers_block_type", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "shared_intermediate_size", "num_local_experts",
                "num_experts_per_tok", "mamba_n_heads", "mamba_d_head", "mamba_d_state",
                "mamba_n_groups", "mamba_d_conv", "mamba_conv_bias", "mamba_proj_bias",
                "mamba_expand", "position_embedding_type", "attention_multiplier",
                "embedding_multiplier", "residual_multiplier", "logits_scaling", "hidden_act",
                "time_step_limit", "rms_norm_eps"),
    "qwen3_5": ("layer_types", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
                "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
                "hidden_act", "max_position_embeddings", "rms_norm_eps")}
_FIELDS["qwen3_next"] = (*_FIELDS["qwen3_5"], "num_experts", "num_experts_per_tok",
                         "moe_intermediate_size", "shared_expert_intermediate_size",
                         "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")
_FIELDS["qwen3_5_moe"] = (*(f for f in _FIELDS["qwen3_5"] if f != "intermediate_size"),
                          "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                          "shared_expert_intermediate_size")
_FIELDS["nemotron_h_moe"] = (
    *(f for f in _FIELDS["nemotron_h"] if f != "intermediate_size"), "n_routed_experts",
    "num_experts_per_tok", "moe_intermediate_size", "moe_shared_expert_intermediate_size",
    "n_shared_experts", "norm_topk_prob", "routed_scaling_factor", "n_group", "topk_group",
    "moe_latent_size")
_FIELDS["falcon_h1"] = (
    "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
    "mamba_d_ssm", "mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups",
    "mamba_d_conv", "mamba_conv_bias", "mamba_proj_bias", "projectors_bias", "mamba_rms_norm",
    "mamba_norm_before_gate", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "time_step_limit", "embedding_multiplier", "lm_head_multiplier", "key_multiplier",
    "attention_in_multiplier", "attention_out_multiplier", "ssm_in_multiplier",
    "ssm_out_multiplier", "ssm_multipliers", "mlp_multipliers")
_LAYERS = {"mamba2": "model_type mamba2: every layer keeps state",
           "nemotron_h": "layers_block_type: 2 of 4 layers recurrent",
           "granite": "layer_types: 3 of 4 layers recurrent",
           "qwen3_5": "layer_types: 3 of 4 layers recurrent",
           "qwen3_next": "layer_types: 3 of 4 layers recurrent",
           "qwen3_5_moe": "layer_types: 3 of 4 layers recurrent",
           "nemotron_h_moe": "layers_block_type: 2 of 5 layers recurrent",
           "falcon_h1": "model_type falcon_h1: every layer keeps state"}


@pytest.mark.parametrize("arch", ARCHS)
def test_config_comes_from_the_header(arch, files):
    from transformers import AutoConfig

    from kvstrata.config import ModelInfo
    from kvstrata.config.model_source import load_hf_config, resolve_model_path

    _, gguf_path, ref_path = files[arch]
    # the reference's config: the HF one (Falcon-H1's with its multipliers 1)
    ours, theirs = load_hf_config(resolve_model_path(gguf_path)), AutoConfig.from_pretrained(
        ref_path)
    for field in ("architectures", "num_hidden_layers", "hidden_size", "vocab_size",
                  "tie_word_embeddings", "bos_token_id", "pad_token_id", "eos_token_id",
                  *_FIELDS[arch]):
        mine, want = getattr(ours, field), getattr(theirs, field)
        if isinstance(want, (list, tuple)) and field not in ("layers_block_type", "layer_types",
                                                             "mlp_only_layers",
                                                             "ssm_multipliers",
                                                             "mlp_multipliers"):
            mine, want = tuple(mine), tuple(want)  # time_step_limit: a list once saved
        if isinstance(want, float):  # stored as float32 in the file
            mine, want = np.float32(mine), np.float32(want)
        assert mine == want, field
    if arch in ("granite", "qwen3_5", "qwen3_next", "falcon_h1", "qwen3_5_moe"):
        for key in ("rope_theta", "partial_rotary_factor"):
            assert ours.rope_parameters.get(key) == theirs.rope_parameters.get(key), key
    info = ModelInfo.from_model_path(gguf_path)
    assert info.has_recurrent_state and info.recurrent_layers == _LAYERS[arch]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_converter_transform_is_undone(arch, files):
    """Parameter for parameter (fused q|k|v, conv windows, A_log, group norms), the model from
    the GGUF equals the model from an HF checkpoint of the file's values; and log(-A) gives
    back the original A_log."""
    import safetensors.torch as st

    from kvstrata.config.model_source import load_hf_config, resolve_model_path
    from kvstrata.runner.models.loader import load_model

    hf_path, gguf_path, ref_path = files[arch]
    models = []
    for path in (gguf_path, ref_path):
        source = resolve_model_path(path)
        models.append(load_model(source, load_hf_config(source), "float32"))
    ours, theirs = (dict(m.named_parameters()) for m in models)
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        assert torch.equal(p, theirs[name]), name
    # layer by layer (the saved checkpoint names Nemotron-H's module backbone.*, its state
    # dict model.*)
    original, reference = ([t for name, t in sorted(st.load_file(os.path.join(
        path, "model.safetensors")).items()) if name.endswith("A_log")]
        for path in (hf_path, ref_path))
    assert len(original) == len(reference) == models[0].num_recurrent_layers
    for got, want in zip(reference, original):
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-7)


# tp 2 (soak, ~10 s each): each rank cuts its share from the dequantized tensors
# (runner/parallel/tp_hybrid_split.py), GVA value heads and Mamba2 groups included.
# --quantization gguf (weights kept in their blocks) through the served path: Qwen3.5's
# untiled value rows, Qwen3-Next's regrouped qkvz and experts, Granite's joined expert
# halves, Nemotron-H MoE's expert stacks.
@pytest.mark.parametrize("arch,tp,quantization", [(a, 1, None) for a in ARCHS] + [
    (a, 1, "gguf") for a in ("qwen3_5", "qwen3_next", "granite", "nemotron_h_moe")] + [
    pytest.param("qwen3_5", 2, None, marks=pytest.mark.soak),
    pytest.param("nemotron_h", 2, None, marks=pytest.mark.soak)])
def test_greedy_from_the_gguf_equals_transformers(arch, tp, quantization, files, prompts):
    from kvstrata import LLM

    _, gguf_path, ref_path = files[arch]
    ref = HFGreedy(ref_path)
    long = prompts[-1]
    branch = long[:40] + [7, 8, 9]
    with LLM(gguf_path, tp_size=tp, skip_tokenizer_init=True, dtype="float32", page_size=16,
             chunked_prefill_size=16, max_total_tokens=1024, max_mamba_cache_size=24,
             quantization=quantization) as llm:
        assert llm.server_info()["quantization_info"]["quantization"] == quantization
        assert llm.server_info()["kv_plan"]["pool_kind"] == ("none" if arch == "mamba2"
                                                             else "mha")
        outs = llm.generate(input_ids=prompts, sampling_params=GREEDY)
        got = [o["output_ids"] for o in outs]
        assert got == [ref(p, NEW) for p in prompts]
        out, = llm.generate(input_ids=[branch], sampling_params=GREEDY)
        assert out["meta_info"]["cached_tokens"] == 32  # the chunk-end snapshot at 32
        assert out["output_ids"] == ref(branch, NEW)
        assert_drained_whole(llm)


def test_falcon_h1_folded_multipliers_are_the_same_model(files, prompts, tmp_path):
    """llama.cpp runs a Falcon-H1 file with every multiplier 1 over the weights the converter
    folded them into (config/gguf_falcon_h1.py reads it so): transformers' model of the folds
    (float, before quantizing) with its multipliers 1 gives the original model's logits."""
    import json

    import safetensors.torch as st
    from transformers import AutoConfig

    from helpers.hybrid_ckpt import hf_hybrid, hf_logits
    from helpers.hybrid_gguf_extra import UNIT_MULTIPLIERS, fold_falcon_multipliers

    hf_path = files["falcon_h1"][0]
    folded = fold_falcon_multipliers(AutoConfig.from_pretrained(hf_path), st.load_file(
        os.path.join(hf_path, "model.safetensors")))
    st.save_file(folded, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(hf_path, "config.json")) as f:
        raw = {**json.load(f), **UNIT_MULTIPLIERS}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(raw, f)
    original, unit = hf_hybrid(hf_path), hf_hybrid(str(tmp_path))
    for prompt in prompts:
        want = hf_logits(original, prompt)
        torch.testing.assert_close(hf_logits(unit, prompt), want, rtol=0,
                                   atol=1e-4 * float(want.abs().max()))


def test_a_qwen3_5_mtp_block_is_not_read(files, tmp_path):
    """A Qwen3.5 file with its MTP block (block_count + 1, nextn_predict_layers, blk.N.nextn.*)
    loads the model's layers only, as an HF checkpoint's mtp.* is skipped; NEXTN over it
    (the block as a draft) is refused by name."""
    from kvstrata.config.model_source import load_hf_config, resolve_model_path
    from kvstrata.runner.models.loader import load_model
    from kvstrata.runner.models.qwen3_next_mtp import load_qwen3_next_mtp

    hf_path, _, ref_path = files["qwen3_5"]
    path = write_hybrid_gguf("qwen3_5", hf_path, str(tmp_path / "mtp.gguf"),
                             str(tmp_path / "ref"), mtp_block=True)
    source = resolve_model_path(path)
    config = load_hf_config(source)
    assert config.num_hidden_layers == 4 and len(config.layer_types) == 4
    model = load_model(source, config, "float32")
    with pytest.raises(ValueError, match=r"NEXTN: the MTP \(nextn\) block of a GGUF file is "
                                         r"not read"):
        load_qwen3_next_mtp(source, config, model)
    ours = dict(model.named_parameters())
    source = resolve_model_path(ref_path)
    theirs = dict(load_model(source, load_hf_config(source), "float32").named_parameters())
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(p, theirs[name]) for name, p in ours.items())


@pytest.mark.parametrize("arch", ARCHS)
def test_weights_kept_in_their_blocks(arch, files, monkeypatch):
    """--quantization gguf: every block's Q8_0 matrices stay in their blocks (GgufLinear,
    through the converter's row transforms: q / k unpermuted, value heads untiled, halves
    joined, experts apart), so the model holds a fraction of the float model's weight bytes
    and no float copy; the logits equal the dequantized model's within float32 rounding (the
    GGUF kernel dequantizes Q8_0 to the same values in registers)."""
    from helpers.hybrid_ckpt import hybrid_runner
    from helpers.runner import forward_logits
    from kvstrata.config.model_source import load_hf_config, resolve_model_path
    from kvstrata.runner.models.hybrid_packed import weight_blocks
    from kvstrata.runner.models.loader import load_model
    from kvstrata.runner.quant.gguf_linear import GgufLinear, weight_bytes

    _, gguf_path, _ = files[arch]
    packed = hybrid_runner(gguf_path, num_pages=256, state_slots=4, quantization="gguf")
    model = packed.model
    for block in weight_blocks(model):
        kept = [n for n in (e if isinstance(e, str) else e[0] for e in
                            (*block.pinned_weights, *block.pinned_expert_stacks))
                if isinstance(getattr(block, n), GgufLinear)
                or (isinstance(getattr(block, n), torch.nn.ModuleList)
                    and all(type(x) is GgufLinear for x in getattr(block, n)))]
        assert kept, f"{type(block).__name__} kept nothing in its blocks"
    assert packed.quantization_info["packed_types"] == ["Q8_0"]
    source = resolve_model_path(gguf_path)
    dequantized = load_model(source, load_hf_config(source), "float32")
    assert weight_bytes(model) < 0.6 * weight_bytes(dequantized)
    monkeypatch.setenv("KVSTRATA_CPU_PACKED_LINEAR", "0")
    plain = hybrid_runner(gguf_path, num_pages=256, state_slots=4)
    prompt = list(range(3, 40))
    got, want = forward_logits(packed, prompt), forward_logits(plain, prompt)
    assert (got - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())


def test_tensor_names_of_each_family():
    """llama.cpp's names to the HF checkpoint's, beyond the tiny models' files: a dense
    Granite-4.0-H (granite-4.0-h-micro: its shared MLP as plain ffn_gate / ffn_up / ffn_down),
    the bare ssm_a / ssm_d, Nemotron-H MoE's latent projections; a tensor of another arch
    (Qwen3-Next's ssm_ba in a Nemotron-H file) has none."""
    from kvstrata.runner.models.gguf_hybrid_weights import hf_name

    granite = {"blk.3.ffn_gate.weight": "model.layers.3.shared_mlp.input_linear.weight",
               "blk.3.ffn_up.weight": "model.layers.3.shared_mlp.input_linear.weight",
               "blk.3.ffn_down.weight": "model.layers.3.shared_mlp.output_linear.weight",
               "blk.0.ssm_a": "model.layers.0.mamba.A_log",
               "blk.0.ssm_dt.bias": "model.layers.0.mamba.dt_bias",
               "token_embd.weight": "model.embed_tokens.weight"}
    for gguf_name, name in granite.items():
        assert hf_name(gguf_name, "granitemoehybrid")[0] == name, gguf_name
    assert hf_name("blk.2.ssm_d", "nemotron_h") == ("backbone.layers.2.mixer.D", "ssm_d")
    # Nemotron-H MoE's stacks and router bias (transformers' names); Falcon-H1's suffix-less
    # ffn_norm (FFN_PRE_NORM)
    moe = {"blk.2.ffn_down_exps.weight": "backbone.layers.2.mixer.experts.down_proj",
           "blk.2.exp_probs_b.bias": "backbone.layers.2.mixer.gate.e_score_correction_bias",
           "blk.2.ffn_latent_up.weight": "backbone.layers.2.mixer.fc2_latent_proj.weight"}
    for gguf_name, name in moe.items():
        assert hf_name(gguf_name, "nemotron_h")[0] == name, gguf_name
    assert hf_name("blk.1.ffn_norm", "falcon_h1")[0] == "model.layers.1.pre_ff_layernorm.weight"
    with pytest.raises(ValueError, match="'blk.0.ssm_ba.weight' has no mapping"):
        hf_name("blk.0.ssm_ba.weight", "nemotron_h")
