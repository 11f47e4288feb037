"""The engine on a CUDA GPU against transformers' greedy generate on CPU (the suite's shared
fp32 references): kvstrata.LLM with --device cuda, fp32 with TF32 off, batched and with the
prefix cache, pools intact after. Runs with `make test-cuda` (KVSTRATA_TEST_CUDA=1 keeps the
GPU visible; tests/conftest.py hides it from the CPU suite) and skips without a GPU.
Not yet run as a test on a GPU: the same check by hand on an H200 (2026-12-04, SmolLM2's shapes
with random weights, fp32) gave greedy tokens equal to transformers on the GPU."""
from __future__ import annotations

import pytest
import torch

from helpers.compare import assert_tokens_match
from tests.conftest import GREEDY_TOKENS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (and KVSTRATA_TEST_CUDA=1)")
GREEDY = {"max_new_tokens": GREEDY_TOKENS, "min_new_tokens": GREEDY_TOKENS, "temperature": 0}


@pytest.fixture
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cuda_greedy_equals_transformers(arch, tiny_checkpoints, tiny_prompts, tiny_references,
                                         no_tf32):
    from kvstrata import LLM

    llm = LLM(model_path=tiny_checkpoints[arch], skip_tokenizer_init=True, device="cuda",
              dtype="float32", page_size=16, max_total_tokens=4096)
    try:
        assert llm.engine.runner.device.type == "cuda"
        for label in ("batched", "prefix-cached"):
            outs = llm.generate(input_ids=tiny_prompts, sampling_params=GREEDY)
            for i, (out, (ref_tokens, ref_logits)) in enumerate(zip(outs, tiny_references[arch])):
                assert_tokens_match(out["output_ids"], ref_tokens, ref_logits,
                                    label=f"{arch} cuda {label} prompt {i}")
        assert any(o["meta_info"]["cached_tokens"] for o in outs)
        llm.check_integrity()
    finally:
        llm.shutdown()
