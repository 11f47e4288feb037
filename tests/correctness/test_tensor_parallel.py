"""Tensor-parallel layers (runner/parallel/tensor_parallel.py) against the one-rank model:
2 real processes over gloo on 127.0.0.1, llama (tied head, GQA 4:2), qwen2 (q/k/v bias,
untied head), qwen3 (per-head q/k norms, head_dim 24 != hidden / heads), mistral (8 query
heads on 2 KV heads), DeepSeek-V2-Lite's shape, DeepseekV32 and the MoE members of the
llama family (Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5: experts split by index, shared experts
by width) (tp 4 with each KV head replicated on two ranks runs through the whole engine in
test_tp_serving.py). Every rank's
logits equal the one-rank model's up to float summation order, and greedy decoding (a no-cache
forward per token) gives the same tokens on every rank as on one."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.rank_processes import results_from_ranks

STEPS = 6
PROMPT = [5, 17, 42, 99, 7, 250, 31, 64, 8, 120, 3]


def _greedy(model):
    """(first-step logits, STEPS greedy tokens) by no-cache forwards."""
    from kvstrata.runner.attention.dsa_sparse import DSASparseMLABackend
    from kvstrata.runner.attention.mla_dense import MLADenseBackend
    from kvstrata.runner.attention.torch_native import TorchNativeAttnBackend
    from kvstrata.runner.forward_batch import ForwardBatch

    d = model.dims
    if model.pool_kind == "mla":
        model.attn_backend = (DSASparseMLABackend(None, None, d.kv_lora_rank, d.index_topk,
                                                  d.index_head_dim, model.scaling)
                              if d.uses_dsa else
                              MLADenseBackend(None, None, d.kv_lora_rank, model.scaling))
    else:
        model.attn_backend = TorchNativeAttnBackend(None, None, d.num_heads, d.num_kv_heads,
                                                    d.head_dim)
    ids, first = list(PROMPT), None
    for _ in range(STEPS):
        fb = ForwardBatch.build([ids], [0], [0], torch.device("cpu"))
        fb.logits_idx = torch.tensor([len(ids) - 1])
        logits = model(fb)
        first = logits if first is None else first
        ids.append(int(logits.argmax(-1)))
    return first, ids[len(PROMPT):]


def _rank(rank: int, size: int, port: int, paths: list[str], out) -> None:
    import torch.distributed as dist

    from kvstrata.runner.parallel.tensor_parallel import TPGroup
    from kvstrata.runner.parallel.tp_load import load_tp_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    try:
        for path in paths:  # one group for every model: a process start is the slow part
            model = load_tp_model(path, TPGroup(rank, size))
            logits, tokens = _greedy(model)
            kv = (getattr(model, "held_experts", None)  # an MoE of the llama family
                  or (model.shard.kv_heads if model.pool_kind == "mha" else model.experts))
            # Plain lists: a torch tensor in a Queue is shared through a file descriptor
            # that dies with this process, which may exit before the parent reads it.
            out.put((path, rank, logits.tolist(), tokens, kv))
    finally:
        dist.destroy_process_group()


def run_ranks(paths: list[str], size: int) -> dict[str, list]:
    """path -> [(rank, logits, tokens, KV heads or experts held)] from `size` processes."""
    got = results_from_ranks(_rank, size, (paths,), size * len(paths))
    return {path: sorted((r, torch.tensor(lg), tok, kv) for q, r, lg, tok, kv in got
                         if q == path) for path in paths}


@pytest.fixture(scope="module")
def tiny_v2_lite(tmp_path_factory) -> str:
    """DeepSeek-V2-Lite's shape (MLA without DSA, one q_proj, softmax router)."""
    from helpers.moe_ckpt import build_moe_checkpoint

    return build_moe_checkpoint("deepseek_v2_lite",
                                str(tmp_path_factory.mktemp("tp_v2") / "deepseek_v2_lite"))


@pytest.fixture(scope="module")
def tiny_moes(tmp_path_factory) -> dict[str, str]:
    """Qwen3-MoE (dense first layer), Qwen2-MoE (gated shared expert, q/k/v biases),
    Mixtral (window 16), GLM-4.5 (V3's router, shared experts): helpers/moe_ckpt.py."""
    from helpers.moe_ckpt import moe_checkpoints

    return moe_checkpoints(str(tmp_path_factory.mktemp("tp_moe")))


@pytest.fixture(scope="module")
def ranked(tiny_checkpoints, tiny_dsa_4_heads, tiny_v2_lite, tiny_moes) -> dict:
    """(model, tp size) -> every rank's results: one 2-process group for every family."""
    two = [*(tiny_checkpoints[a] for a in ("llama", "qwen2", "qwen3", "mistral")),
           tiny_dsa_4_heads, tiny_v2_lite, *tiny_moes.values()]
    return {(p, 2): r for p, r in run_ranks(two, 2).items()}


def _one_rank(path: str):
    from kvstrata.config.model_source import load_hf_config, resolve_model_path
    from kvstrata.runner.models.loader import load_model

    source = resolve_model_path(path)
    model = load_model(source, load_hf_config(source), "float32")
    return model, *_greedy(model)


