"""Structured output through the server (the shared tiny server: random weights, SmolLM2's
tokenizer): whatever the model would say, the answer is in the grammar's language. The
official openai client's response_format, SGLang's regex / ebnf extras and /generate's
sampling_params, streamed and not, sampled and greedy; a grammar past the limits is a 400
naming its field and the server goes on."""
from __future__ import annotations

import json
import re

import httpx
import pytest

CHAT, COMP, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
MSG = [{"role": "user", "content": "Describe a pet."}]
# Compact JSON ("x-guidance" is llguidance's per-schema option): a random model under the
# default (any whitespace between tokens) would mostly draw whitespace.
PET = {"type": "object", "x-guidance": {"whitespace_flexible": False},
       "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer",
                                                                 "minimum": 0,
                                                                 "maximum": 8},
                      "vaccinated": {"type": "boolean"}},
       "required": ["kind", "legs", "vaccinated"], "additionalProperties": False}


def _check_pet(text: str) -> None:
    pet = json.loads(text)
    assert set(pet) == {"kind", "legs", "vaccinated"}, text
    assert pet["kind"] in ("cat", "dog") and 0 <= pet["legs"] <= 8, text
    assert isinstance(pet["vaccinated"], bool), text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_openai_client_json_schema(client, temperature):
    for seed in range(3):
        r = client.chat.completions.create(
            model="tiny", messages=MSG, max_tokens=120, temperature=temperature, seed=seed,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "pet", "schema": PET, "strict": True}})
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        _check_pet(choice.message.content)


def test_json_object_starts_an_object(client):
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=8,
                                       temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].message.content.lstrip().startswith("{"), r.choices[0]


def test_completions_regex_and_stream(server):
    pattern = r"(red|green|blue)-[0-9]{3}"
    body = {"model": "tiny", "prompt": "A colour code:", "max_tokens": 30, "regex": pattern,
            "temperature": 1.0, "n": 3, "seed": 4}
    r = httpx.post(server.base_url + COMP, json=body, timeout=60)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop" and re.fullmatch(pattern, choice["text"])
    with httpx.stream("POST", server.base_url + COMP, json={**body, "n": 1, "stream": True},
                      timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert re.fullmatch(pattern, text), text


def test_generate_sampling_params_grammars(server):
    cases = [({"ebnf": 'root ::= "Answer: " ("yes" | "no") "."'},
              lambda t: t in ("Answer: yes.", "Answer: no.")),
             ({"regex": r"[A-Z][a-z]{2,5}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,5}", t)),
             ({"json_schema": json.dumps(PET)}, lambda t: _check_pet(t) is None)]
    for params, ok in cases:
        body = {"text": ["Say something.", "Another one."],
                "sampling_params": {"max_new_tokens": 120, "temperature": 0.8, **params}}
        r = httpx.post(server.base_url + GEN, json=body, timeout=60)
        assert r.status_code == 200, r.text
        for out in r.json():
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out
            assert ok(out["text"]), out["text"]


def test_grammar_past_the_limits_is_a_400_and_the_server_goes_on(server, client):
    # valid syntax, but its lexer grows past llguidance's limits with this vocabulary: refused
    # before compiling (it failed mid-answer), naming the field (issue 59)
    body = {"model": "tiny", "prompt": "x", "max_tokens": 8, "regex": "(a{1000}){1000}"}
    r = httpx.post(server.base_url + COMP, json=body, timeout=120)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "regex" and "too complex" in err["message"], err
    r = client.completions.create(model="tiny", prompt="x", max_tokens=3,
                                  extra_body={"regex": "ok"})
    assert r.choices[0].text == "ok"


def test_structural_tag_response_format(server):
    """SGLang's structural tag: free text, and any call it makes follows the schema."""
    tag = {"type": "structural_tag", "triggers": ["<function="], "structures": [
        {"begin": "<function=pet>", "schema": PET, "end": "</function>"}]}
    r = httpx.post(server.base_url + CHAT, timeout=60, json={
        "model": "tiny", "messages": MSG, "max_tokens": 40, "temperature": 1.0, "seed": 1,
        "response_format": tag})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    for call in re.findall(r"<function=pet>(.*?)</function>", text):
        _check_pet(call)


def test_vllm_structured_outputs(client):
    """vLLM's extra field: choice, json (a schema object)."""
    r = client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=10, temperature=1.0, seed=3, n=3,
        extra_body={"structured_outputs": {"choice": ["positive", "negative", "neutral"]}})
    assert {c.message.content for c in r.choices} <= {"positive", "negative", "neutral"}
    assert all(c.finish_reason == "stop" for c in r.choices)
    r = client.completions.create(model="tiny", prompt="A pet:", max_tokens=120,
                                  temperature=0, extra_body={"structured_outputs": {
                                      "json": PET}})
    _check_pet(r.choices[0].text)


def test_grammars_survive_retraction_in_process(tiny_model_path):
    """A pool too small for the batch retracts requests; each comes back with its output,
    which its new matcher replays: every answer equals the one from a pool large enough,
    and stays in the language. (In-process LLM(): it needs the tiny checkpoint built here.)"""
    from kvstrata import LLM

    words = r"(alpha|beta|gamma|delta)( (alpha|beta|gamma|delta)){30,60}\."
    prompts = [f"List {i} Greek letters:" + " x" * (3 * i) for i in range(6)]
    sp = [{"max_new_tokens": 140, "temperature": t, "seed": i, "regex": words}
          for i, t in enumerate([0, 0.7, 0, 1.0, 0, 0.5])]
    # admitting eagerly (a tiny reserve per running request) makes decode run out of pages
    small = LLM(model_path=tiny_model_path, max_total_tokens=256, page_size=4,
                chunked_prefill_size=16, schedule_conservativeness=0.05)
    got = small.generate(prompts, sp)
    assert small.engine.scheduler.num_retractions > 0
    small.engine.check_integrity()
    del small
    big = LLM(model_path=tiny_model_path, max_total_tokens=8192)
    want = big.generate(prompts, sp)
    for g, w in zip(got, want):
        assert g["output_ids"] == w["output_ids"]
        if g["meta_info"]["finish_reason"]["type"] == "stop":
            assert re.fullmatch(words, g["text"]), g["text"]


def test_a_grammar_as_the_first_request_of_a_fresh_server(tiny_model_path):
    """The scheduler loads its tokenizer on a thread after start-up; a grammar request at once
    built llguidance's tokenizer beside it, importing transformers twice at the same time,
    and the half-imported module's AttributeError killed the scheduler. It now uses the
    engine's tokenizer. No step waited for the compile (/debug/grammar)."""
    from tests.e2e.server_utils import ServerProcess

    srv = ServerProcess(tiny_model_path, "--served-model-name", "tiny",
                        "--max-total-tokens", "2048", "--context-length", "256",
                        env={"KVSTRATA_SCHEDULER_EAGER_TOKENIZER": "1"})
    try:
        r = httpx.post(srv.base_url + GEN, timeout=120, json={
            "text": "x", "sampling_params": {"max_new_tokens": 8, "regex": "(yes|no)"}})
        assert r.status_code == 200 and r.json()["text"] in ("yes", "no"), r.text
        # one rank; the scheduler held the request until its compile was done (TP:
        # tests/e2e/test_tp_server.py)
        assert httpx.get(srv.base_url + "/debug/grammar", timeout=30).json() == {
            "ranks": [{"compiles_started": 1, "compiles_late": 0}]}
    finally:
        srv.stop()
