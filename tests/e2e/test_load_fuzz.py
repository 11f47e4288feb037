"""Concurrent random load: many clients at once send random requests (every route, valid and
a few invalid sampling values, streaming or not, n > 1, logprobs, stop strings, penalties,
logit_bias, cache salts, grammars, tools) and some hang up mid-way, against a server whose small KV pool
makes requests retract, evict and share prefixes. Properties: no 5xx and no error event inside a 200
stream; every 4xx carries the OpenAI error body; every finished answer has its n choices,
at most max_tokens tokens, a known finish reason and finite logprobs, a
grammar's answer that finished is in its language, and a tool call names an offered tool
with a JSON object of its schema; afterwards the server
is healthy and its KV pool whole.

The schema fuzz (test_schema_fuzz.py) sends one request at a time; this one is about
requests meeting each other. Bounded for `make test` (48 requests, 8 at a time);
KVSTRATA_FUZZ_EXAMPLES=N requests for a soak, KVSTRATA_FUZZ_SEED another draw, and
KVSTRATA_FUZZ_SERVER_ARGS another engine configuration (e.g. "--speculative-algorithm NGRAM").
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import shlex

import httpx
import pytest

from tests.e2e.server_utils import ServerProcess
from tests.e2e.test_routes_and_disconnect import wait_idle

REQUESTS = int(os.environ.get("KVSTRATA_FUZZ_EXAMPLES", "48"))
CONCURRENCY = 8
SEED = int(os.environ.get("KVSTRATA_FUZZ_SEED", "0"))
SERVER_ARGS = shlex.split(os.environ.get(
    "KVSTRATA_FUZZ_SERVER_ARGS", "--enable-hierarchical-cache --page-size 4"))
WORDS = "the cat sat on a mat and Paris is the capital of France hello world 1 2 3".split()
VOCAB = 49152  # the tiny checkpoint carries SmolLM2's tokenizer
FINISH = {"stop", "length", "abort"}


@pytest.fixture(scope="module")
def load_server(tiny_model_path):
    srv = ServerProcess(tiny_model_path, "--served-model-name", "tiny", "--context-length",
                        "256", "--max-total-tokens", "1024", "--chunked-prefill-size", "64",
                        "--tool-call-parser", "qwen25", *SERVER_ARGS)
    yield srv
    srv.stop()


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _sampling(rng: random.Random) -> dict:
    """OpenAI / SGLang sampling fields, mostly valid; top_k 0, an empty stop and the
    stop_regex "a(" are not."""
    choices = {
        "temperature": [0, 0.5, 1.0, 2.0, 1e-7, 100.0], "top_p": [1e-9, 0.1, 0.9, 1.0],
        "top_k": [-1, 1, 5, 100000, 0], "min_p": [0.0, 0.5, 1.0],
        "repetition_penalty": [1e-300, 0.5, 1.0, 2.0], "presence_penalty": [-2.0, 0.0, 2.0],
        "frequency_penalty": [-2.0, 2.0], "ignore_eos": [True, False],
        "stop": ["the", ["cat", "a"], ["\n"], "zzzz", [""]], "seed": [0, 7, 2 ** 40],
        "stop_regex": ["[0-9]", ["the|cat", "z+"], "a(", "(?i)PARIS"],
        "stop_token_ids": [[], [2], [rng.randrange(VOCAB)]],
        "logit_bias": [{str(rng.randrange(VOCAB)): rng.choice([-100, 5, 100])}],
    }
    return {k: rng.choice(v) for k, v in choices.items() if rng.random() < 0.25}


# Structured output on some requests: (field, grammar, what a finished answer must match).
_ANIMAL = {"type": "object", "x-guidance": {"whitespace_flexible": False},
           "properties": {"animal": {"enum": ["cat", "dog"]}, "n": {"type": "integer",
                                                                    "minimum": 0,
                                                                    "maximum": 99}},
           "required": ["animal", "n"], "additionalProperties": False}
GRAMMARS = [("regex", r"(yes|no)( (yes|no)){0,3}"),
            ("ebnf", 'root ::= "A" [0-9] [0-9]?'),
            ("json_schema", json.dumps(_ANIMAL))]
_MATCHES = {"regex": r"(yes|no)( (yes|no)){0,3}", "ebnf": r"A[0-9][0-9]?",
            "json_schema": r'\{"animal":"(cat|dog)","n":[0-9]{1,2}\}'}


def _grammar(rng: random.Random, route: str) -> dict:
    if rng.random() >= 0.2:
        return {}
    field, grammar = rng.choice(GRAMMARS)
    if field == "json_schema" and route != "generate" and rng.random() < 0.5:
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": "animal", "schema": _ANIMAL}}}
    return {field: grammar}


def _grammar_field(body: dict) -> str | None:
    sp = body.get("sampling_params", body)
    if body.get("response_format"):
        return "json_schema"
    return next((f for f in _MATCHES if f in sp), None)


# Tools on some chat requests (compact JSON: see _ANIMAL); a named unknown tool is a 400.
_TOOL = {"type": "function", "function": {"name": "count", "parameters": {
    "type": "object", "x-guidance": {"whitespace_flexible": False},
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
    "additionalProperties": False}}}
TOOL_CHOICES = ["auto", "required", "none", {"type": "function", "function": {"name": "count"}},
                {"type": "function", "function": {"name": "nope"}}]


def _tools(rng: random.Random) -> dict:
    if rng.random() >= 0.2:
        return {}
    body = {"tools": [_TOOL], "tool_choice": rng.choice(TOOL_CHOICES)}
    if rng.random() < 0.5:
        body["parallel_tool_calls"] = rng.choice([True, False])
    return body


def _responses_request(rng: random.Random) -> tuple[str, dict]:
    """/v1/responses: text or items, sometimes tools or a JSON schema, streamed or not."""
    body = {"model": "tiny", "max_output_tokens": rng.choice([1, 8, 30, 60]),
            "input": _text(rng, rng.randrange(1, 30)), "stream": rng.random() < 0.5}
    if rng.random() < 0.3:
        body["input"] = [{"role": "user", "content": body["input"]}]
    for name, value in (("temperature", [0, 1.0]), ("instructions", ["Be brief."]),
                        ("max_output_tokens", [0])):  # 0: a 400
        if rng.random() < 0.2:
            body[name] = rng.choice(value)
    tools = _tools(rng)
    if tools:
        body["tools"] = [{"type": "function", **_TOOL["function"]}]
        choice = tools["tool_choice"]
        body["tool_choice"] = choice if isinstance(choice, str) else {
            "type": "function", "name": choice["function"]["name"]}
    elif rng.random() < 0.1:
        body["text"] = {"format": {"type": "json_schema", "name": "a", "schema": _ANIMAL}}
    return "/v1/responses", body


def _request(rng: random.Random) -> tuple[str, dict]:
    route = rng.choice(["chat", "completions", "generate", "responses"])
    if route == "responses":
        return _responses_request(rng)
    max_tokens = rng.choice([1, 2, 8, 30, 60])
    stream = rng.random() < 0.5
    sp = {**_sampling(rng), **_grammar(rng, route)}
    # a tenant's cache salt on some: the same prompts under two salts and none
    salt = {"cache_salt": rng.choice(["t1", "t2"])} if rng.random() < 0.3 else {}
    if route == "generate":
        sp.pop("seed", None)
        body = {"text": _text(rng, rng.randrange(1, 40)), "stream": stream, **salt,
                "sampling_params": {**sp, "max_new_tokens": max_tokens}}
        if rng.random() < 0.2:  # parallel samples: a list back (with stream: a 400)
            body["sampling_params"]["n"] = rng.choice([2, 3])
        if rng.random() < 0.3:
            body.update(return_logprob=True, top_logprobs_num=rng.choice([0, 2]))
        return "/generate", body
    body = {"model": "tiny", "max_tokens": max_tokens, "n": rng.choice([1, 1, 2, 3]), **sp,
            **salt}
    if stream:
        body.update(stream=True, stream_options={"include_usage": rng.random() < 0.5})
    if rng.random() < 0.2:
        body["min_tokens"] = rng.choice([1, 5, 100])  # 100 > max_tokens: a 400
    if rng.random() < 0.2:
        body["return_token_ids"] = True
    if route == "chat":
        body["messages"] = [{"role": "user", "content": _text(rng, rng.randrange(1, 30))}]
        body.update(_tools(rng))
        if rng.random() < 0.3:
            body.update(logprobs=True, top_logprobs=rng.choice([0, 1, 5]))
        return "/v1/chat/completions", body
    body["prompt"] = (_text(rng, rng.randrange(1, 40)) if rng.random() < 0.8
                      else [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))])
    if rng.random() < 0.3:
        body["logprobs"] = rng.choice([0, 1, 5])
    return "/v1/completions", body


def _tool_calls_ok(choice: dict) -> bool:
    """finish_reason tool_calls means calls, and calls come with it (or with length: the
    last token closed them as max_tokens ran out; SGLang never rewrites length); each
    names the offered tool with its arguments."""
    calls = choice.get("message", {}).get("tool_calls")
    reason = choice["finish_reason"]
    if (reason == "tool_calls" and not calls) or (calls and reason not in ("tool_calls",
                                                                          "length")):
        return False
    for call in calls or []:
        args = json.loads(call["function"]["arguments"])
        if call["function"]["name"] != "count" or not isinstance(args, dict) or \
                set(args) - {"n"}:
            return False
    return True


def _finite_logprobs(obj) -> bool:
    """Every number under a logprob key is finite (JSON carries no infinities, and -9999.0
    stands in for -inf)."""
    if isinstance(obj, dict):
        return all(_finite_logprobs(v) for v in obj.values())
    if isinstance(obj, list):
        return all(_finite_logprobs(v) for v in obj)
    return not isinstance(obj, float) or math.isfinite(obj)


def _check_answer(path: str, body: dict, out: dict, problems: list) -> None:
    if path == "/v1/responses":
        calls = [i for i in out["output"] if i["type"] == "function_call"]
        if out["status"] not in ("completed", "incomplete") or out["usage"][
                "output_tokens"] > body["max_output_tokens"] or any(
                c["name"] != "count" for c in calls):
            problems.append(("bad response", body, out))
        return
    if path == "/generate":
        n = body["sampling_params"].get("n", 1)
        outs = out if n > 1 else [out]
        if not isinstance(outs, list) or len(outs) != n or any(
                o["meta_info"]["completion_tokens"] > body["sampling_params"]["max_new_tokens"]
                or o["meta_info"]["finish_reason"]["type"] not in FINISH for o in outs):
            problems.append(("bad answer", body, out))
            return
        done = [(o["meta_info"]["finish_reason"]["type"], o["text"]) for o in outs]
    else:
        finish = FINISH | ({"tool_calls"} if body.get("tools") else set())
        if len(out["choices"]) != body["n"] or out["usage"]["completion_tokens"] > \
                body["n"] * body["max_tokens"] or any(c["finish_reason"] not in finish
                                                      for c in out["choices"]):
            problems.append(("bad answer", body, out))
            return
        for c in out["choices"]:
            if not _tool_calls_ok(c):
                problems.append(("tool calls", body, c))
        done = [(c["finish_reason"], c["message"]["content"] if "message" in c else c["text"])
                for c in out["choices"]]
        if body.get("return_token_ids") and sum(len(c["token_ids"]) for c in out[
                "choices"]) != out["usage"]["completion_tokens"]:
            problems.append(("token_ids", body, out))
    # A grammar's finished answer is in its language (stop strings and stop ids may end it
    # early, so only answers without them are checked).
    field, sp = _grammar_field(body), body.get("sampling_params", body)
    if field is not None and not (sp.get("stop") or sp.get("stop_token_ids")
                                  or sp.get("stop_regex")):
        for reason, text in done:
            if reason == "stop" and not re.fullmatch(_MATCHES[field], text or ""):
                problems.append(("grammar", body, text))


async def _one(client: httpx.AsyncClient, rng: random.Random, stats: dict,
               problems: list) -> None:
    path, body = _request(rng)
    hang_up = rng.random() < 0.25
    if body.get("stream"):
        async with client.stream("POST", path, json=body) as r:
            stats[r.status_code] = stats.get(r.status_code, 0) + 1
            if r.status_code != 200:
                _check_error(r.status_code, await r.aread(), body, problems)
                return
            events = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events += 1
                if line == "data: [DONE]":
                    break
                event = json.loads(line[6:])
                if "error" in event or event.get("type") == "error" or \
                        not _finite_logprobs(event):
                    problems.append(("stream event", body, line[:300]))
                if event.get("type") in ("response.completed", "response.incomplete"):
                    break  # the Responses API's last event (it sends no [DONE])
                if hang_up and events >= rng.randrange(1, 5):
                    return
            else:
                problems.append(("stream without [DONE]", body, events))
        return
    try:
        r = await client.post(path, json=body,
                              timeout=rng.choice([0.02, 0.2]) if hang_up else 120)
    except httpx.TimeoutException:
        if not hang_up:
            raise
        stats["hung up"] = stats.get("hung up", 0) + 1
        return
    stats[r.status_code] = stats.get(r.status_code, 0) + 1
    if r.status_code != 200:
        _check_error(r.status_code, r.content, body, problems)
    elif not _finite_logprobs(r.json()):
        problems.append(("logprobs", body, r.text[:300]))
    else:
        _check_answer(path, body, r.json(), problems)


def _check_error(status: int, content: bytes, body: dict, problems: list) -> None:
    if status >= 500:
        problems.append((status, body, content[:300]))
        return
    error = json.loads(content).get("error", {})
    if set(error) != {"message", "type", "param", "code"}:
        problems.append(("error body", body, content[:300]))


async def _run(base: str, seed: int) -> tuple[dict, list]:
    rng = random.Random(seed)
    seeds = [rng.random() for _ in range(REQUESTS)]
    stats: dict = {}
    problems: list = []
    gate = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        async def task(s: float) -> None:
            async with gate:
                await _one(client, random.Random(s), stats, problems)
        await asyncio.gather(*(task(s) for s in seeds))
    return stats, problems


def test_concurrent_random_requests_leave_the_server_whole(load_server):
    stats, problems = asyncio.run(_run(load_server.base_url, SEED))
    print("load fuzz:", REQUESTS, "requests, seed", SEED, stats)
    assert not problems, problems[:5]
    assert stats.get(200, 0) >= REQUESTS // 3, stats
    assert httpx.get(load_server.base_url + "/health", timeout=10).status_code == 200
    state = wait_idle(load_server, timeout=60)
    assert state["ok"] and state["num_used_tokens"] == 0, state
