"""Prefill/decode disaggregation with real processes: a prefill server, a decode server and
sglang-router 0.3.2 in PD mode on 127.0.0.1, per transfer backend (tcp, mooncake). Answers
through the router equal one co-located server's (greedy, same tiny checkpoint; at bf16 with
--enable-deterministic-inference, tokens and logprobs bit for bit, sampled too); the KV of
prompts longer than one chunk crosses intact; a shared prefix hits the prefill radix cache;
client disconnects leak no page on either server; both servers' KV byte counters agree after
an abort mid-transfer; a dead prefill server fails the decode side's request within the
timeout and the next one is served; a decode server shows its resolved retraction backup
(test_pd_retraction.py: a decode pool too small for a prompt is a 400 at admission)."""
from __future__ import annotations

import contextlib
import os
import random
import re
import threading
import time

import httpx
import pytest

from tests.e2e.pd_servers import (FAIL_FAST_BOUND, HEARTBEAT_BOUND, PDServers, assert_no_leak,
                                  backend_available, paused, pd_router, serving, wait_drained,
                                  wait_for)
from tests.e2e.server_utils import free_port
from tests.e2e.test_routes_and_disconnect import kv_state

GREEDY = {"temperature": 0.0, "max_tokens": 8}
MSG = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module", params=["tcp", "mooncake"])
def pd(request, tiny_model_path):
    """The tcp pair's prefill is the session's (tests/e2e/conftest.py `tcp_prefill`, shared
    with test_pd_retraction.py and test_pd_decode_radix.py); mooncake's is the pair's own."""
    backend_available(request.param)
    shared = None
    if request.param == "tcp":
        shared = request.getfixturevalue("tcp_prefill")
        shared.revive_prefill()
    with serving(PDServers(tiny_model_path, request.param, shared_prefill=shared)) as servers:
        yield servers


def soak_on_mooncake(pd) -> None:
    """A test whose mooncake run is a soak (KVSTRATA_SOAK=1), its path covered in `make test`
    otherwise: a peer's death is noticed by the bootstrap heartbeat, the same for every
    backend (`make test` kills peers over tcp); the decode radix cache's turns send only new
    pages over mooncake in test_pd_decode_radix.py (its `offload` pair)."""
    if pd.backend == "mooncake" and os.environ.get("KVSTRATA_SOAK") != "1":
        pytest.skip("a soak on mooncake: KVSTRATA_SOAK=1 runs it (docs/testing.md)")


@pytest.fixture(scope="module")
def router(pd):
    with pd_router(pd) as r:
        yield r


def test_generate_pair_matches_colocated(pd, server):
    prompt = "The capital of France is"
    want = httpx.post(server.base_url + "/generate", json={
        "text": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}},
        timeout=60).json()
    prefill, decode = pd.generate(prompt)
    assert prefill.status_code == 200, prefill.text
    assert decode.status_code == 200, decode.text
    assert decode.json()["output_ids"] == want["output_ids"]
    assert decode.json()["text"] == want["text"]
    assert decode.json()["meta_info"]["prompt_tokens"] == want["meta_info"]["prompt_tokens"]


def test_grammar_crosses_the_pair(pd, server):
    """Structured output: the prefill server draws the first token under the grammar, the
    decode server's matcher replays it and goes on; the answer equals co-located decoding
    (greedy) and is in the grammar's language."""
    pattern = r"(alpha|beta|gamma)( (alpha|beta|gamma)){2,4}\."
    for temperature in (0.0, 0.9):
        sampling = {"regex": pattern, "temperature": temperature, "seed": 11}
        want = httpx.post(server.base_url + "/generate", json={
            "text": "Greek letters:", "sampling_params": {"max_new_tokens": 40, **sampling}},
            timeout=60).json()
        prefill, decode = pd.generate("Greek letters:", max_new_tokens=40, **sampling)
        assert prefill.status_code == 200 and decode.status_code == 200, decode.text
        assert re.fullmatch(pattern, decode.json()["text"]), decode.json()["text"]
        assert decode.json()["meta_info"]["finish_reason"]["type"] == "stop"
        assert decode.json()["output_ids"] == want["output_ids"]


