"""--reasoning-parser qwen3 on the shared tiny server (random weights): a client regex makes
the model write Qwen3's thinking section, which comes back as reasoning_content, streamed
and not (the stream adds up to the non-streamed answer); separate_reasoning false keeps it
in the content; with tools, the call after the section is read (the tool-call parser sees
only the content). A random answer without a section is untouched."""
from __future__ import annotations

import json

import httpx

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "What is the capital of France?"}]
THINKING = r"<think>\n(Hmm|Let me see)\.\n</think>\n\n(Paris|Rome)\."
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
THINK_THEN_CALL = (r'<think>\nA tool\.\n</think>\n\n<tool_call>\n\{"name": "get_weather", '
                   r'"arguments": \{"city": "(Paris|Rome)"\}\}\n</tool_call>')


def _post(server, **body) -> dict:
    r = httpx.post(server.base_url + CHAT, timeout=60,
                   json={"model": "tiny", "messages": MSG, "max_tokens": 40, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _stream(server, **body) -> tuple[str, str, list, str]:
    reasoning, content, calls, finish = "", "", [], None
    with httpx.stream("POST", server.base_url + CHAT, timeout=60, json={
            "model": "tiny", "messages": MSG, "max_tokens": 40, "stream": True,
            **body}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            delta = choice["delta"]
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            calls += delta.get("tool_calls") or []
            finish = choice["finish_reason"] or finish
    return reasoning, content, calls, finish


def test_thinking_goes_to_reasoning_content(server):
    for seed in range(4):
        body = dict(regex=THINKING, temperature=1.0, seed=seed)
        c = _post(server, **body)
        assert c["message"]["reasoning_content"] in ("Hmm.\n", "Let me see.\n"), c
        assert c["message"]["content"] in ("Paris.", "Rome."), c
        assert c["finish_reason"] == "stop"
        reasoning, content, _, finish = _stream(server, **body)
        assert (reasoning, content, finish) == (c["message"]["reasoning_content"],
                                                c["message"]["content"], "stop")
        # stream_reasoning false: the same, the thinking in one delta
        assert _stream(server, stream_reasoning=False, **body)[:2] == (reasoning, content)


def test_separate_reasoning_false_keeps_it_in_the_content(server):
    c = _post(server, regex=THINKING, temperature=0, separate_reasoning=False)
    assert c["message"]["content"].startswith("<think>\n")
    assert "reasoning_content" not in c["message"]


def test_cut_off_while_thinking(server):
    c = _post(server, regex=THINKING, temperature=0, max_tokens=7)
    assert c["finish_reason"] == "length" and c["message"]["content"] == ""
    assert c["message"]["reasoning_content"]


def test_a_call_after_thinking_is_read(server):
    body = dict(regex=THINK_THEN_CALL, tools=[TOOL], temperature=1.0, seed=1, max_tokens=60)
    c = _post(server, **body)
    assert c["message"]["reasoning_content"] == "A tool.\n"
    assert c["message"]["content"] is None and c["finish_reason"] == "tool_calls"
    call = c["message"]["tool_calls"][0]["function"]
    reasoning, content, calls, finish = _stream(server, **body)
    assert (reasoning, content, finish) == ("A tool.\n", "", "tool_calls")
    assert "".join(d["function"]["arguments"] for d in calls) == call["arguments"]


def test_an_answer_without_a_section_is_untouched(server):
    plain = _post(server, temperature=0, max_tokens=8)
    assert "reasoning_content" not in plain["message"] and plain["message"]["content"]


def test_separate_reasoning_route(server):
    """SGLang's /separate_reasoning: any format, whatever the server's own parser."""
    r = httpx.post(server.base_url + "/separate_reasoning", timeout=30, json={
        "text": "Hmm, 2 + 2.</think>4", "reasoning_parser": "deepseek-r1"})
    assert r.status_code == 200, r.text
    assert r.json() == {"text": "4", "reasoning_text": "Hmm, 2 + 2."}
    bad = httpx.post(server.base_url + "/separate_reasoning", timeout=30, json={
        "text": "x", "reasoning_parser": "nope"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_parser"
