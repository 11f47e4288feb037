"""Issue 59 (items 2-5): grammar limits checked before llguidance compiles anything, grammar
errors without llguidance's internals, the API's compile check off the event loop, the
scheduler loop holding a request until its grammar compiled, logit_bias's OpenAI range and
the Responses API's orphan function_call_output."""
from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from kvstrata.entrypoints.api import grammar_check
from kvstrata.entrypoints.api import serving_openai as so
from kvstrata.entrypoints.api.errors import ApiError
from kvstrata.entrypoints.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from kvstrata.entrypoints.api.responses_api import ResponsesRequest, chat_request
from kvstrata.entrypoints.grammar_hold import GrammarHold
from kvstrata.entrypoints.scheduler_process import SchedulerLoop
from kvstrata.frontend import ipc
from kvstrata.protocol.grammar import GRAMMAR_FAILED, clean_message
from kvstrata.protocol.grammar_limits import (MAX_NESTED_REPEAT, limits_problem,
                                              nested_repeat)
from kvstrata.protocol.sampling_params import SamplingParams
from kvstrata.runner.sampling.grammar import new_failures

# The schema: 16000 optional properties, 1.2 MB; llguidance took 10 s to compile it
# and then panicked.
HUGE = {"type": "object", "properties": {f"prop_{i:05d}": {
    "type": "string", "description": "some description here"} for i in range(16000)}}
PANIC = ("panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n"
         "<backtrace>\n   0: <unknown>\n  16: type_call at /tmp/python-build.2026/Python/x.c:1")


# ---------------------------------------------------------------- limits, before compiling
@pytest.mark.parametrize("pattern,product", [
    ("((a{1,100}){1,100}){1,100}", 10 ** 6), ("(a{1,10}){1,10}", 100),
    ("a{1,10000}", 1), (r"\d{4}-\d{2}-\d{2}", 1), ("(a+){1,100}", 1),
    (r"(\{a{5}\}){300}", 1500), (r"[{(]{5}(x){3}", 1), (r"\p{L}{3}(b{2}){600}", 1200),
    ("((ab){2}|c){7}", 14), ("(?:x{10,}){200}", 2000)])
def test_nested_repeat(pattern, product):
    assert nested_repeat(pattern) == product


