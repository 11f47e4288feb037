"""Shared fixtures: tiny random checkpoints of each supported architecture (built once per
session from real transformers configs), their transformers reference outputs, and SmolLM2.

Tiny models use odd sizes and GQA so shape bugs cannot hide behind symmetric dimensions.
initializer_range is large enough that logits are peaked: with the default 0.02 almost
every greedy step would be a near-tie and the token comparison would test little.
"""
from __future__ import annotations

import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # so tests can `import helpers.*`
# Every KV invariant after every scheduler step, in-process engines and spawned servers alike
# (a leak or stale row fails the step that caused it, not a later drain check).
os.environ.setdefault("KVSTRATA_CHECK_INTEGRITY", "1")
# --dtype auto means float32 on a CPU here, whatever the CPU: the suite's references are fp32
# (transformers, our own runs compared across batch shapes) and must hold on AVX2 and on
# bf16-capable machines alike. Tests of the auto rule pass their own env; the bf16 path has
# its own tests (tests/correctness/test_bf16_quality.py, test_paged_decode_kernel.py).
os.environ.setdefault("KVSTRATA_CPU_AUTO_DTYPE", "float32")


def pytest_configure(config):
    # One intra-op thread unless the user chose: the test models are tiny (ops of a few
    # microseconds), and on a small shared box OpenMP workers spinning against other
    # processes made the suite ~10x slower in wall time than single-threaded.
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(1)


TINY_VOCAB = 300
TINY_MAX_POS = 512
GREEDY_TOKENS = 32
TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def _tiny_config(arch: str):
    import transformers as tf

    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=88,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=TINY_MAX_POS, initializer_range=0.2,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        # llama3-style rope scaling and tied embeddings (as SmolLM2) on the llama model.
        return tf.LlamaConfig(**common, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    if arch == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=False)
    if arch == "qwen3":
        # head_dim 24 != hidden / heads (16), as real Qwen3 models do.
        return tf.Qwen3Config(**{**common, "num_hidden_layers": 2}, head_dim=24,
                              tie_word_embeddings=False)
    if arch == "mistral":
        return tf.MistralConfig(**{**common, "num_attention_heads": 8}, sliding_window=None,
                                tie_word_embeddings=False)
    raise ValueError(arch)


def _build_checkpoint(arch: str, path: str) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234 + TINY_ARCHS.index(arch))
    model = AutoModelForCausalLM.from_config(_tiny_config(arch), dtype=torch.float32)
    if arch == "qwen2":
        # Random-init biases are zero; make them matter so a dropped bias fails the test.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    # The mistral checkpoint is sharded, to test model.safetensors.index.json.
    shard = "60KB" if arch == "mistral" else "5GB"
    model.save_pretrained(path, safe_serialization=True, max_shard_size=shard)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_ckpts")
    return {a: _build_checkpoint(a, str(root / a)) for a in TINY_ARCHS}


@pytest.fixture(scope="session")
def tiny_prompts() -> list[list[int]]:
    """8 prompts of different lengths (1 .. 70 tokens), crossing page boundaries of 16."""
    rng = random.Random(7)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(n)]
            for n in (1, 3, 7, 16, 17, 31, 45, 70)]


@pytest.fixture(scope="session")
def tiny_references(tiny_checkpoints, tiny_prompts) -> dict:
    """arch -> list of (ref tokens, ref per-step logits) from transformers greedy generate."""
    return {arch: hf_greedy_references(path, tiny_prompts)
            for arch, path in tiny_checkpoints.items()}


