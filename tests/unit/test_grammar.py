"""Structured output: request fields -> SamplingParams, grammar checks, the sampler's mask and
the runner's matchers (real llguidance over SmolLM2's tokenizer)."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from kvstrata.config.resolve import unimplemented_flags
from kvstrata.config.server_args import ServerArgs
from kvstrata.entrypoints.api.errors import ApiError
from kvstrata.entrypoints.api.structured_output import (ANY_JSON_OBJECT, check_grammar_allowed,
                                                        grammar_fields)
from kvstrata.protocol.grammar import check_grammar, json_options
from kvstrata.protocol.sampling_params import SamplingParams
from kvstrata.runner.sampling.grammar import GrammarBackend, new_failures
from kvstrata.runner.sampling.sampler import Sampler, SamplingState

EOS = 7


# ---------------------------------------------------------------- request fields
@pytest.mark.parametrize("kw,field", [
    ({"regex": "a(b"}, "regex"), ({"ebnf": 'root ::= "a'}, "ebnf"),
    ({"json_schema": "{"}, "json_schema"), ({"json_schema": '{"type": "nonsense"}'}, "json_schema"),
    ({"json_schema": "[1]"}, "json_schema"), ({"regex": "(?=a)"}, "regex"),
    ({"regex": 5}, "regex"), ({"regex": "a", "ebnf": 'root ::= "a"'}, "regex"),
    ({"structural_tag": "{}"}, "structural_tag"),
    ({"structural_tag": json.dumps({"structures": [{"begin": "<f>", "schema": {},
                                                    "end": "</f>"}],
                                    "triggers": ["<g"]})}, "structural_tag"),
    ({"structural_tag": json.dumps({"structures": [{"begin": "<f>", "end": "</f>"}],
                                    "triggers": ["<f"]})}, "structural_tag")])
def test_bad_grammars_name_their_field(kw, field):
    # construction checks the type and the limits; check_grammar whether it compiles
    with pytest.raises(ValueError) as e:
        check_grammar(SamplingParams(**kw))
    assert str(e.value).split(" ", 1)[0] == field, e.value
    assert "<state>" not in str(e.value) and len(str(e.value)) < 600


@pytest.mark.parametrize("kw", [{"regex": "(yes|no)"}, {"json_schema": ANY_JSON_OBJECT},
                                {"ebnf": 'root ::= "a" | "b"'}, {"ebnf": 'start: "a"+'},
                                {"json_schema": "{}"}])
def test_good_grammars(kw):
    sp = SamplingParams(**kw)
    check_grammar(sp)
    assert sp.grammar_field == next(iter(kw))


def _body(**kw):
    base = {"regex": None, "ebnf": None, "response_format": None, "structured_outputs": None}
    return SimpleNamespace(**{**base, **kw})


def test_response_format_kinds():
    assert grammar_fields(_body(response_format={"type": "text"}))["json_schema"] is None
    assert grammar_fields(_body(response_format={"type": "json_object"}))["json_schema"] == \
        ANY_JSON_OBJECT
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    got = grammar_fields(_body(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema, "strict": True}}))
    assert json.loads(got["json_schema"]) == schema
    # /v1/completions' own json_schema string, and SGLang's regex / ebnf
    assert grammar_fields(_body(json_schema="{}", regex="a"))["regex"] == "a"
    # SGLang's structural tag passes whole (SamplingParams checks it)
    tag = {"type": "structural_tag", "structures": [], "triggers": []}
    assert json.loads(grammar_fields(_body(response_format=tag))["structural_tag"]) == tag
    for bad in ({"type": "json_schema", "json_schema": {"name": "x"}}, {"type": "yaml"},
                "json"):
        with pytest.raises(ApiError) as e:
            grammar_fields(_body(response_format=bad))
        assert e.value.param == "response_format"
    with pytest.raises(ApiError, match="one of response_format and json_schema"):
        grammar_fields(_body(json_schema="{}", response_format={"type": "json_object"}))


def test_vllm_structured_outputs():
    def fields(spec):
        return {k: v for k, v in grammar_fields(_body(structured_outputs=spec)).items() if v}

    assert fields({"json": {"type": "object"}}) == {"json_schema": '{"type": "object"}'}
    assert fields({"json": "{}", "regex": None}) == {"json_schema": "{}"}
    assert fields({"regex": "a+"}) == {"regex": "a+"}
    assert fields({"grammar": 'root ::= "a"'}) == {"ebnf": 'root ::= "a"'}
    assert fields({"json_object": True}) == {"json_schema": ANY_JSON_OBJECT}
    choice = fields({"choice": ["yes", 'a "b"', "日本"]})["ebnf"]
    assert SamplingParams(ebnf=choice).grammar_field == "ebnf"
    for bad, why in (({"regex": "a", "json": "{}"}, "exactly one"), ({}, "exactly one"),
                     ({"choice": []}, "non-empty list"), ({"choice": "a"}, "non-empty list"),
                     ({"regex": 5}, "must be a string"), ({"backend": "x"}, "not implemented"),
                     ("json", "must be an object")):
        with pytest.raises(ApiError, match=why) as e:
            fields(bad)
        assert e.value.param == "structured_outputs"
    with pytest.raises(ApiError, match="one of structured_outputs and regex"):
        grammar_fields(_body(regex="a", structured_outputs={"regex": "b"}))


def test_grammar_refused_without_backend_or_tokenizer():
    sp = SamplingParams(regex="a")
    check_grammar_allowed(SimpleNamespace(grammar_backend="llguidance",
                                          skip_tokenizer_init=False), sp, "regex")
    check_grammar_allowed(SimpleNamespace(grammar_backend="none"), SamplingParams(), "x")
    for args, why in ((SimpleNamespace(grammar_backend="none", skip_tokenizer_init=False),
                       "--grammar-backend none"),
                      (SimpleNamespace(grammar_backend="llguidance", skip_tokenizer_init=True),
                       "--skip-tokenizer-init")):
        with pytest.raises(ApiError, match=why) as e:
            check_grammar_allowed(args, sp, "sampling_params.regex")
        assert e.value.param == "sampling_params.regex"


def test_grammar_backend_flag():
    assert unimplemented_flags(ServerArgs(grammar_backend="xgrammar")) == \
        ["--grammar-backend xgrammar"]
    assert unimplemented_flags(ServerArgs(grammar_backend="none")) == []
    assert unimplemented_flags(ServerArgs()) == []
    assert json_options() == {"whitespace_flexible": True}
    assert json_options(disable_any_whitespace=True) == {"whitespace_flexible": False}
    assert json_options(whitespace_pattern=r"[ ]?") == {"whitespace_pattern": r"[ ]?"}


# ---------------------------------------------------------------- the sampler's mask
class FixedGrammar:
    """A grammar that allows a fixed set of ids and records what it was given."""

    def __init__(self, ids, vocab):
        self.mask = torch.zeros(vocab, dtype=torch.bool)
        self.mask[list(ids)] = True
        self.taken: list[int] = []

    def allowed(self):
        return self.mask

    def accept(self, tok):
        self.taken.append(tok)


LOGITS = torch.tensor([[2.0, 1.5, 1.0, 0.8, 0.2, -0.5, -1.0, 0.0]])


def _state(grammar, **kw) -> SamplingState:
    s = SamplingState(SamplingParams(**kw), [1], [])
    s.grammar = grammar
    return s


def test_greedy_takes_the_best_allowed_token_and_logprobs_see_the_mask():
    sampler = Sampler(8, [EOS])
    s = _state(FixedGrammar({3, 5}, 8), temperature=0.0, logprobs=2)
    out = sampler(LOGITS.clone(), [s])
    assert out.token_ids == [3]
    ref = torch.log_softmax(torch.tensor([0.8, -0.5]), dim=0)
    assert out.logprobs[0] == pytest.approx(ref[0].item(), abs=1e-5)
    assert [t for t, _ in out.top_logprobs[0]] == [3, 5]
    lp = sampler.adjusted(LOGITS.clone(), [s])
    assert torch.isinf(lp[0, [0, 1, 2, 4, 6, 7]]).all()
    s.record(3)
    assert s.output_token_ids == [3] and s.grammar.taken == [3]


def test_sampled_rows_draw_only_allowed_tokens():
    sampler = Sampler(8, [EOS])
    torch.manual_seed(0)
    for seed in range(200):
        s = _state(FixedGrammar({1, 4, 6}, 8), temperature=1.5, seed=seed)
        assert sampler(LOGITS.clone(), [s]).token_ids[0] in (1, 4, 6)


def test_a_complete_grammar_ends_even_under_min_new_tokens():
    # the grammar allows only EOS; min_new_tokens would block it and leave nothing: EOS wins
    sampler = Sampler(8, [EOS])
    s = _state(FixedGrammar({EOS}, 8), temperature=1.0, seed=3, min_new_tokens=5, logprobs=0)
    out = sampler(LOGITS.clone(), [s])
    assert out.token_ids == [EOS] and out.logprobs[0] == pytest.approx(0.0)
    # while it still allows more, min_new_tokens keeps blocking EOS
    s = _state(FixedGrammar({2, EOS}, 8), temperature=0.0, min_new_tokens=5)
    assert sampler(LOGITS.clone(), [s]).token_ids == [2]


def test_padded_logits_beyond_the_mask_are_never_drawn():
    sampler = Sampler(10, [EOS])
    logits = torch.cat([LOGITS, torch.tensor([[50.0, 60.0]])], dim=1)
    s = _state(FixedGrammar({0}, 8), temperature=0.0, logprobs=0)
    out = sampler(logits, [s])
    assert out.token_ids == [0] and out.logprobs[0] == pytest.approx(0.0)


# ---------------------------------------------------------------- real matchers
@pytest.fixture(scope="module")
def backend():
    b = GrammarBackend("smollm2-135m", None, 49152, [2], json_options())
    b.tokenizer()
    return b


@pytest.fixture(scope="module")
def tokenizer():
    from kvstrata.config.model_source import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path("smollm2-135m"))


def _walk(state, tokenizer, pick=0, steps=40) -> tuple[str, list[int]]:
    ids = []
    for _ in range(steps):
        allowed = torch.nonzero(state.allowed()).flatten().tolist()
        tok = allowed[pick % len(allowed)]
        ids.append(tok)
        state.accept(tok)
        if tok == 2:
            break
    return tokenizer.decode([t for t in ids if t != 2]), ids


@pytest.mark.parametrize("pick", [0, 1, 7, 1000])
def test_regex_walks_stay_in_the_language(backend, tokenizer, pick):
    state = backend.matcher(SamplingParams(regex=r"(yes|no|maybe)[0-9]{2}"), [])
    text, ids = _walk(state, tokenizer, pick)
    assert ids[-1] == 2 and re.fullmatch(r"(yes|no|maybe)[0-9]{2}", text), text
    assert not state.failed


def test_json_schema_walk_parses(backend, tokenizer):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "n": {"type": "integer", "enum": [1, 22]}},
              "required": ["ok", "n"], "additionalProperties": False}
    compact = GrammarBackend("smollm2-135m", None, 49152, [2], json_options(True))
    compact._tokenizer = backend.tokenizer()
    for pick in (0, 3, 11):
        state = compact.matcher(SamplingParams(json_schema=json.dumps(schema)), [])
        text, ids = _walk(state, tokenizer, pick, steps=60)
        assert ids[-1] == 2, text
        value = json.loads(text)
        assert set(value) == {"ok", "n"} and value["n"] in (1, 22), text


def test_replay_continues_where_the_output_stopped(backend, tokenizer):
    """A retracted request or a PD decode server's first token: the new matcher replays the
    output and allows exactly what the first one allows now."""
    sp = SamplingParams(ebnf='root ::= "The answer is " ("yes" | "no") "."')
    first = backend.matcher(sp, [])
    taken = []
    for _ in range(3):
        tok = torch.nonzero(first.allowed()).flatten().tolist()[0]
        first.accept(tok)
        taken.append(tok)
    again = backend.matcher(sp, taken)
    assert torch.equal(again.allowed(), first.allowed())
    assert not again.failed


def test_failures_are_reported_once(backend, tokenizer):
    state = backend.matcher(SamplingParams(regex="[0-9]+"), [])
    ok = backend.matcher(SamplingParams(regex="[0-9]+"), [])
    state.accept(tokenizer.encode("x", add_special_tokens=False)[0])  # a token it cannot take
    assert state.failed and torch.nonzero(state.allowed()).flatten().tolist() == [2]
    failed = new_failures([("a", state), ("b", ok), ("c", None)])
    assert list(failed) == ["a"] and "grammar failed" in failed["a"]
    assert "<state>" not in failed["a"]
    assert new_failures([("a", state)]) == {}


def test_whitespace_pattern_is_checked_at_start():
    with pytest.raises(ValueError, match="--constrained-json-whitespace-pattern"):
        GrammarBackend("smollm2-135m", None, 49152, [2], json_options(False, "a(b"))


TOOL = {"type": "structural_tag", "triggers": ["<function="], "structures": [
    {"begin": "<function=get_weather>", "end": "</function>",
     "schema": {"type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"], "additionalProperties": False}}]}


@pytest.mark.parametrize("text,ok", [
    ('Sure. <function=get_weather>{"city": "Paris"}</function> Done.', True),
    ("No call at all.", True),
    ('<function=get_weather>{"town": 1}</function>', False),
    ("<function=get_time>{}</function>", False)])
def test_structural_tag_free_text_and_calls(backend, tokenizer, text, ok):
    state = backend.matcher(SamplingParams(structural_tag=json.dumps(TOOL)), [])
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert state.matcher.consume_tokens(ids) is ok and state.failed is not ok


def test_structural_tag_trigger_that_is_a_special_token(backend, tokenizer):
    """A trigger that is one special token (Qwen's <tool_call>; SmolLM2's <|im_start|>
    here) is matched as that token, not as its letters."""
    assert backend.is_special("<|im_start|>") and not backend.is_special("<function=")
    tag = {"triggers": ["<|im_start|>"], "structures": [
        {"begin": "<|im_start|>call", "end": ".", "schema": {"type": "integer"}}]}
    state = backend.matcher(SamplingParams(structural_tag=json.dumps(tag)), [])
    ids = tokenizer.encode("x<|im_start|>call42.", add_special_tokens=False)
    assert ids.count(1) == 1  # <|im_start|> is token 1
    assert state.matcher.consume_tokens(ids) and not state.failed


def test_underflow_at_a_small_temperature_keeps_blocked_tokens_blocked():
    """-3.4e38 / 1e-5 is -inf: a row whose only unblocked logits are that low takes its
    T -> 0 limit; it was spread over the whole vocabulary (blocked tokens too)."""
    sampler = Sampler(8, [EOS])
    low = torch.full((1, 8), -3.4e38)
    for seed in range(50):
        s = _state(FixedGrammar({2, 4}, 8), temperature=1e-5, seed=seed)
        assert sampler(low.clone(), [s]).token_ids[0] in (2, 4)
        eos_high = low.clone()
        eos_high[0, EOS] = 5.0  # min_new_tokens blocks the only high logit
        s = SamplingState(SamplingParams(temperature=1e-5, seed=seed, min_new_tokens=3),
                          [1], [])
        assert sampler(eos_high, [s]).token_ids[0] != EOS


def test_a_compile_that_raises_ends_the_request_not_the_scheduler(backend, monkeypatch):
    """Never expected (the API checks grammars), but a conversion or compile that raises on
    the compile thread leaves a failed matcher (EOS only, reported once), not an exception
    in the step."""
    import kvstrata.runner.sampling.grammar as grammar_mod

    def boom(*args, **kwargs):
        raise RuntimeError("no grammar today")

    monkeypatch.setattr(grammar_mod, "llguidance_grammar", boom)
    state = backend.matcher(SamplingParams(regex="a"), [5, 6])
    assert torch.nonzero(state.allowed()).flatten().tolist() == [2] and state.failed
    assert "no grammar today" in new_failures([("r", state)])["r"]


# ---------------------------------------------------------------- grammar after thinking
START, END = 1, 9617  # stand-ins: one-token thinking markers (SmolLM2 has none)


def _mask_ids(state) -> set[int] | None:
    allowed = state.allowed()
    return None if allowed is None else set(torch.nonzero(allowed).flatten().tolist())


def test_grammar_waits_for_the_thinking_section_to_end(backend):
    sp = SamplingParams(regex=r"(yes|no)", reasoning_gate=[START, END, 1])
    state = backend.matcher(sp, [])
    for tok in (500, 12, 7000):  # thinking: anything goes, the matcher sees none of it
        assert state.allowed() is None
        state.accept(tok)
    state.accept(END)
    plain = _mask_ids(backend.matcher(SamplingParams(regex=r"(yes|no)"), []))
    assert _mask_ids(state) == plain and {10407, 4607} <= plain  # now the grammar holds
    state.accept(10407)
    assert _mask_ids(state) == {2} and not state.failed


def test_the_answer_may_open_a_section_or_follow_the_grammar(backend):
    sp = SamplingParams(regex=r"(yes|no)", reasoning_gate=[START, END, 0])
    state = backend.matcher(sp, [])
    plain = _mask_ids(backend.matcher(SamplingParams(regex=r"(yes|no)"), []))
    assert _mask_ids(state) == plain | {START}  # the grammar's, or open a section
    state.accept(START)
    assert state.allowed() is None
    direct = backend.matcher(sp, [])
    direct.accept(4607)  # no section: the grammar held from the first token
    assert _mask_ids(direct) == {2}


def test_replay_skips_the_thinking_tokens(backend):
    """A retracted request (or a PD decode server's first token) comes back with output."""
    sp = SamplingParams(regex=r"(yes|no)", reasoning_gate=[START, END, 0])
    state = backend.matcher(sp, [START, 500, 12, END, 10407])
    assert _mask_ids(state) == {2} and not state.failed


def test_reasoning_gate_is_checked():
    with pytest.raises(ValueError, match="reasoning_gate"):
        SamplingParams(regex="a", reasoning_gate=[1, 2])
