"""Fixtures: a tiny random-weight Llama checkpoint with the real SmolLM2 tokenizer (so the
server starts in seconds), and one shared server process for the API tests."""
from __future__ import annotations

import os
import shutil

import pytest

from tests.e2e.server_utils import ServerProcess

# Bump when the checkpoint recipe changes: the cached copy is rebuilt.
_TINY_VERSION = "v1"
_CACHE = os.path.expanduser(os.environ.get("KVSTRATA_TEST_CACHE", "~/.cache/kvstrata-tests"))
TINY_CONTEXT = 512


def build_tiny_llama(path: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvstrata.config.model_source import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path("smollm2-135m"))
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, torch_dtype="float32")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, path)


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from filelock import FileLock

    path = os.path.join(_CACHE, f"tiny-llama-smollm2-tok-{_TINY_VERSION}")
    os.makedirs(_CACHE, exist_ok=True)
    with FileLock(path + ".lock"):  # parallel test workers build it once
        if not os.path.isdir(path):
            build_tiny_llama(path)
    return path


@pytest.fixture(scope="session")
def server(tiny_model_path):
    # --abort-on-priority-when-disabled: a request that gives a priority is refused here
    # (test_priority_server.py checks the 503); no other test sends one. --tool-call-parser:
    # test_tool_calling.py reads answers to requests with tools (no other test sends tools);
    # --reasoning-parser: test_reasoning.py (random answers never open a thinking section).
    srv = ServerProcess(tiny_model_path, "--served-model-name", "tiny",
                        "--context-length", str(TINY_CONTEXT), "--max-total-tokens", "16384",
                        "--abort-on-priority-when-disabled", "--tool-call-parser", "qwen25",
                        "--reasoning-parser", "qwen3",
                        env={"KVSTRATA_MAX_REQUEST_BYTES": str(1 << 20),
                             # the default (tests/conftest.py turns it off elsewhere)
                             "KVSTRATA_SCHEDULER_EAGER_TOKENIZER": "1"})
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="session")
def tcp_prefill(tiny_model_path):
    """One plain tcp prefill server (tests/e2e/pd_servers.py's flags) for every PD pair of
    test_pd_disagg.py, test_pd_retraction.py and test_pd_decode_radix.py whose prefill has no
    flags of its own: those files differ in their decode servers only. tests/conftest.py's
    SERVER_GROUPS runs the three on one test worker, so it starts once per run. Pairs
    built on it stop only their decode servers; a test that kills the prefill restarts it
    on its ports through the pair, and each module's fixture revives it if a failed test
    left it dead."""
    from tests.e2e.pd_servers import PDServers

    servers = PDServers(tiny_model_path, "tcp", with_decode=False)
    try:
        yield servers
    finally:
        servers.stop()