def hf_greedy_references(path: str, prompts: list[list[int]]) -> list:
    """(ref tokens, ref per-step logits) per prompt: transformers greedy generate, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    refs = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False,
                                 max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS,
                                 output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=0)
        refs.append((out.sequences[0, len(prompt):].tolist(), [s[0] for s in out.logits]))
    return refs


# Tiny DeepSeek-V3.2 (MLA + DSA indexer + MoE): odd sizes, 2 dense then 2 MoE layers, YaRN
# rope with mscale != mscale_all_dim, and index_topk (8) below most prompt lengths so that
# attention really is sparse. 16 indexer heads: an indexer score is exactly 0 when every
# head's relu is 0, and with 4 heads (1 key in 16) such exact ties landed on the top-k
# boundary, where transformers itself breaks them differently in prefill and decode.
DSA_INDEX_TOPK = 8


def _tiny_dsa_config(num_hidden_layers: int = 4):
    import transformers as tf

    return tf.DeepseekV32Config(
        vocab_size=TINY_VOCAB, hidden_size=72, intermediate_size=88, moe_intermediate_size=40,
        num_hidden_layers=num_hidden_layers, num_attention_heads=3, num_key_value_heads=3, n_shared_experts=1,
        n_routed_experts=6, kv_lora_rank=28, q_lora_rank=36, qk_rope_head_dim=8,
        v_head_dim=20, qk_nope_head_dim=12, n_group=2, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=2, index_topk=DSA_INDEX_TOPK, index_head_dim=24,
        index_n_heads=16, max_position_embeddings=TINY_MAX_POS, initializer_range=0.2,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1,
            "mscale": 0.8, "mscale_all_dim": 1.0})


@pytest.fixture(scope="session")
def tiny_dsa_checkpoint(tmp_path_factory) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(4321)
    model = AutoModelForCausalLM.from_config(_tiny_dsa_config(), dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            # Random-init leaves these at zero/one; make them matter.
            layer.self_attn.indexer.k_norm.bias.normal_(0, 0.5)
            layer.self_attn.indexer.k_norm.weight.normal_(1, 0.3)
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.normal_(0, 0.3)
    path = str(tmp_path_factory.mktemp("tiny_dsa") / "deepseek_v32")
    model.save_pretrained(path, safe_serialization=True)
    return path


def add_mtp_layer(src: str, dst: str, index_share: bool = True) -> str:
    """A copy of the tiny DSA checkpoint `src` with one MTP layer (random weights) stored the
    way DeepSeek's releases store it: layer `num_hidden_layers` with enorm / hnorm / eh_proj /
    shared_head.{norm,head} / embed_tokens beside an ordinary decoder layer (MoE here)."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst)
    n = _tiny_dsa_config().num_hidden_layers
    cfg = _tiny_dsa_config(n + 1)
    torch.manual_seed(8765)
    donor = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    donor.save_pretrained(f"{dst}.donor", safe_serialization=True)  # checkpoint names
    donated = load_file(f"{dst}.donor/model.safetensors")
    shutil.rmtree(f"{dst}.donor")
    tensors = load_file(f"{dst}/model.safetensors")
    pre = f"model.layers.{n}."
    tensors.update({k: v for k, v in donated.items() if k.startswith(pre)})
    h = cfg.hidden_size
    tensors[pre + "enorm.weight"] = torch.randn(h).mul_(0.2).add_(1.0)
    tensors[pre + "hnorm.weight"] = torch.randn(h).mul_(0.2).add_(1.0)
    tensors[pre + "eh_proj.weight"] = torch.randn(h, 2 * h) * 0.1
    tensors[pre + "shared_head.norm.weight"] = torch.randn(h).mul_(0.2).add_(1.0)
    tensors[pre + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors[pre + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, f"{dst}/model.safetensors",
              metadata={"format": "pt"})
    with open(f"{dst}/config.json") as f:
        raw = json.load(f)
    raw.update(num_nextn_predict_layers=1, index_share_for_mtp_iteration=index_share)
    with open(f"{dst}/config.json", "w") as f:
        json.dump(raw, f, indent=1)
    return dst


@pytest.fixture(scope="session")
def tiny_dsa_mtp_checkpoint(tiny_dsa_checkpoint, tmp_path_factory) -> str:
    """The tiny DSA checkpoint plus an MTP layer, IndexShare on (NEXTN tests)."""
    return add_mtp_layer(tiny_dsa_checkpoint,
                         str(tmp_path_factory.mktemp("tiny_dsa_mtp") / "deepseek_v32"))


@pytest.fixture(scope="session")
def tiny_dsa_references(tiny_dsa_checkpoint, tiny_prompts) -> list:
    return hf_greedy_references(tiny_dsa_checkpoint, tiny_prompts)


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    from kvstrata.config.model_source import resolve_model_path

    try:
        return resolve_model_path("smollm2-135m").gguf_path
    except ValueError as e:
        pytest.skip(str(e))
