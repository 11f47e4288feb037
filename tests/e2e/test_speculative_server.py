"""Real servers with --speculative-algorithm NGRAM and EAGLE (a tree draft: topk 2), through
the official openai client: greedy text (streamed and not, with a stop string) equals plain
decoding of the same model in this process, and the speculative counters reach meta_info,
/server_info and /metrics."""
from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from tests.e2e.server_utils import ServerProcess

TEXT = "one two three four five six seven eight nine ten " * 3
ARGS = ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5",
        "--max-total-tokens", "4096", "--context-length", "512")


@pytest.fixture(scope="module")
def spec_server(tiny_model_path):
    srv = ServerProcess(tiny_model_path, "--served-model-name", "tiny", *ARGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def plain(tiny_model_path):
    from kvstrata import LLM
    return LLM(model_path=tiny_model_path, max_total_tokens=4096, context_length=512)


def test_greedy_text_equals_plain_streamed_or_not(spec_server, plain):
    client = openai.OpenAI(base_url=spec_server.base_url + "/v1", api_key="none",
                           max_retries=0, timeout=120)
    want = plain.generate(TEXT, {"max_new_tokens": 48, "temperature": 0,
                                 "ignore_eos": True})["text"]
    for _ in range(2):  # the second time the n-gram cache knows the answer
        got = client.completions.create(model="tiny", prompt=TEXT, max_tokens=48,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert got.choices[0].text == want
    stream = client.completions.create(model="tiny", prompt=TEXT, max_tokens=48,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream) == want
    # A stop string inside what is now an accepted run cuts the text where plain does.
    words = want.split()
    stop = next((w for w in words[3:] if len(w) > 2), None)
    if stop is not None:
        want_stop = plain.generate(TEXT, {"max_new_tokens": 48, "temperature": 0,
                                          "ignore_eos": True, "stop": [stop]})["text"]
        got = client.completions.create(model="tiny", prompt=TEXT, max_tokens=48,
                                        temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == want_stop
    # logit_bias reaches verification: the biased answer equals plain decoding's (LLM()).
    first = plain.generate(TEXT, {"max_new_tokens": 1, "temperature": 0})["output_ids"][0]
    bias = {str(first): -100, "1000": 3.5}
    want_bias = plain.generate(TEXT, {"max_new_tokens": 48, "temperature": 0,
                                      "ignore_eos": True, "logit_bias": bias})["text"]
    got = client.completions.create(model="tiny", prompt=TEXT, max_tokens=48, temperature=0,
                                    logit_bias=bias, extra_body={"ignore_eos": True})
    assert got.choices[0].text == want_bias != want


def test_counters_reach_meta_info_server_info_and_metrics(spec_server):
    url = spec_server.base_url
    r = httpx.post(url + "/generate", timeout=60, json={
        "text": TEXT, "sampling_params": {"max_new_tokens": 32, "temperature": 0,
                                          "ignore_eos": True}})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["spec_verify_ct"] > 0
    assert meta["spec_accept_length"] >= 1.0
    assert 0 <= meta["spec_accept_token_num"] <= meta["spec_draft_token_num"]
    info = httpx.get(url + "/server_info", timeout=30).json()
    assert info["speculative_algorithm"] == "NGRAM"
    assert info["speculative_num_draft_tokens"] == 5
    state = info["internal_states"][0]
    assert state["avg_spec_accept_length"] >= 1.0 and state["spec_verify_steps"] > 0
    httpx.get(url + "/get_load", timeout=30)  # a fresh load report feeds /metrics
    metrics = httpx.get(url + "/metrics", timeout=30).text
    assert "kvstrata:spec_accept_length{" in metrics
    assert "kvstrata:spec_verify_steps_total{" in metrics


def test_a_draft_with_another_vocabulary_is_refused_naming_the_flag(tiny_model_path,
                                                                    tiny_checkpoints):
    """STANDALONE's draft must share the target's tokenizer: a 49152-token draft for a
    300-token target is refused at start, naming the flag (no server comes up half-built)."""
    from kvstrata import LLM

    with pytest.raises(ValueError, match=r"--speculative-draft-model-path .*vocabulary "
                                         r"\(49152 tokens\) differs from the target's \(300\)"):
        LLM(model_path=tiny_checkpoints["llama"], skip_tokenizer_init=True,
            max_total_tokens=1024, speculative_algorithm="STANDALONE",
            speculative_draft_model_path=tiny_model_path)


# Drafts in every step (--speculative-disable-by-batch-size): the measured gate would stop a
# random head from drafting once it has timed it (rho >= 1 here), as it should, and this test
# is about exactness with tree drafts over HTTP.
EAGLE_ARGS = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
              "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6",
              "--speculative-disable-by-batch-size", "64",
              "--max-total-tokens", "4096", "--context-length", "512")


@pytest.fixture(scope="module")
def eagle_server(tiny_model_path, tmp_path_factory):
    from helpers.eagle_heads import random_head

    head, _, _ = random_head(tiny_model_path, str(tmp_path_factory.mktemp("eagle") / "head"))
    srv = ServerProcess(tiny_model_path, "--served-model-name", "tiny",
                        "--speculative-draft-model-path", head, *EAGLE_ARGS)
    yield srv
    srv.stop()


def test_eagle_tree_server_equals_plain(eagle_server, plain):
    """EAGLE over HTTP (chat and completions, streamed and not): a random head's tree drafts
    are mostly rejected, yet every text equals plain greedy decoding, and the verify
    counters say drafting ran."""
    client = openai.OpenAI(base_url=eagle_server.base_url + "/v1", api_key="none",
                           max_retries=0, timeout=120)
    want = plain.generate(TEXT, {"max_new_tokens": 40, "temperature": 0,
                                 "ignore_eos": True})["text"]
    got = client.completions.create(model="tiny", prompt=TEXT, max_tokens=40, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == want
    stream = client.completions.create(model="tiny", prompt=TEXT, max_tokens=40,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream) == want
    messages = [{"role": "user", "content": "Count with me: one two three"}]
    ids = plain.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                              tokenize=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    want_chat = plain.generate(input_ids=ids, sampling_params={
        "max_new_tokens": 24, "temperature": 0, "ignore_eos": True})["text"]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == want_chat
    r = httpx.post(eagle_server.base_url + "/generate", timeout=60, json={
        "text": TEXT, "sampling_params": {"max_new_tokens": 16, "temperature": 0,
                                          "ignore_eos": True}})
    meta = r.json()["meta_info"]
    assert meta["spec_verify_ct"] > 0 and meta["spec_draft_token_num"] > 0
    info = httpx.get(eagle_server.base_url + "/server_info", timeout=30).json()
    assert info["speculative_algorithm"] == "EAGLE"
    assert (info["speculative_eagle_topk"], info["speculative_num_draft_tokens"]) == (2, 6)


# Structured output under speculation: verification walks the drafts through the grammar
# (each position masked after the tokens accepted before it), so the answer is plain
# constrained decoding's; drafts outside the grammar are simply rejected.
WORDS = r"( (one|two|three|four|five|six|seven|eight|nine|ten)){3,30}"


@pytest.mark.parametrize("which", ["ngram", "eagle"])
def test_grammar_under_speculation_equals_plain(request, plain, which):
    from tests.e2e.test_structured_output import PET, _check_pet

    srv = request.getfixturevalue("spec_server" if which == "ngram" else "eagle_server")
    for params in ({"regex": WORDS}, {"json_schema": json.dumps(PET)}):
        sp = {"max_new_tokens": 60, "temperature": 0, **params}
        want = plain.generate(TEXT, sp)
        r = httpx.post(srv.base_url + "/generate", timeout=60,
                       json={"text": TEXT, "sampling_params": sp})
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["text"] == want["text"], (got["text"], want["text"])
        assert got["meta_info"]["spec_verify_ct"] > 0
        if "regex" in params:
            assert re.fullmatch(WORDS, got["text"]), got["text"]
            if which == "ngram":  # the n-gram cache knows the words: some drafts pass
                assert got["meta_info"]["spec_accept_token_num"] > 0, got["meta_info"]
        else:
            _check_pet(got["text"])
