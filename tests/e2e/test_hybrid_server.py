"""A hybrid recurrent model served over HTTP: `kvstrata serve` on the tiny random Qwen3.5
(Gated DeltaNet + gated full attention, tests/helpers/hybrid_ckpt.py) answers
/v1/completions with transformers' greedy tokens (float32), a batch of prompts at once and a
second chat turn resuming at the snapshot its first turn left (the usage's cached tokens
say the hit happened). The engine-level cases (page sizes, chunks, retraction, aborts) are
tests/correctness/test_hybrid_engine.py; this is the served path on top: the launcher, the
scheduler process sizing the state pool from the loaded model, the OpenAI layer. One server
start."""
from __future__ import annotations

import httpx
import pytest
import torch

from helpers.hybrid_ckpt import VOCAB, HFGreedy, build_hybrid_checkpoint
from tests.e2e.server_utils import ServerProcess

NEW = 6
LENS = (29, 70)  # under a GDN 64-chunk, across it


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory) -> str:
    return build_hybrid_checkpoint("qwen3_5", str(tmp_path_factory.mktemp("hybrid_srv") / "q"))


@pytest.fixture(scope="module")
def served(qwen3_5):
    """The server and transformers' reference, the reference loaded while the server starts."""
    srv = ServerProcess(qwen3_5, "--skip-tokenizer-init", "--served-model-name", "hybrid",
                        "--dtype", "float32", "--context-length", "512",
                        "--max-total-tokens", "2048", "--max-mamba-cache-size", "24",
                        wait=False)
    try:
        ref = HFGreedy(qwen3_5)
        srv.wait_healthy(120)
        yield srv, ref
    finally:
        srv.stop()


def complete(srv, prompt) -> dict:
    r = httpx.post(srv.base_url + "/v1/completions", timeout=60, json={
        "model": "hybrid", "prompt": prompt, "max_tokens": NEW, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_completions_equal_transformers_and_a_second_turn_hits(served):
    srv, ref = served
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENS]
    out = complete(srv, prompts)  # a batch: both prompts in one request
    answers = [c["token_ids"] for c in sorted(out["choices"], key=lambda c: c["index"])]
    for p, got in zip(prompts, answers):
        assert got == ref(p, NEW), f"{len(p)}-token prompt"
    # turn 2: turn 1 + its answer + a new message; no_buffer (page size 1) left the state
    # after prompt + answer[:-1] at turn 1's end, so that much of it is a hit
    for p, a in zip(prompts, answers):
        turn2 = p + a + [5, 6, 7]
        out = complete(srv, turn2)
        assert out["choices"][0]["token_ids"] == ref(turn2, NEW), f"turn 2 of {len(p)}"
        cached = out["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        assert cached == len(p) + len(a) - 1, out["usage"]
    info = httpx.get(srv.base_url + "/server_info", timeout=10).json()
    assert info["max_mamba_cache_size"] == 24 and info["max_running_requests"] == 8
