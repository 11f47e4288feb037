"""SGLang's own request fields: the bodies sglang-router 0.3.2 sends are accepted as they are,
and the fields kvstrata implements do what they do in SGLang."""
from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.e2e.test_sglang_router import finished_requests

CHAT, COMP, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
NO_EOS = {"ignore_eos": True}

# Exactly what sglang-router 0.3.2 forwarded for a plain request (captured from the router).
ROUTER_BODIES = [
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "model": "tiny", "logprobs": False,
            "max_completion_tokens": 4, "stream": False, "no_stop_trim": False,
            "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
            "separate_reasoning": True, "stream_reasoning": True,
            "return_hidden_states": False}),
    (COMP, {"model": "tiny", "prompt": "hi", "max_tokens": 4, "stream": False, "echo": False,
            "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
            "return_hidden_states": False}),
    (GEN, {"text": "hi", "model": None, "sampling_params": {"max_new_tokens": 4, "n": 1},
           "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
           "return_hidden_states": False, "background": False, "no_logs": False,
           "return_bytes": False, "return_entropy": False}),
]


@pytest.mark.parametrize("path,body", ROUTER_BODIES, ids=["chat", "completions", "generate"])
def test_router_bodies_are_accepted(server, path, body):
    r = httpx.post(server.base_url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text


# Explicit "off" values clients and agent frameworks send with every request.
DEFAULT_OFF_BODIES = [
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "response_format": {"type": "text"}, "tools": [], "tool_choice": "auto",
            "functions": []}),
    (COMP, {"prompt": "hi", "max_tokens": 2, "response_format": {"type": "text"}}),
]