def test_long_prompt_and_shared_prefix(pd, server):
    """A prompt of several chunks (page 4, chunk 64); then one sharing its first 160 tokens
    hits the prefill server's radix cache and still decodes exactly."""
    rng = random.Random(7)
    long_ids = [rng.randrange(100, 40000) for _ in range(200)]
    other = long_ids[:160] + [rng.randrange(100, 40000) for _ in range(30)]
    for ids in (long_ids, other):
        want = httpx.post(server.base_url + "/generate", json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}},
            timeout=60).json()
        prefill, decode = pd.generate(ids, max_new_tokens=6)
        assert decode.status_code == 200, decode.text
        assert decode.json()["output_ids"] == want["output_ids"]
    assert prefill.json()["meta_info"]["cached_tokens"] >= 160
    assert_no_leak(pd.prefill)
    assert_no_leak(pd.decode)


def test_openai_client_through_router(router, client):
    import openai

    via = openai.OpenAI(base_url=router.base_url + "/v1", api_key="none", max_retries=0,
                        timeout=120)
    direct = client.chat.completions.create(model="tiny", messages=MSG, **GREEDY)
    chat = via.chat.completions.create(model="tiny", messages=MSG, **GREEDY)
    assert chat.choices[0].message.content == direct.choices[0].message.content
    assert chat.usage.completion_tokens == direct.usage.completion_tokens
    assert chat.usage.prompt_tokens == direct.usage.prompt_tokens
    chunks = list(via.chat.completions.create(model="tiny", messages=MSG, stream=True, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
        == direct.choices[0].message.content

    want = client.completions.create(model="tiny", prompt="The sky is", logprobs=2, **GREEDY)
    got = via.completions.create(model="tiny", prompt="The sky is", logprobs=2, **GREEDY)
    assert got.choices[0].text == want.choices[0].text
    assert got.choices[0].logprobs.tokens == want.choices[0].logprobs.tokens
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(
        want.choices[0].logprobs.token_logprobs, abs=1e-4)
    streamed = "".join(c.choices[0].text for c in via.completions.create(
        model="tiny", prompt="The sky is", stream=True, **GREEDY) if c.choices)
    assert streamed == want.choices[0].text


def test_tool_call_through_router(router, client):
    """tool_choice required through the pair: both servers build the same constraint (the
    prefill server draws the first token under it), the decode server reads the call."""
    import openai

    from tests.e2e.test_tool_calling import TIME

    via = openai.OpenAI(base_url=router.base_url + "/v1", api_key="none", max_retries=0,
                        timeout=120)
    kwargs = dict(model="tiny", messages=MSG, tools=[TIME], tool_choice="required",
                  parallel_tool_calls=False, max_tokens=40, temperature=0)
    want = client.chat.completions.create(**kwargs).choices[0]
    got = via.chat.completions.create(**kwargs).choices[0]
    assert got.finish_reason == want.finish_reason == "tool_calls"
    assert got.message.tool_calls[0].function == want.message.tool_calls[0].function


def test_concurrent_requests_with_disconnects_leak_nothing(router, pd):
    """16 concurrent streams through the router, a random half cut off by the client."""
    rng = random.Random(3)

    def one(i: int) -> None:
        body = {"model": "tiny", "prompt": f"Story number {i}:", "max_tokens": 24,
                "temperature": 0.0, "stream": True}
        try:
            with httpx.stream("POST", router.base_url + "/v1/completions", json=body,
                              timeout=60) as r:
                cut = rng.random() < 0.5
                for n, _ in enumerate(r.iter_lines()):
                    if cut and n >= 2:
                        return  # closes the connection mid-stream
        except httpx.HTTPError:
            pass
    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert_no_leak(pd.prefill)
    assert_no_leak(pd.decode)


def test_byte_counters_agree_after_an_abort_mid_transfer(pd):
    """Issue 59 item 6: the prefill's request is aborted after its pages left and before the
    decode acknowledged them (the decode server is paused meanwhile): what left still lands
    (tcp: all of it, so the decode answers; mooncake: the write under way, and the room
    fails) and both servers count the same bytes (the prefill used to count none)."""
    moved = {"prefill": "disagg_kv_bytes_sent_total", "decode": "disagg_kv_bytes_received_total"}
    before = {side: kv_state(getattr(pd, side))[key] for side, key in moved.items()}
    rid = f"mid-transfer-{random.getrandbits(32)}"
    body = {"input_ids": list(range(500, 700)), "rid": rid, **pd.body(),
            "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
    out: dict = {}

    def post(side):
        out[side] = httpx.post(getattr(pd, side).base_url + "/generate", json=body, timeout=60)
    threads = {side: threading.Thread(target=post, args=(side,)) for side in moved}
    threads["decode"].start()
    wait_for(pd.decode, lambda st: st.get("num_decode_transfer"), "no room reserved")
    time.sleep(0.2)  # its destination pages are on their way to the prefill
    with paused(pd.decode):  # for well under the heartbeat bound
        threads["prefill"].start()
        wait_for(pd.prefill, lambda st: st.get("num_prefill_inflight"), "nothing shipped")
        httpx.post(pd.prefill.base_url + "/abort_request", json={"rid": rid}, timeout=10)
        time.sleep(0.3)
    for t in threads.values():
        t.join(60)
    assert out["decode"].status_code in (200, 500), out["decode"].text
    assert out["prefill"].status_code != 200, out["prefill"].text
    wait_drained(pd.prefill), wait_drained(pd.decode)
    after = {side: kv_state(getattr(pd, side))[key] for side, key in moved.items()}
    sent, received = (after[side] - before[side] for side in moved)
    assert sent == received > 0, (sent, received)


@pytest.mark.parametrize("pd", ["tcp"], indirect=True)  # the look-up is the backends' own
def test_closed_bootstrap_port_fails_at_once(pd):
    """A decode request whose bootstrap address refuses connections fails within seconds
    (not the bootstrap timeout) with SGLang's message, and frees what it held."""
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 4},
            **pd.body(), "bootstrap_port": free_port()}
    start = time.monotonic()
    r = httpx.post(pd.decode.base_url + "/generate", json=body, timeout=60)
    assert r.status_code == 500, r.text
    assert "Could not fetch prefill parallel info" in r.json()["error"]["message"], r.text
    assert time.monotonic() - start < FAIL_FAST_BOUND
    assert_no_leak(pd.decode)


def _in_flight(fn, n: int) -> tuple[list, list[threading.Thread]]:
    """Start n calls of fn(i) in threads; (their results as they come, the threads)."""
    results: list = []

    def one(i):
        t0 = time.monotonic()
        try:
            results.append((fn(i), time.monotonic() - t0))
        except httpx.HTTPError as e:
            results.append((e, time.monotonic() - t0))
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return results, threads


def _wait_kv_in_use(srv, timeout: float = 30) -> None:
    """Until the server holds KV for a request (the work is under way there)."""
    wait_for(srv, lambda st: st["num_used_tokens"], "no KV in use", timeout)


def test_dead_decode_frees_the_prefill(pd):
    """SIGKILL the decode server with 8 requests in flight: the prefill's rooms fail within
    the heartbeat bound (those still waiting for the decode's pages included) and its queues
    and pages return to idle; a new decode server then works."""
    soak_on_mooncake(pd)
    def both(i):
        """What the router does; returns the prefill's answer (the decode's dies with it).
        300-token prompts answered with 200 tokens: the decode pool (2048 tokens) admits
        about half of them and holds their pages for 200 steps, so the other rooms are still
        waiting for its pages when it dies (with short prompts, or 64-token answers on a
        fast box, every transfer could finish before the test looked: no room open)."""
        body = {"input_ids": list(range(100 + i, 400 + i)), **pd.body(),
                "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}

        def to_decode():
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(pd.decode.base_url + "/generate", json=body, timeout=60)
        decode = threading.Thread(target=to_decode)
        decode.start()
        try:
            return httpx.post(pd.prefill.base_url + "/generate", json=body, timeout=60)
        finally:
            decode.join()
    results, threads = _in_flight(both, 8)
    # Every request reached the decode (so it joined each room: a room that no decode ever
    # joined can only end at the bootstrap timeout, on SGLang too), and work is under way.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and sum(
            kv_state(pd.decode).get(k, 0) for k in (
                "num_running_reqs", "num_waiting_reqs", "num_decode_prealloc",
                "num_decode_transfer", "num_decode_prebuilt")) + len(results) < 8:
        time.sleep(0.02)
    # The prefill has rooms open: KV in use or sent, or rooms waiting for the decode's
    # pages (with mooncake the admitted ones may all have crossed already).
    wait_for(pd.prefill, lambda st: st["num_used_tokens"] or st.get("num_prefill_bootstrap")
              or st.get("num_prefill_inflight"), "no prefill room open")
    time.sleep(0.5)  # the Join messages are on their way (sent once the route is known)
    pd.decode.stop(sig=9)
    killed = time.monotonic()
    st = wait_drained(pd.prefill, timeout=HEARTBEAT_BOUND + 10)
    assert time.monotonic() - killed < HEARTBEAT_BOUND + 10, st
    for t in threads:
        t.join(60)
    # Each prefill half answered: done before the kill, or failed by the dead peer.
    assert len(results) == 8 and all(isinstance(r, httpx.Response) for r, _ in results), results
    assert_no_leak(pd.prefill)
    # On the same port: the module's router still sends its decode halves there.
    pd.decode = pd.start_decode(port=pd.decode.port)
    prefill, decode = pd.generate("Hello there")
    assert (prefill.status_code, decode.status_code) == (200, 200), (prefill.text, decode.text)


def test_dead_prefill_fails_every_client_then_recovers(router, pd):
    """SIGKILL the prefill with 8 requests in flight through the router: every client gets
    an error within the heartbeat bound (the router's retries hit the dead bootstrap port,
    which fails fast now), and the decode pool returns to idle. A request sent to the decode
    side while the prefill is still dead answers 500 with the reason within the timeout and
    frees its pages; once a prefill server is back on the same bootstrap port the next
    request is served."""
    soak_on_mooncake(pd)
    def chat(i):
        return httpx.post(router.base_url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "max_tokens": 200, "ignore_eos": True, "temperature": 0.0,
            "messages": [{"role": "user", "content": f"Tell story {i}. " * 20}]})
    results, threads = _in_flight(chat, 8)
    _wait_kv_in_use(pd.decode)
    pd.prefill.stop(sig=9)
    killed = time.monotonic()
    for t in threads:
        t.join(120)
    waited = time.monotonic() - killed
    statuses = [r.status_code if isinstance(r, httpx.Response) else repr(r) for r, _ in results]
    # Nobody hangs: a request whose KV had already crossed may still finish (200); every
    # other one got an error answer (the router's retries included) within the bound.
    assert len(results) == 8, statuses
    assert all(s == 200 or isinstance(s, int) and s >= 400 for s in statuses), statuses
    print("dead prefill behind the router: all answered in", round(waited, 1), "s:", statuses)
    assert waited < FAIL_FAST_BOUND, (waited, statuses)
    assert_no_leak(pd.decode)
    # A new room while the prefill is dead (SIGKILL: no goodbye to the peer).
    body = {"input_ids": list(range(100, 400)),
            "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}, **pd.body()}
    start = time.monotonic()
    r = httpx.post(pd.decode.base_url + "/generate", json=body, timeout=120)
    assert r.status_code == 500, r.text
    assert time.monotonic() - start < 60
    assert_no_leak(pd.decode)
    pd.prefill = pd.start_prefill(port=pd.prefill.port)  # where the router sends it
    prefill, decode = pd.generate("Hello there")
    assert decode.status_code == 200, decode.text
    assert prefill.status_code == 200, prefill.text


@pytest.mark.parametrize("pd", ["tcp"], indirect=True)
def test_decode_server_info_shows_the_auto_backup(pd):
    """The retraction backup unset on a CPU decode server: host_pool, ratio 0.2, and the rule
    says why (test_pd_retraction.py's servers check their explicit cpu_tensor / host_pool +
    ratio)."""
    from tests.e2e.test_pd_retraction import check_server_info

    check_server_info(pd.decode, "host_pool", 0.2, True, resolved=True)


def test_decode_radix_cache_sends_only_new_pages(pd, server):
    """--disaggregation-decode-enable-radix-cache (with NGRAM speculation on the decode
    server): a 3-turn conversation (greedy) answers exactly as one co-located server; from turn 2 on the decode server holds the conversation
    so far in its radix tree, so only the pages after it cross (the hit counter grows by at
    least the previous turn's whole pages); afterwards nothing leaks on either side."""
    soak_on_mooncake(pd)
    # With speculation on the decode server too (drafting in every step): SGLang refuses
    # the decode radix cache with speculation; here the two work together.
    radix = PDServers(pd.model, pd.backend, "--disaggregation-decode-enable-radix-cache",
                      "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens",
                      "4", "--speculative-disable-by-batch-size", "64", shared_prefill=pd)
    try:
        rng = random.Random(11)
        ids = [rng.randrange(100, 40000) for _ in range(37)]
        hits, held_before, received = [], 0, []
        sent_before = kv_state(pd.prefill)["disagg_kv_bytes_sent_total"]
        for turn in range(3):
            want = httpx.post(server.base_url + "/generate", json={
                "input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}},
                timeout=60).json()
            prefill, decode = radix.generate(ids)
            assert (prefill.status_code, decode.status_code) == (200, 200), decode.text
            assert decode.json()["output_ids"] == want["output_ids"], turn
            st = kv_state(radix.decode)
            hits.append(st["decode_prefix_hit_tokens"] - sum(hits))
            assert hits[-1] >= held_before, (turn, hits)
            assert st["disagg_decode_prefix_hit_tokens_total"] == sum(hits)
            received.append(st["disagg_kv_bytes_received_total"] - sum(received))
            # The tree now holds this turn's whole pages: prompt + all outputs but the last.
            held_before = (len(ids) + 8 - 1) // 4 * 4
            ids = ids + decode.json()["output_ids"] + [rng.randrange(100, 40000)
                                                       for _ in range(9)]
        assert hits[0] == 0 and min(hits[1:]) > 0, hits
        assert kv_state(radix.decode)["spec_drafted_tokens"] > 0  # the decode speculated
        # Bytes follow pages: turn 1 sent the whole prompt (10 pages of 4 tokens), later
        # turns only the pages after what the decode held -- the prefill counted the same.
        page = received[0] // 10
        assert received[0] == 10 * page > 0 and all(0 < b < received[0] for b in received[1:])
        assert kv_state(pd.prefill)["disagg_kv_bytes_sent_total"] - sent_before == sum(received)
        metrics = httpx.get(radix.decode.base_url + "/metrics", timeout=30).text
        assert "kvstrata:disagg_kv_bytes_received_total" in metrics
        assert "kvstrata:disagg_decode_prefix_hit_tokens_total" in metrics
        # The retraction rule's gate is live: with the decode radix cache on, the auto
        # backup is cpu_tensor (its reason names the blocker).
        info = httpx.get(radix.decode.base_url + "/server_info", timeout=30).json()
        assert info["disaggregation_decode_retraction_backup"] == "cpu_tensor"
        assert any(r["field"] == "disaggregation_decode_retraction_backup"
                   and "--disaggregation-decode-enable-radix-cache" in r["reason"]
                   for r in info["resolutions"]), info["resolutions"]
        assert_no_leak(radix.decode)
        assert_no_leak(pd.prefill)
    finally:
        radix.stop()  # the decode server only: the prefill is the module's


# mooncake is a soak (KVSTRATA_SOAK=1): the pages that cross are the same bytes either way
@pytest.mark.parametrize("backend", ["tcp", pytest.param("mooncake", marks=pytest.mark.soak)])
def test_deterministic_bf16_pair_answers_like_colocated(tiny_model_path, backend):
    """bf16 (what --dtype auto picks on a CPU with bf16 instructions) and
    --enable-deterministic-inference on both servers, the decode radix cache on: the prefill's
    bf16 KV pages cross, the decode server reads them in place with the paged decode kernel,
    and every answer -- greedy and seeded sampled, tokens and logprobs, a first turn (nothing
    cached on the decode side) and a second one extending it (a decode radix hit) -- equals a
    co-located deterministic bf16 engine's, bit for bit."""
    backend_available(backend)
    from kvstrata import LLM

    first = "The quick brown fox jumps over the lazy dog. " * 6
    turns = [first, first + "Then it ran into the forest, where it met"]
    params = [{"temperature": 0.0}, {"temperature": 0.8, "seed": 7}]
    with LLM(model_path=tiny_model_path, dtype="bfloat16", max_total_tokens=4096,
             enable_deterministic_inference=True) as llm:
        want = {}
        for t, prompt in enumerate(turns):
            for s, sp in enumerate(params):
                llm.flush_cache()  # each reference cold
                out = llm.generate(prompt, {**sp, "max_new_tokens": 16, "ignore_eos": True,
                                            "logprobs": 0})
                want[t, s] = (out["output_ids"],
                              [lp for lp, _ in out["meta_info"]["output_token_logprobs"]])
    det = ("--dtype", "bfloat16", "--enable-deterministic-inference")
    with serving(PDServers(tiny_model_path, backend, *det,
                           "--disaggregation-decode-enable-radix-cache",
                           prefill_args=det)) as pair:
        for t, prompt in enumerate(turns):
            for s, sp in enumerate(params):
                prefill, decode = pair.generate(prompt, max_new_tokens=16, ignore_eos=True,
                                                top={"return_logprob": True}, **sp)
                assert (prefill.status_code, decode.status_code) == (200, 200), decode.text
                meta = decode.json()["meta_info"]
                got = (decode.json()["output_ids"],
                       [e[0] for e in meta["output_token_logprobs"]])
                assert got == want[t, s], f"turn {t}, params {sp}"
                if t == 1:
                    assert meta["cached_tokens"] > 0, "the second turn was meant to hit"
        for srv in (pair.prefill, pair.decode):
            info = httpx.get(srv.base_url + "/server_info", timeout=30).json()
            assert info["dtype"] == "bfloat16" and info["enable_deterministic_inference"]
        assert_no_leak(pair.decode)
