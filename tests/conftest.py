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
# The suite tests the CPU paths (C kernels, decode plans, packing and dtype rules) wherever it
# runs: on an H200 box a visible GPU made the platform resolve to cuda and turned them off (19
# of 683 kernel tests failed so; with the GPU hidden all pass). KVSTRATA_TEST_CUDA=1 keeps
# GPUs visible for tests/cuda (`make test-cuda`), which skip without one.
if os.environ.get("KVSTRATA_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["HIP_VISIBLE_DEVICES"] = ""
# --dtype auto means float32 on a CPU here, whatever the CPU: the suite's references are fp32
# (transformers, our own runs compared across batch shapes) and must hold on AVX2 and on
# bf16-capable machines alike. Tests of the auto rule pass their own env; the bf16 path has
# its own tests (tests/correctness/test_bf16_quality.py, test_paged_decode_kernel.py).
os.environ.setdefault("KVSTRATA_CPU_AUTO_DTYPE", "float32")
# Start-up CPU, which the two test workers' ~60 server starts share (none of it is under test
# here): a spawned scheduler loads its tokenizer only for a request with stop strings (~1.6 s
# of CPU a start otherwise; tests/e2e/conftest.py's shared server keeps the eager default),
# and KV pools take 4 KiB pages: asking for huge pages made the kernel compact memory at the
# first touch, 2-5 s of system time per 1.4 GB SmolLM2 pool on a busy box (the advice itself
# is tested in tests/unit/test_huge_pages.py; its speed-up is a benchmark's).
os.environ.setdefault("KVSTRATA_SCHEDULER_EAGER_TOKENIZER", "0")
os.environ.setdefault("KVSTRATA_CPU_HUGE_PAGES", "0")
# httpx.get & co. without a new TLS context per call (~50 ms of CPU each: helpers/httpx_context.py)
from helpers.httpx_context import share_one_ssl_context  # noqa: E402

share_one_ssl_context()


def pytest_configure(config):
    # One intra-op thread unless the user chose: the test models are tiny (ops of a few
    # microseconds), and on a small shared box OpenMP workers spinning against other
    # processes made the suite ~10x slower in wall time than single-threaded.
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(1)


# The files that take longest, longest first (CPU seconds per file with rusage, 2026-12-07,
# tests/helpers/file_cpu.py; the model-family files added since by their durations;
# on 2 cores the suite is CPU-bound, so a file's CPU stands for its time).
# `make test` hands whole files to its two workers in collection order
# (--dist loadfile --no-loadscope-reorder): starting with the long ones leaves only short
# files for the end, so both workers finish together (longest-processing-time first).
# test_w8a8_int8 and test_bf16_quality share a float32 SmolLM2 measurement (the second one
# waits for the first's): they stand far apart so that the second rarely waits.
# A stale list only costs balance, never correctness.
LONG_FILES_FIRST = (
    "correctness/test_emulated_avx512.py", "correctness/test_tp_serving.py",
    "e2e/test_pd_disagg.py", "correctness/test_w8a8_int8.py", "e2e/test_benchmark_scripts.py",
    "e2e/test_pd_retraction.py", "e2e/test_pd_decode_radix.py", "e2e/test_tp_server.py",
    "unit/test_disagg_fuzz.py", "e2e/test_dsa_pd.py", "e2e/test_pd_mtp.py",
    "correctness/test_gemma.py", "correctness/test_deepseek_families.py",
    "correctness/test_moe_families.py", "unit/test_scheduler_fuzz.py",
    "correctness/test_swa_tiers.py", "correctness/test_smollm2_gguf_packed.py",
    "correctness/test_sliding_window_attention.py", "correctness/test_deterministic_smollm2.py",
    "e2e/test_pd_tp.py", "correctness/test_hybrid_engine.py",
    "correctness/test_bf16_quality.py", "e2e/test_schema_fuzz.py",
    "e2e/test_hicache_storage_server.py", "e2e/test_lifecycle.py",
    "transfer/test_disagg_backends.py", "e2e/test_priority_server.py",
    "correctness/test_smollm2_gguf.py", "correctness/test_swa_memory_engine.py",
    "correctness/test_swa_pd_engine.py", "e2e/test_smollm2_smoke.py",
    "e2e/test_speculative_server.py", "correctness/test_dsa_model.py",
    "correctness/test_tiny_models.py", "e2e/test_tool_calling.py", "e2e/test_tp_start_up.py",
    "correctness/test_tensor_parallel.py", "e2e/test_structured_output.py",
    "e2e/test_sglang_router.py", "e2e/test_load_fuzz.py", "e2e/test_control_routes_under_load.py",
    "e2e/test_bad_input.py", "correctness/test_speculative.py",
    "correctness/test_gpt_oss.py", "correctness/test_sliding_window_models.py",
    "correctness/test_hf_quant_models.py", "correctness/test_deterministic_packed.py",
    "e2e/test_hybrid_server.py",
    "correctness/test_hybrid_hicache.py", "correctness/test_hybrid_spec_engine.py",
    "correctness/test_gpt_oss_gguf.py", "correctness/test_paged_decode_softmax_extras.py")


# Files whose tests share a session-scoped server (tests/e2e/conftest.py `tcp_prefill`): under
# `make test` (--dist loadfile) each group is one work unit, its files run one after the
# other on one worker in collection order, so the server starts once per run instead of
# once per worker that happens to draw one of its files.
SERVER_GROUPS = {f"tests/e2e/{name}": "tests/e2e/[tcp_prefill]" for name in (
    "test_pd_disagg.py", "test_pd_retraction.py", "test_pd_decode_radix.py")}


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class GroupedFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return SERVER_GROUPS.get(path, path)

    return GroupedFileScheduling(config, log)


def pytest_collection_modifyitems(session, config, items):
    rank = {f"tests/{f}": i for i, f in enumerate(LONG_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable
    # `make test` must stay under 10 minutes on 2 cores: a test marked `soak` repeats, longer
    # or on another backend, what a test in the suite covers, and runs with KVSTRATA_SOAK=1
    # (docs/testing.md lists them).
    if os.environ.get("KVSTRATA_SOAK") != "1":
        skip = pytest.mark.skip(reason="a soak: KVSTRATA_SOAK=1 runs it (docs/testing.md)")
        for item in items:
            if item.get_closest_marker("soak") is not None:
                item.add_marker(skip)


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
    # A parent run's folder of them (test_emulated_avx512.py's child runs): the same files.
    given = os.environ.get("KVSTRATA_TEST_TINY_CHECKPOINTS")
    if given:
        return {a: os.path.join(given, a) for a in TINY_ARCHS}
    root = tmp_path_factory.mktemp("tiny_ckpts")
    return {a: _build_checkpoint(a, str(root / a)) for a in TINY_ARCHS}


@pytest.fixture(scope="session")
def shared_tmp_dir(tmp_path_factory) -> str:
    """A folder the test workers of one run share (pytest-xdist gives each worker its own
    basetemp under one per-run folder): for results measured once per run."""
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    path.mkdir(exist_ok=True)
    return str(path)


@pytest.fixture(scope="session")
def tiny_prompts() -> list[list[int]]:
    """8 prompts of different lengths (1 .. 70 tokens), crossing page boundaries of 16."""
    rng = random.Random(7)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(n)]
            for n in (1, 3, 7, 16, 17, 31, 45, 70)]


class _ReferencesByArch(dict):
    """arch -> shared_references of its tiny checkpoint, computed at the first look-up (a
    file that compares one architecture pays for that one only)."""

    def __init__(self, checkpoints: dict[str, str], prompts: list, shared_dir: str):
        super().__init__()
        self.checkpoints, self.prompts, self.shared_dir = checkpoints, prompts, shared_dir

    def __missing__(self, arch: str) -> list:
        self[arch] = refs = shared_references(self.checkpoints[arch], self.prompts,
                                              self.shared_dir)
        return refs


@pytest.fixture(scope="session")
def tiny_references(tiny_checkpoints, tiny_prompts, shared_tmp_dir) -> dict:
    """arch -> list of (ref tokens, ref per-step logits) from transformers greedy generate."""
    return _ReferencesByArch(tiny_checkpoints, tiny_prompts, shared_tmp_dir)


def shared_references(path: str, prompts: list[list[int]], shared_dir: str) -> list:
    """hf_greedy_references(path, prompts), computed once per run: the first test worker to
    ask writes it under `shared_dir`, keyed by the checkpoint's files and the prompts (the
    workers build byte-identical tiny checkpoints), and the others read it back."""
    import hashlib

    import torch
    from filelock import FileLock

    digest = hashlib.sha256(repr((prompts, GREEDY_TOKENS)).encode())
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as fh:
            digest.update(name.encode() + fh.read())
    out = os.path.join(shared_dir, f"hf-references-{digest.hexdigest()[:20]}.pt")
    with FileLock(out + ".lock"):
        if not os.path.exists(out):
            refs = hf_greedy_references(path, prompts)
            torch.save(refs, out + ".tmp")
            os.replace(out + ".tmp", out)
            return refs
    return torch.load(out)


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
    from kvstrata.bench.tiny_dsa import tiny_dsa_config

    return tiny_dsa_config(TINY_VOCAB, DSA_INDEX_TOPK, TINY_MAX_POS, num_hidden_layers)


@pytest.fixture(scope="session")
def tiny_dsa_checkpoint(tmp_path_factory) -> str:
    from kvstrata.bench.tiny_dsa import save_tiny_dsa

    return save_tiny_dsa(_tiny_dsa_config(),
                         str(tmp_path_factory.mktemp("tiny_dsa") / "deepseek_v32"))


def add_mtp_layer(src: str, dst: str, index_share: bool = True) -> str:
    """A copy of the tiny DSA checkpoint `src` with one MTP layer (kvstrata/bench/tiny_dsa.py)."""
    from kvstrata.bench import tiny_dsa

    return tiny_dsa.add_mtp_layer(src, dst, _tiny_dsa_config(_tiny_dsa_config().num_hidden_layers
                                                             + 1), index_share)


@pytest.fixture(scope="session")
def tiny_dsa_mtp_checkpoint(tiny_dsa_checkpoint, tmp_path_factory) -> str:
    """The tiny DSA checkpoint plus an MTP layer, IndexShare on (NEXTN tests)."""
    return add_mtp_layer(tiny_dsa_checkpoint,
                         str(tmp_path_factory.mktemp("tiny_dsa_mtp") / "deepseek_v32"))


@pytest.fixture(scope="session")
def tiny_dsa_4_heads(tmp_path_factory) -> str:
    """The tiny DeepseekV32 with 4 attention heads (the usual one has 3: no even split over
    tensor-parallel ranks)."""
    from kvstrata.bench.tiny_dsa import save_tiny_dsa, tiny_dsa_config

    return save_tiny_dsa(tiny_dsa_config(TINY_VOCAB, DSA_INDEX_TOPK, TINY_MAX_POS, heads=4),
                         str(tmp_path_factory.mktemp("tp_dsa") / "deepseek_v32"))


@pytest.fixture(scope="session")
def tiny_dsa_references(tiny_dsa_checkpoint, tiny_prompts, shared_tmp_dir) -> list:
    return shared_references(tiny_dsa_checkpoint, tiny_prompts, shared_tmp_dir)


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    from kvstrata.config.model_source import resolve_model_path

    try:
        return resolve_model_path("smollm2-135m").gguf_path
    except ValueError as e:
        pytest.skip(str(e))