@pytest.mark.parametrize("kw,field,why", [
    ({"json_schema": json.dumps(HUGE)}, "json_schema", "too large"),
    ({"json_schema": json.dumps({"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(451)}})}, "json_schema", "451 optional"),
    ({"json_schema": json.dumps({"type": "array", "items": {
        "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5001)},
        "required": [f"p{i}" for i in range(5001)]}})}, "json_schema", "5001 properties"),
    ({"json_schema": json.dumps({"type": "string", "pattern": "(a{1,100}){1,100}"})},
     "json_schema", "pattern"),
    ({"regex": "((a{1,100}){1,100}){1,100}"}, "regex", "combinations"),
    ({"structural_tag": json.dumps({"triggers": ["<f"], "structures": [
        {"begin": "<f>", "end": "</f>", "schema": {"type": "object", "properties": {
            f"p{i}": {"type": "integer"} for i in range(500)}}}]})},
     "structural_tag", "optional"),
    ({"ebnf": "start: " + " | ".join(f'"w{i:06d}"' for i in range(60000))}, "ebnf",
     "too large"),
    ({"json_schema": "[" * 100000 + "]" * 100000}, "json_schema", "nested too deeply")])
def test_past_the_limits_is_refused_at_construction_naming_the_field(kw, field, why):
    start = time.perf_counter()
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    assert str(e.value).startswith(f"{field} ") and why in str(e.value), e.value
    assert time.perf_counter() - start < 2  # before: 10 s in llguidance, then a panic


def test_within_the_limits_passes():
    assert limits_problem("regex", r"([a-z0-9]{1,30}\.){1,30}") == ""
    assert nested_repeat(r"([a-z0-9]{1,63}\.){1,127}") > MAX_NESTED_REPEAT  # use + instead
    props = {f"p{i}": {"type": "integer"} for i in range(5000)}
    assert limits_problem("json_schema", json.dumps(
        {"type": "object", "properties": props, "required": list(props)})) == ""
    assert limits_problem("json_schema", "{not json") == ""  # the compile check names it


def test_the_scheduler_decodes_a_request_without_compiling_its_grammar(monkeypatch):
    """SamplingParams' __post_init__ runs again where the scheduler decodes the request: it
    compiled the grammar there too (9.5 s for the issue's schema, in the receive loop)."""
    import kvstrata.protocol.grammar as grammar_mod

    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    data = ipc.encode(ipc.GenerateReq(rid="r", prompt_ids=[1],
                                      sampling_params=SamplingParams(json_schema=schema)))
    monkeypatch.setattr(grammar_mod, "grammar_error", lambda *a: pytest.fail("compiled"))
    assert ipc.decode(data, "scheduler").sampling_params.json_schema == schema


# ---------------------------------------------------------------- messages
def test_a_panic_becomes_a_plain_message():
    for message in (PANIC, "lexer error: too many expressions\n<non-verbose/>",
                    "bad thing\n<state>\nTokens: x"):
        clean = clean_message(message)
        for leak in ("panic", "backtrace", "/tmp", "<", "assertion", "u16"):
            assert leak not in clean, clean
    assert clean_message(PANIC) == "too large or complex to compile"


def test_a_runner_failure_names_the_field():
    state = SimpleNamespace(reported=False, failed=True, error=PANIC, matcher=None)
    message = new_failures([("r", state)])["r"]
    assert message == GRAMMAR_FAILED + "too large or complex to compile"
    out = ipc.TextOutput(rid="r", text="", new_token_ids=[], finished=True,
                         finish_type="abort", error_message=message, error_status=400)
    choice = so.Choice(0, None, grammar_param="response_format")
    err = so.output_error(out, choice)
    assert err.status == 400 and err.param == "response_format"
    assert so.output_error(out, so.Choice(0, None)).param is None


# ---------------------------------------------------------------- the API's compile check
def _choice(param="regex", **grammar):
    return so.Choice(0, ipc.GenerateReq(rid="r", prompt_ids=[1],
                                        sampling_params=SamplingParams(**grammar)),
                     grammar_param=param)


def test_check_names_the_field_and_passes_good_grammars():
    with pytest.raises(ApiError) as e:
        asyncio.run(grammar_check.check_grammars([_choice("response_format",
                                                          json_schema='{"type": "x"}')], 10))
    assert e.value.param == "response_format" and e.value.status == 400
    assert e.value.message.startswith("response_format is not a valid JSON schema")
    asyncio.run(grammar_check.check_grammars([_choice(regex="(yes|no)"), _choice()], 10))


def test_a_slow_compile_runs_off_the_event_loop_and_times_out(monkeypatch):
    release = threading.Event()

    def slow(field, text):
        release.wait(10)
        return ""

    monkeypatch.setattr(grammar_check, "grammar_problem", slow)
    ticks = []

    async def main():
        async def ticker():
            while True:
                ticks.append(time.perf_counter())
                await asyncio.sleep(0.01)

        task = asyncio.create_task(ticker())
        try:
            await grammar_check.check_grammars([_choice(regex="slow-one")], 0.3)
        finally:
            task.cancel()
            release.set()

    start = time.perf_counter()
    with pytest.raises(ApiError, match="did not compile within 0.3 s") as e:
        asyncio.run(main())
    assert e.value.param == "regex" and time.perf_counter() - start < 2
    assert len(ticks) > 10 and max(b - a for a, b in itertools.pairwise(ticks)) < 0.2


# ---------------------------------------------------------------- the scheduler loop
class _Backend:
    def __init__(self):
        self.futures: dict[str, Future] = {}

    def compiled(self, sp):
        return self.futures.setdefault(sp.regex, Future())


class _Engine:
    def __init__(self, backend):
        self.runner = SimpleNamespace(grammar=backend)
        self.added, self.aborted = [], []

    def add_request(self, req):
        self.added.append(req.rid)

    def abort_request(self, rid):
        self.aborted.append(rid)


def _gen(rid, **kw):
    return ipc.GenerateReq(rid=rid, prompt_ids=[1], sampling_params=SamplingParams(**kw))


def test_a_request_joins_the_engine_once_its_grammar_compiled():
    backend = _Backend()
    engine = _Engine(backend)
    loop = SchedulerLoop(engine, None, None, SimpleNamespace(send=lambda data: None))
    loop.handle(_gen("slow", regex="a+"))
    loop.handle(_gen("plain"))
    loop.handle(_gen("gone", regex="b+"))
    assert engine.added == ["plain"]  # the others' compiles must not hold up its steps
    assert loop.grammars.ready() == []
    loop.handle(ipc.AbortReq("gone"))  # held: the engine ends it as any abort
    assert engine.added == ["plain", "gone"] and engine.aborted == ["gone"]
    backend.futures["a+"].set_result("matcher")
    assert [r.rid for r in loop.grammars.ready()] == ["slow"] and not loop.grammars.held
    done = Future()
    done.set_result("cached")
    backend.futures["c+"] = done  # compiled before: straight in
    loop.handle(_gen("again", regex="c+"))
    assert engine.added[-1] == "again"
    assert GrammarHold.of(SimpleNamespace()).hold(_gen("x", regex="a")) is False
    assert loop.grammars.ranks is None  # one rank: no driver, no calls


class _Ranks:
    """A TPDriver's grammar calls (its other ranks as one): `done` is what they compiled."""
    def __init__(self, backend):
        self.grammar = backend
        self.started, self.asked, self.done = [], [], set()
        self.lost = None

    def start_grammar(self, key):
        self.started.append(key)
        return key in self.done

    def grammars_done(self, keys):
        if self.lost:  # TPDriver._check / _replies: a lost rank is an error, never a wait
            raise RuntimeError(f"tensor parallelism: {self.lost}")
        self.asked.append(list(keys))
        return [key in self.done for key in keys]


def test_under_tp_a_request_joins_once_every_rank_compiled_its_grammar():
    backend = _Backend()
    engine = _Engine(backend)
    engine.runner = ranks = _Ranks(backend)
    loop = SchedulerLoop(engine, None, None, SimpleNamespace(send=lambda data: None))
    a, b = ("regex", "a+"), ("regex", "b+")
    for rid, pattern in (("one", "a+"), ("two", "a+"), ("gone", "b+")):
        loop.handle(_gen(rid, regex=pattern))
    assert ranks.started == [a, a, b]  # every rank compiles from the request's arrival
    assert loop.grammars.ready() == [] and ranks.asked == []  # asked once rank 0 has it
    backend.futures["a+"].set_result("matcher")
    backend.futures["b+"].set_result("matcher")
    assert loop.grammars.ready() == [] and engine.added == []  # rank 0's alone: held
    assert ranks.asked == [[a, b]]  # one question per grammar, not per request
    loop.handle(ipc.AbortReq("gone"))  # held: the engine ends it as any abort
    assert engine.added == ["gone"] and engine.aborted == ["gone"]
    ranks.done.add(a)
    assert [r.rid for r in loop.grammars.ready()] == ["one", "two"] and not loop.grammars.held
    loop.handle(_gen("again", regex="a+"))  # compiled on every rank: straight in
    assert engine.added[-1] == "again" and ranks.asked[-1] == [a]
    loop.handle(_gen("late", regex="b+"))
    ranks.lost = "rank 1 lost"  # the loop's error path ends the server (exit 71 before it)
    with pytest.raises(RuntimeError, match="rank 1 lost"):
        loop.grammars.ready()


def test_tp_driver_asks_every_rank_for_its_grammars():
    """TPDriver's grammar calls over the wire (msgpack) to two ranks' real GrammarBackends,
    whose compiles the test ends; a rank reports a grammar done only once compiled."""
    import msgspec

    from kvstrata.protocol.grammar import json_options
    from kvstrata.runner.parallel import tp_runner
    from kvstrata.runner.sampling.grammar import GrammarBackend

    a, b = ("regex", "a+"), ("json_schema", '{"type": "integer"}')
    gates = {(rank, text): threading.Event() for rank in (1, 2) for _, text in (a, b)}

    def backend(rank):
        b = GrammarBackend("smollm2-135m", None, 49152, [2], json_options())
        b._compile = lambda field, text: gates[rank, text].wait(10) and "matcher"
        return b

    ranks = [backend(1), backend(2)]
    inbox = []

    def send_all(data):
        msg = tp_runner._DOWN.decode(data)
        inbox.extend(msgspec.msgpack.encode(tp_runner._grammar_reply(b, msg, r))
                     for r, b in enumerate(ranks, 1))

    links = SimpleNamespace(size=3, send_all=send_all, recv=lambda timeout: inbox.pop(0))
    driver = tp_runner.TPDriver(SimpleNamespace(grammar=backend(0)), links, [])
    try:
        assert driver.start_grammar(a) is False and driver.start_grammar(b) is False
        assert driver.grammars_done([a, b]) == [False, False]
        for key in ((1, a[1]), (2, a[1]), (1, b[1])):
            gates[key].set()
        for r, key in ((0, a), (1, a), (0, b)):
            ranks[r]._compiled[key].result(5)
        assert driver.grammars_done([a, b]) == [True, False]  # rank 2 still compiles b
        assert driver.start_grammar(a) is True
        assert [s["compiles_started"] for s in driver.grammar_stats()] == [0, 2, 2]
    finally:
        for gate in gates.values():
            gate.set()


def test_the_runner_compiles_a_grammar_once_and_copies_it():
    from kvstrata.protocol.grammar import json_options
    from kvstrata.runner.sampling.grammar import GrammarBackend

    backend = GrammarBackend("smollm2-135m", None, 49152, [2], json_options())
    sp = SamplingParams(regex="(yes|no)")
    compiled = backend.compiled(sp)
    assert backend.compiled(SamplingParams(regex="(yes|no)")) is compiled
    a, b = backend.matcher(sp, []), backend.matcher(sp, [])
    yes = backend.tokenizer().tokenize_str("yes")[0]
    a.accept(yes)
    assert a.allowed().nonzero().flatten().tolist() == [2]
    assert b.allowed()[yes] and not compiled.result().is_stopped()  # untouched copies


def test_an_object_at_the_optional_property_limit_still_decodes():
    """Past the limit llguidance's parser fails at the answer's second token (4 row items per
    optional property, 2000 allowed): the limit is below that."""
    from kvstrata.protocol.grammar import json_options
    from kvstrata.protocol.grammar_limits import MAX_OPTIONAL_PROPERTIES
    from kvstrata.runner.sampling.grammar import GrammarBackend

    backend = GrammarBackend("smollm2-135m", None, 49152, [2], json_options())
    schema = {"type": "object", "properties": {
        f"prop_{i:05d}": {"type": "string"} for i in range(MAX_OPTIONAL_PROPERTIES)}}
    state = backend.matcher(SamplingParams(json_schema=json.dumps(schema)), [])
    for tok in backend.tokenizer().tokenize_str('{"prop_00'):
        assert state.allowed()[tok]
        state.accept(tok)
    assert state.allowed().any() and not state.failed


# ---------------------------------------------------------------- logit_bias, Responses
@pytest.mark.parametrize("bias", [1e308, -100.5, 101, float("nan"), float("-inf")])
def test_openai_logit_bias_outside_openais_range_is_a_400(bias):
    for body in (ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1": bias}}),
            CompletionRequest.model_validate({"prompt": "hi", "logit_bias": {"1": bias}})):
        with pytest.raises(ApiError) as e:
            so.build_sampling_params(body, 8, None, 0, "max_tokens")
        assert e.value.param == "logit_bias" and "[-100, 100]" in e.value.message


def test_openai_logit_bias_in_range_passes():
    body = CompletionRequest.model_validate({"prompt": "hi", "logit_bias": {"1": 100,
                                                                            "2": -100}})
    assert so.build_sampling_params(body, 8, None, 0, "max_tokens").logit_bias == \
        {1: 100.0, 2: -100.0}


def test_function_call_output_without_its_call_is_a_400():
    def body(*items):
        return ResponsesRequest.model_validate({"input": list(items)}, strict=False)

    output = {"type": "function_call_output", "call_id": "call_x", "output": "sunny"}
    for items in ([output], [{"type": "function_call", "call_id": "call_y", "name": "f",
                              "arguments": "{}"}, output],
                  [{**output, "call_id": ["x"]}]):
        with pytest.raises(ApiError) as e:
            chat_request(body(*items))
        assert e.value.param == "input" and e.value.message.startswith(
            "No tool call found for function call output with call_id ")
    assert "call_x." in str(pytest.raises(ApiError, chat_request, body(output)).value)
    call = {"type": "function_call", "call_id": "call_x", "name": "f", "arguments": "{}"}
    assert chat_request(body(call, output)).messages[-1].role == "tool"