@pytest.mark.parametrize("path,body", DEFAULT_OFF_BODIES, ids=["chat", "completions"])
def test_explicit_off_values_are_accepted_and_on_values_refused(server, path, body):
    r = httpx.post(server.base_url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    for name, on in (("response_format", {"type": "yaml"}),
                     ("functions", [{"name": "f"}])):
        if name in body:
            r = httpx.post(server.base_url + path, json={**body, name: on}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def _post(server, path, body) -> dict:
    r = httpx.post(server.base_url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _stream_text(server, body) -> str:
    with httpx.stream("POST", server.base_url + COMP, json={**body, "stream": True},
                      timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


def test_no_stop_trim_keeps_the_stop_string(server):
    base = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 24,
            "temperature": 0, **NO_EOS}
    full = _post(server, COMP, base)["choices"][0]["text"]
    stop = full[12:15]
    cut = full[:full.find(stop)]
    kept = _post(server, COMP, {**base, "stop": [stop], "no_stop_trim": True})["choices"][0]
    assert kept["finish_reason"] == "stop"
    # Everything up to the end of the token that completed the stop string.
    assert kept["text"].startswith(cut + stop) and full.startswith(kept["text"])
    assert _stream_text(server, {**base, "stop": [stop], "no_stop_trim": True}) == kept["text"]
    trimmed = _post(server, COMP, {**base, "stop": [stop]})["choices"][0]["text"]
    assert trimmed == cut


def test_stop_regex_stops_where_the_output_first_matches(server, tokenizer):
    """SGLang's stop_regex: the answer ends with the token that completes the first match;
    the match stays in the text; finish_reason stop, `matched` the pattern (/generate)."""
    base = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 24,
            "temperature": 0, **NO_EOS}
    full = _post(server, COMP, base)
    ids = _post(server, GEN, {"text": "Once upon a time", "sampling_params": {
        "max_new_tokens": 24, "temperature": 0, **NO_EOS}})["output_ids"]
    text = full["choices"][0]["text"]
    word = next(w for w in text[6:].split() if len(w) > 1 and w.isalpha())
    pattern = rf"{word[0]}[a-z]*{word[-1]}\b" if len(word) > 1 else word
    # where plain decoding first matches, token by token
    want = next(n for n in range(1, len(ids) + 1)
                if re.search(pattern, tokenizer.decode(ids[:n], skip_special_tokens=True)))
    got = _post(server, COMP, {**base, "stop_regex": [pattern, "zzzz+"]})["choices"][0]
    assert got["finish_reason"] == "stop"
    assert got["text"] == tokenizer.decode(ids[:want], skip_special_tokens=True)
    assert _stream_text(server, {**base, "stop_regex": pattern}) == got["text"]
    gen = _post(server, GEN, {"text": "Once upon a time", "sampling_params": {
        "max_new_tokens": 24, "temperature": 0, "stop_regex": pattern, **NO_EOS}})
    assert gen["output_ids"] == ids[:want]
    assert gen["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}


def test_continue_final_message_continues_the_assistant_text(server, tokenizer):
    user = {"role": "user", "content": "Tell me a story."}
    prefix = "Once upon a time"
    chat = _post(server, CHAT, {"messages": [user, {"role": "assistant", "content": prefix}],
                                "continue_final_message": True, "max_tokens": 6,
                                "temperature": 0, **NO_EOS})
    ids = tokenizer.encode(tokenizer.apply_chat_template([user], tokenize=False,
                                                         add_generation_prompt=True),
                           add_special_tokens=False)
    ids += tokenizer.encode(prefix, add_special_tokens=False)
    native = _post(server, GEN, {"input_ids": ids, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, **NO_EOS}})
    assert chat["usage"]["prompt_tokens"] == len(ids)
    assert chat["choices"][0]["message"]["content"] == native["text"]


def test_chat_input_ids_bypass_the_template(server):
    ids = [1, 2, 3, 4, 5]
    chat = _post(server, CHAT, {"messages": [{"role": "user", "content": "ignored"}],
                                "input_ids": ids, "max_tokens": 5, "temperature": 0,
                                "chat_template_kwargs": {"enable_thinking": False}, **NO_EOS})
    native = _post(server, GEN, {"input_ids": ids, "sampling_params": {
        "max_new_tokens": 5, "temperature": 0, **NO_EOS}})
    assert chat["usage"]["prompt_tokens"] == len(ids)
    assert chat["choices"][0]["message"]["content"] == native["text"]


def test_return_text_in_logprobs(server, tokenizer):
    body = {"text": "Hello", "return_logprob": True, "top_logprobs_num": 2,
            "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 4, **NO_EOS}}
    plain = _post(server, GEN, body)["meta_info"]
    assert all(entry[2] is None for entry in plain["output_token_logprobs"])
    meta = _post(server, GEN, {**body, "return_text_in_logprobs": True})["meta_info"]
    for entry in meta["output_token_logprobs"] + meta["input_token_logprobs"]:
        assert entry[2] == tokenizer.decode([entry[1]])
    for top in meta["output_top_logprobs"]:
        assert all(t[2] == tokenizer.decode([t[1]]) for t in top)


def test_log_metrics_false_keeps_a_request_out_of_metrics(server):
    body = {"text": "x", "sampling_params": {"max_new_tokens": 2}}
    before = finished_requests(server.base_url)
    _post(server, GEN, {**body, "log_metrics": False})
    assert finished_requests(server.base_url) == before
    _post(server, GEN, body)
    assert finished_requests(server.base_url) == before + 1


def test_sampling_seed_is_seed(server):
    def text(params):
        return _post(server, GEN, {"text": "Random words:", "sampling_params": {
            "max_new_tokens": 8, "temperature": 1.0, **NO_EOS, **params}})["text"]
    assert text({"sampling_seed": 77}) == text({"seed": 77})
    assert text({"sampling_seed": 77}) != text({"sampling_seed": 78})


def test_string_rid_prefixes_a_batch(server):
    out = _post(server, GEN, {"text": ["a", "b"], "rid": "batch",
                              "sampling_params": {"max_new_tokens": 2}})
    assert [o["meta_info"]["id"] for o in out] == ["batch_0", "batch_1"]


def test_parallel_samples_n_expand_like_sglang(server):
    """sampling_params.n (SGLang's parallel sampling): a single prompt answers a list of n;
    a batch answers its prompts repeated n times in order (p0, p1, p0, p1); a seeded prompt's
    copies draw with seed + j (so they differ, and copy j equals a lone call with seed + j);
    a string rid prefixes every id."""
    params = {"max_new_tokens": 6, "temperature": 1.0, **NO_EOS}
    out = _post(server, GEN, {"text": "Random words:", "rid": "par",
                              "sampling_params": {**params, "n": 3, "sampling_seed": 40}})
    assert isinstance(out, list) and len(out) == 3
    assert [o["meta_info"]["id"] for o in out] == ["par_0", "par_1", "par_2"]
    for j, o in enumerate(out):
        alone = _post(server, GEN, {"text": "Random words:",
                                    "sampling_params": {**params, "seed": 40 + j}})
        assert o["output_ids"] == alone["output_ids"] and len(o["output_ids"]) == 6
    assert len({tuple(o["output_ids"]) for o in out}) > 1
    greedy = {"max_new_tokens": 4, "temperature": 0, **NO_EOS}
    batch = _post(server, GEN, {"input_ids": [[5, 6, 7], [8, 9]],
                                "sampling_params": [{**greedy, "n": 2}, {**greedy, "n": 2,
                                                                         "max_new_tokens": 2}]})
    assert [len(o["output_ids"]) for o in batch] == [4, 2, 4, 2]
    assert batch[0]["output_ids"] == batch[2]["output_ids"]
    assert _post(server, GEN, {"text": "x", "sampling_params": {"n": 1,
                                                                "max_new_tokens": 1}})["text"]


def test_cache_salt_and_extra_key_separate_the_prefix_cache(server):
    """SGLang's cache_salt / extra_key (joined, as SGLang joins them; vLLM's cache_salt):
    a prompt cached under one salt is a miss under another and without one, and a hit
    under the same; the answers are the same whatever the salt."""
    text = "A prompt long enough to fill several pages of the prefix cache: " * 3

    def gen(**salt):
        out = _post(server, GEN, {"text": text, **salt, "sampling_params": {
            "max_new_tokens": 3, "temperature": 0, **NO_EOS}})
        return out["meta_info"]["cached_tokens"], out["output_ids"]

    def chat(**salt):
        r = _post(server, CHAT, {"messages": [{"role": "user", "content": text}],
                                 "max_tokens": 2, "temperature": 0, **salt})
        return (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    first, want = gen(cache_salt="salt-test-1")
    assert first == 0
    assert gen(cache_salt="salt-test-2") == (0, want)
    hit, again = gen(cache_salt="salt-test-1")
    assert hit > 0 and again == want
    assert gen(extra_key="-1", cache_salt="salt-test")[0] == hit  # "salt-test" + "-1"
    assert chat(extra_key="salt-test-chat") == 0
    assert chat(extra_key="salt-test-chat") > 0
    assert chat(cache_salt="salt-test-chat-2") == 0
    batch = _post(server, GEN, {"text": [text, text], "cache_salt": ["salt-test-1", "x9"],
                                "sampling_params": {"max_new_tokens": 1}})
    assert batch[0]["meta_info"]["cached_tokens"] == hit
    assert batch[1]["meta_info"]["cached_tokens"] == 0
    r = httpx.post(server.base_url + CHAT, json={"messages": [{"role": "user", "content": "x"}],
                                                 "cache_salt": ["a", "b"]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_per_request_stream_interval(server):
    """SGLang's sampling_params.stream_interval: this request streams every 4 tokens (the
    first at once, the rest at the finish) whatever the server's --stream-interval."""
    body = {"text": "Count:", "stream": True, "sampling_params": {
        "max_new_tokens": 10, "temperature": 0, "stream_interval": 4, **NO_EOS}}
    with httpx.stream("POST", server.base_url + GEN, json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert [len(e["output_ids"]) for e in events] == [1, 5, 9, 10]


def test_token_ids_logprob_reports_the_asked_ids(server):
    """SGLang's token_ids_logprob: the logprobs of the asked ids at every output position
    (output_token_ids_logprobs) and prompt position (input_token_ids_logprobs, with
    logprob_start_len), in the asked order, beside an unchanged top-n; a batch may ask a list
    per prompt."""
    probe = _post(server, GEN, {"text": "The capital of France is", "return_logprob": True,
                                "top_logprobs_num": 3, "sampling_params": {
                                    "max_new_tokens": 3, "temperature": 0, **NO_EOS}})
    top_id = probe["meta_info"]["output_top_logprobs"][0][1][1]  # the second most likely
    asked = [top_id, 17, 4000]
    out = _post(server, GEN, {"text": "The capital of France is", "return_logprob": True,
                              "top_logprobs_num": 3, "token_ids_logprob": asked,
                              "logprob_start_len": 0, "sampling_params": {
                                  "max_new_tokens": 3, "temperature": 0, **NO_EOS}})
    meta = out["meta_info"]
    assert out["output_ids"] == probe["output_ids"]
    # the same top-n (ids, and values up to float noise: the probe's prompt KV may come from
    # the prefix cache, computed in other chunks; this request's prompt is recomputed)
    for got, want in zip(meta["output_top_logprobs"], probe["meta_info"]["output_top_logprobs"]):
        assert [t for _, t, _ in got] == [t for _, t, _ in want]
        assert [v for v, _, _ in got] == pytest.approx([v for v, _, _ in want], abs=1e-4)
    rows = meta["output_token_ids_logprobs"]
    assert len(rows) == 3 and all([t for _, t, _ in row] == asked for row in rows)
    assert rows[0][0][0] == pytest.approx(meta["output_top_logprobs"][0][1][0], abs=1e-6)
    assert all(lp <= 0 for row in rows for lp, _, _ in row)
    prompt = meta["input_token_ids_logprobs"]
    assert prompt[0] is None and len(prompt) == meta["prompt_tokens"]
    assert all([t for _, t, _ in row] == asked for row in prompt[1:])
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"][1]) == 3
    batch = _post(server, GEN, {"text": ["a b", "c d"], "return_logprob": True,
                                "token_ids_logprob": [[5], [6, 7]],
                                "sampling_params": {"max_new_tokens": 2}})
    assert [[t for _, t, _ in b["meta_info"]["output_token_ids_logprobs"][0]]
            for b in batch] == [[5], [6, 7]]
    assert batch[0]["meta_info"]["output_top_logprobs"] == [[], []]  # top-n 0: as before
    for body in ({"text": "x", "token_ids_logprob": [5]},
                 {"text": "x", "return_logprob": True, "token_ids_logprob": [10 ** 7]},
                 {"text": "x", "return_logprob": True, "token_ids_logprob": [[5]]}):
        r = httpx.post(server.base_url + GEN, json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "token_ids_logprob", r.text


def test_return_token_ids_as_vllm(server, tokenizer):
    """vLLM's return_token_ids: chat answers carry prompt_token_ids (top level) and each
    choice its token_ids; completions carry both per choice; streams carry each chunk's new
    ids and the prompt's ids once, and add up to the non-streamed ones."""
    msgs = [{"role": "user", "content": "Name a colour."}]
    chat = _post(server, CHAT, {"messages": msgs, "max_tokens": 6, "temperature": 0,
                                "return_token_ids": True, **NO_EOS})
    want_prompt = tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                tokenize=True)
    want_prompt = want_prompt if isinstance(want_prompt, list) else want_prompt["input_ids"]
    assert chat["prompt_token_ids"] == want_prompt
    ids = chat["choices"][0]["token_ids"]
    assert len(ids) == 6 and tokenizer.decode(ids) == chat["choices"][0]["message"]["content"]
    assert "token_ids" not in _post(server, CHAT, {"messages": msgs, "max_tokens": 2})[
        "choices"][0]
    with httpx.stream("POST", server.base_url + CHAT, timeout=60, json={
            "messages": msgs, "max_tokens": 6, "temperature": 0, "return_token_ids": True,
            "stream": True, **NO_EOS}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert events[0]["prompt_token_ids"] == want_prompt
    assert sum((e["choices"][0].get("token_ids", []) for e in events), []) == ids
    body = {"prompt": ["Once upon", "A cat"], "max_tokens": 5, "temperature": 0,
            "return_token_ids": True, **NO_EOS}
    comp = _post(server, COMP, body)["choices"]
    for c, prompt in zip(comp, body["prompt"]):
        assert c["prompt_token_ids"] == tokenizer.encode(prompt, add_special_tokens=False) \
            or c["prompt_token_ids"] == tokenizer.encode(prompt)
        assert len(c["token_ids"]) == 5 and tokenizer.decode(c["token_ids"]) == c["text"]
    with httpx.stream("POST", server.base_url + COMP, json={**body, "stream": True},
                      timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    for c in comp:
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == c["index"]]
        assert mine[0]["prompt_token_ids"] == c["prompt_token_ids"]
        assert sum((m["token_ids"] for m in mine), []) == c["token_ids"]


def test_sglang_tito_fields_on_chat(server, tokenizer):
    """SGLang's return_prompt_token_ids / return_meta_info (chat, not streamed): each choice
    carries its prompt's ids and /generate's meta_info (with logprobs: output_token_logprobs
    whose ids are the answer's)."""
    msgs = [{"role": "user", "content": "Count to three."}]
    r = _post(server, CHAT, {"messages": msgs, "max_tokens": 5, "temperature": 0, "n": 2,
                             "logprobs": True, "return_prompt_token_ids": True,
                             "return_meta_info": True, "return_token_ids": True, **NO_EOS})
    want = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    want = want if isinstance(want, list) else want["input_ids"]
    for c in r["choices"]:
        assert c["prompt_token_ids"] == want
        meta = c["meta_info"]
        assert meta["prompt_tokens"] == len(want) and meta["completion_tokens"] == 5
        assert meta["finish_reason"] == {"type": "length", "length": 5}
        assert [t for _, t, _ in meta["output_token_logprobs"]] == c["token_ids"]
    for name in ("return_prompt_token_ids", "return_meta_info"):
        bad = httpx.post(server.base_url + CHAT, timeout=30, json={
            "messages": msgs, "max_tokens": 2, "stream": True, name: True})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == name, bad.text