@pytest.mark.parametrize("arch,size", [("llama", 2), ("qwen2", 2), ("qwen3", 2),
                                       ("mistral", 2)])
def test_tp_ranks_equal_one_rank(tiny_checkpoints, ranked, arch, size):
    path = tiny_checkpoints[arch]
    ref, ref_logits, ref_tokens = _one_rank(path)
    d = ref.dims
    results = ranked[(path, size)]
    if size > d.num_kv_heads:  # replicated: two ranks per KV head
        assert [kv for *_, kv in results] == [
            (r * d.num_kv_heads // size, r * d.num_kv_heads // size + 1) for r in range(size)]
    for rank, logits, tokens, _ in results:
        assert logits.shape == ref_logits.shape
        torch.testing.assert_close(logits, ref_logits, atol=2e-5, rtol=1e-4)
        assert tokens == ref_tokens, rank


@pytest.mark.parametrize("checkpoint,experts", [("tiny_dsa_4_heads", [(0, 3), (3, 6)]),
                                                ("tiny_v2_lite", [(0, 4), (4, 8)])])
def test_tp_deepseek_ranks_equal_one_rank(request, ranked, checkpoint, experts):
    """MLA heads split (latent replicated), routed experts split by index, shared experts
    and the dense MLPs split by width; V3.2: the DSA indexer replicated (same top-k on every
    rank); V2-Lite's shape: no indexer, q_proj split by heads (q_lora_rank None), the softmax
    router replicated. Logits and greedy tokens equal the one-rank model's."""
    path = request.getfixturevalue(checkpoint)
    _, ref_logits, ref_tokens = _one_rank(path)
    results = ranked[(path, 2)]
    assert [local for *_, local in results] == experts
    for rank, logits, tokens, _ in results:
        torch.testing.assert_close(logits, ref_logits, atol=2e-5, rtol=1e-4)
        assert tokens == ref_tokens, rank


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"])
def test_tp_moe_ranks_equal_one_rank_and_transformers(tiny_moes, ranked, arch):
    """Attention heads split as the dense decoder's, routed experts by index (8 experts: 4
    per rank), the shared experts' width split (Qwen2-MoE's gated one, GLM-4.5's), the dense
    layers' width split. Logits equal the one-rank model's; greedy tokens equal it and
    transformers' at float32."""
    from helpers.moe_ckpt import hf_moe

    path = tiny_moes[arch]
    _, ref_logits, ref_tokens = _one_rank(path)
    with torch.no_grad():
        hf = hf_moe(path).generate(torch.tensor([PROMPT]), do_sample=False,
                                   max_new_tokens=STEPS, min_new_tokens=STEPS, pad_token_id=0)
    assert hf[0, len(PROMPT):].tolist() == ref_tokens
    results = ranked[(path, 2)]
    assert [held for *_, held in results] == [(0, 4), (4, 8)]
    for rank, logits, tokens, _ in results:
        torch.testing.assert_close(logits, ref_logits, atol=2e-5, rtol=1e-4)
        assert tokens == ref_tokens, rank


def test_tp_sizes_that_do_not_divide_are_refused_by_name():
    from kvstrata.config.hf_config import ModelDims
    from kvstrata.runner.parallel.tensor_parallel import TPShard

    d = ModelDims(hidden_size=64, intermediate_size=88, num_layers=1, num_heads=4,
                  num_kv_heads=2, head_dim=16, vocab_size=301, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, attention_bias=False, mlp_bias=False)
    with pytest.raises(ValueError, match="--tp-size 3 must divide num_attention_heads 4"):
        TPShard.plan(d, 0, 3)
    s = TPShard.plan(d, 3, 4)  # vocab 301 over 4 ranks: 76 rows each, the last has 73
    assert s.vocab == (228, 301) and s.vocab_rows == 76 and s.kv_heads == (1, 2)


def test_a_rank_reads_only_its_share(tiny_dsa_4_heads):
    """The loader asks the rank what to read (`read_spec`): another rank's experts are never
    read, column- and row-parallel tensors come out of the file already sliced."""
    import torch as _torch

    from kvstrata.config.model_source import load_hf_config, resolve_model_path
    from kvstrata.runner.models.loader import iter_checkpoint
    from kvstrata.runner.parallel.tensor_parallel import TPGroup
    from kvstrata.runner.parallel.tp_deepseek import TPDeepseek

    source = resolve_model_path(tiny_dsa_4_heads)
    config = load_hf_config(source)
    model = TPDeepseek.build(source, config, _torch.float32, _torch.device("cpu"),
                             TPGroup(1, 2))  # no collective runs: construction only
    read = dict(iter_checkpoint(source, config, read_spec=model.read_spec))
    full = dict(iter_checkpoint(source, config))
    experts = {int(n.split(".")[5]) for n in read if ".mlp.experts." in n}
    assert experts == {3, 4, 5}
    q_b = "model.layers.0.self_attn.q_b_proj.weight"
    assert read[q_b].shape[0] * 2 == full[q_b].shape[0]
    assert _torch.equal(read[q_b], full[q_b][full[q_b].shape[0] // 2:])
    o = "model.layers.0.self_attn.o_proj.weight"
    assert _torch.equal(read[o], full[o][:, full[o].shape[1] // 2:])
