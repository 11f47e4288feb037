"""`--skip-tokenizer-init` on a server, as SGLang's token-in-token-out mode (RL trainers run
it): the model needs no tokenizer files, requests send token ids and get `output_ids` with
empty text, and whatever needs text (a text prompt, chat messages, stop strings) is a 400
naming the flag. Before, the server loaded a tokenizer anyway and died at start-up with a
traceback on a checkpoint without one."""
from __future__ import annotations

import os
import shutil

import httpx
import pytest

from tests.e2e.server_utils import ServerProcess

PROMPT = [5, 17, 42, 99, 7, 3]
SKIPPED = "the server was started with --skip-tokenizer-init"


@pytest.fixture(scope="module")
def bare_model(tiny_model_path, tmp_path_factory) -> str:
    """The tiny e2e llama without its tokenizer files (config, generation config, weights)."""
    path = str(tmp_path_factory.mktemp("no_tokenizer") / "tiny-llama")
    os.makedirs(path)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(os.path.join(tiny_model_path, name), path)
    return path


@pytest.fixture(scope="module")
def srv(bare_model):
    server = ServerProcess(bare_model, "--skip-tokenizer-init", "--served-model-name", "bare",
                           "--context-length", "512", "--max-total-tokens", "4096")
    yield server
    server.stop()


def _post(srv, route: str, body: dict) -> httpx.Response:
    return httpx.post(srv.base_url + route, json=body, timeout=60)


def test_token_ids_in_and_out_as_offline(srv, bare_model):
    from kvstrata import LLM

    with LLM(model_path=bare_model, skip_tokenizer_init=True, dtype="float32",
             context_length=512, max_total_tokens=4096) as llm:
        want = llm.generate(input_ids=PROMPT, sampling_params={
            "max_new_tokens": 8, "temperature": 0, "ignore_eos": True})["output_ids"]
    r = _post(srv, "/generate", {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == want and r.json()["text"] == ""
    r = _post(srv, "/v1/completions", {"model": "bare", "prompt": PROMPT, "max_tokens": 8,
                                       "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "" and r.json()["usage"]["completion_tokens"] == 8
    r = _post(srv, "/generate", {"input_ids": PROMPT, "return_logprob": True,
                                 "return_text_in_logprobs": True,
                                 "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert r.status_code == 200, r.text
    assert [entry[2] for entry in r.json()["meta_info"]["output_token_logprobs"]] == ["", ""]
    # chat with a pre-tokenised prompt bypasses the template (SGLang's input_ids)
    r = _post(srv, "/v1/chat/completions", {"model": "bare", "input_ids": PROMPT, "max_tokens": 3,
                                            "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == ""
    assert httpx.get(srv.base_url + "/health_generate", timeout=60).status_code == 200


@pytest.mark.parametrize("route,body,param", [
    ("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 2}}, None),
    ("/v1/completions", {"model": "bare", "prompt": "hello", "max_tokens": 2}, None),
    ("/v1/chat/completions", {"model": "bare", "max_tokens": 2,
                              "messages": [{"role": "user", "content": "hi"}]}, None),
    ("/v1/chat/completions", {"model": "bare", "max_tokens": 2, "stream": True,
                              "messages": [{"role": "user", "content": "hi"}]}, None),
    ("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2,
                                                            "stop": ["ab"]}}, "stop"),
    ("/v1/completions", {"model": "bare", "prompt": PROMPT, "max_tokens": 2, "stop": "x",
                         "stream": True}, "stop"),
    ("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2,
                                                            "stop_regex": "a+"}},
     "stop_regex"),
])
def test_text_needs_a_tokenizer(srv, route, body, param):
    r = _post(srv, route, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"].startswith(SKIPPED) and error["param"] == param, error
    # and the server serves on
    ok = _post(srv, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("route,body,param", [
    ("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2,
                                                            "regex": "a+"}},
     "sampling_params.regex"),
    ("/v1/completions", {"model": "bare", "prompt": PROMPT, "max_tokens": 2,
                         "response_format": {"type": "json_object"}}, "response_format")])
def test_structured_output_needs_the_tokenizer(srv, route, body, param):
    r = _post(srv, route, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "--skip-tokenizer-init" in error["message"] and error["param"] == param, error
