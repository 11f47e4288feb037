"""The OpenAI-compatible routes through the official client, against a real server."""
from __future__ import annotations

import concurrent.futures as cf

import httpx
import openai
import pytest

GREEDY = {"temperature": 0.0}
NO_EOS = {"ignore_eos": True}


def test_models(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny"]
    card = client.models.retrieve("tiny")  # GET /v1/models/tiny
    assert card.id == "tiny" and card.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("org/other-model")
    assert e.value.body["code"] == "model_not_found"


def test_chat_non_streaming(client):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hello!"}],
        max_tokens=6, extra_body=NO_EOS, **GREEDY)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_chat_streaming_matches_non_streaming(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Count to five."}],
              max_tokens=12, extra_body=NO_EOS, **GREEDY)
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_continuous_usage_stats_on_every_chunk(client, route):
    """stream_options.continuous_usage_stats (vLLM's, with include_usage): every chunk carries
    its choice's usage so far, growing to the final count; without it, chunks carry null."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    kw = dict(model="tiny", max_tokens=6, stream=True, extra_body=NO_EOS, **GREEDY)
    if route == "chat":
        make = client.chat.completions.create
        kw["messages"] = [{"role": "user", "content": "Count to five."}]
    else:
        make = client.completions.create
        kw["prompt"] = "The quick brown fox"
    chunks = list(make(stream_options=opts, **kw))
    body, final = [c for c in chunks if c.choices], chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == 6
    done = [c.usage.completion_tokens for c in body]
    assert done == sorted(done) and done[-1] == 6 and len(set(done)) > 1
    assert all(c.usage.prompt_tokens == final.usage.prompt_tokens
               and c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
               for c in body)
    plain = list(make(stream_options={"include_usage": True}, **kw))
    assert all(c.usage is None for c in plain if c.choices)


def test_completion_streaming_and_not(client):
    kw = dict(model="tiny", prompt="The quick brown fox", max_tokens=10,
              extra_body=NO_EOS, **GREEDY)
    full = client.completions.create(**kw)
    assert full.usage.completion_tokens == 10 and full.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    assert streamed == full.choices[0].text


def test_completion_prompt_forms(client):
    ids = [504, 2365, 6354]
    r = client.completions.create(model="tiny", prompt=[ids, ids], max_tokens=3,
                                  extra_body=NO_EOS, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == r.choices[1].text  # same prompt, greedy
    r2 = client.completions.create(model="tiny", prompt=["a", "b c"], max_tokens=2, **GREEDY)
    assert len(r2.choices) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_is_trimmed(client, stream):
    kw = dict(model="tiny", prompt="Once upon a time", extra_body=NO_EOS, **GREEDY)
    text = client.completions.create(max_tokens=24, **kw).choices[0].text
    stop = text[12:15]
    expected = text[:text.find(stop)]
    if stream:
        chunks = list(client.completions.create(max_tokens=24, stop=[stop], stream=True, **kw))
        out = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = client.completions.create(max_tokens=24, stop=[stop], **kw)
        out, finish = r.choices[0].text, r.choices[0].finish_reason
    assert out == expected and finish == "stop"


def test_seed_reproducibility(client):
    kw = dict(model="tiny", prompt="Random words:", max_tokens=12, temperature=1.0,
              extra_body=NO_EOS)
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    c = client.completions.create(seed=4321, **kw).choices[0].text
    assert a == b
    assert a != c


def test_n_choices(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       n=3, max_tokens=4, seed=7, temperature=1.0,
                                       extra_body=NO_EOS)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 12


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=5, logprobs=True, top_logprobs=3,
                                       extra_body=NO_EOS, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        # greedy: the sampled token is the most likely one
        assert item.logprob == pytest.approx(max(t.logprob for t in item.top_logprobs), abs=1e-4)


def test_completion_echo_logprobs(client):
    r = client.completions.create(model="tiny", prompt="The capital of France is",
                                  max_tokens=1, echo=True, logprobs=1, extra_body=NO_EOS,
                                  **GREEDY)
    lp = r.choices[0].logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 1
    assert lp.token_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert r.choices[0].text.startswith("The capital of France is")
    # Harnesses check is_greedy on prompt tokens through top_logprobs: present for every
    # prompt token but the first, each holding the best alternative (>= the actual token).
    assert lp.top_logprobs[0] is None
    for actual, top in zip(lp.token_logprobs[1:n_prompt], lp.top_logprobs[1:n_prompt]):
        assert len(top) == 1 and max(top.values()) >= actual - 1e-5


def test_32_concurrent_requests(client):
    prompts = [f"Request number {i}:" for i in range(32)]

    def one(p):
        r = client.completions.create(model="tiny", prompt=p, max_tokens=8, extra_body=NO_EOS,
                                      **GREEDY)
        return r.choices[0].text, r.usage.completion_tokens

    with cf.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, prompts))
    assert all(n == 8 for _, n in results)
    # Batched answers equal the answers to the same prompts sent one at a time.
    for p, (text, _) in list(zip(prompts, results))[:4]:
        assert one(p)[0] == text


def test_native_generate(server):
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 5, "temperature": 0,
                                                 "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 2, "rid": "native-1",
            "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 42}
    r = httpx.post(server.base_url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["output_ids"]) == 5 and out["meta_info"]["id"] == "native-1"
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert len(out["meta_info"]["output_token_logprobs"]) == 5
    body.update(stream=True, rid="native-2")
    with httpx.stream("POST", server.base_url + "/generate", json=body, timeout=60) as s:
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    import json
    last = json.loads(lines[-2][6:])
    assert last["text"] == out["text"] and last["output_ids"] == out["output_ids"]


def test_logit_bias_steers_and_bans_tokens(client, server):
    """OpenAI's logit_bias (string token ids -> [-100, 100]): +100 forces a token, -100 bans
    the greedy answer's first token; the same through /generate's sampling_params."""
    base = client.completions.create(model="tiny", prompt="The capital of France is",
                                     max_tokens=3, logprobs=1, extra_body=NO_EOS, **GREEDY)
    first = base.choices[0].logprobs.tokens[0]
    r = httpx.post(server.base_url + "/generate", json={
        "text": "The capital of France is", "sampling_params": {
            "max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}, timeout=60).json()
    first_id = r["output_ids"][0]
    banned = client.completions.create(model="tiny", prompt="The capital of France is",
                                       max_tokens=3, logprobs=1, extra_body=NO_EOS,
                                       logit_bias={str(first_id): -100}, **GREEDY)
    assert banned.choices[0].logprobs.tokens[0] != first
    forced = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
        logit_bias={"1000": 100}, extra_body=NO_EOS, **GREEDY)
    native = httpx.post(server.base_url + "/generate", json={
        "text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0.8,
                                             "ignore_eos": True, "logit_bias": {"1000": 100}}},
        timeout=60).json()
    assert native["output_ids"] == [1000] * 4
    assert forced.choices[0].message.content == native["text"]
