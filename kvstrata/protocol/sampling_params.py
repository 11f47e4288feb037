"""Per-request sampling parameters, validated once at construction.

Field names follow SGLang's `sampling_params` dict (max_new_tokens, top_k, min_p, ...).
Every out-of-range value raises ValueError naming the field, so the HTTP layer can turn it
into a 400 that names the offending parameter. A grammar is checked against the limits here
(cheap); whether it compiles is protocol/grammar.py check_grammar's, run apart, because it
can take seconds and construction also runs where a request is decoded (the scheduler).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from kvstrata.protocol.grammar import check_grammar_limits

# top_k <= 0 (SGLang uses -1) means "no top-k cut".
TOP_K_ALL = -1
# Integers cross process boundaries as msgpack, which holds [-2**63, 2**64): anything wider
# is refused here by name rather than failing later as an OverflowError.
_INT64_MIN, _UINT64_MAX = -(1 << 63), (1 << 64) - 1
_TOKEN_ID_MAX = (1 << 63) - 1


GREEDY_TEMPERATURE_EPS = 1e-6
# OpenAI's range for logit_bias values; vLLM clamps to it, SGLang adds any value: clamping
# keeps SGLang clients' "-1e9 bans a token" working with the same effect (-100 is a ban).
# The OpenAI routes refuse values outside it, as OpenAI does (serving_openai.py).
LOGIT_BIAS_LIMIT = 100.0
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")


def _as_list(value: Any, name: str, what: str, wrap: type | None = None) -> list:
    """SGLang's list-typed fields: None is empty, `wrap` (a lone str for `stop`) is one item,
    a list or tuple is taken as is; anything else (a number, a bool, a dict) is a ValueError
    naming the field -- never iterated into something the client did not mean."""
    if value is None:
        return []
    if wrap is not None and isinstance(value, wrap):
        return [value]
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ValueError(f"{name} must be {what}, got {value!r}")


def _compiles(pattern: str) -> bool:
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError):
        return False
    return True


def _logit_bias(value: Any) -> dict[int, float]:
    """{token id (an int or its decimal string): number} -> {int: float clamped to +-100}.
    Anything else is a ValueError naming logit_bias (NaN has no meaning as a bias)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be an object mapping token ids to numbers, "
                         f"got {value!r}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = key
        if isinstance(key, str) and key.isascii() and key.isdigit():
            token = int(key)
        if not (isinstance(token, int) and not isinstance(token, bool)
                and 0 <= token <= _TOKEN_ID_MAX):
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers "
                             f"below 2**63), got {key!r}")
        if not (isinstance(bias, (int, float)) and not isinstance(bias, bool)) \
                or bias != bias:
            raise ValueError(f"logit_bias values must be numbers, got {bias!r} for "
                             f"token {token}")
        out[token] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(bias)))
    return out


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    # SGLang's stop_regex: the request stops (finish "stop", matched = the pattern) once the
    # output's tail contains a match; the match stays in the text (SGLang does not trim it).
    stop_regex: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # None: no logprobs. n >= 0: the sampled token's logprob plus the top-n alternatives.
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # SGLang's no_stop_trim: keep a matched stop string in the output text.
    no_stop_trim: bool = False
    # OpenAI's logit_bias: {token id: value added to its logit}, values clamped to +-100.
    # Clients send the ids as strings (JSON object keys); kept here as ints.
    logit_bias: dict[int, float] = field(default_factory=dict)
    # SGLang's per-request --stream-interval: stream every this many tokens (None: the
    # server's).
    stream_interval: int | None = None
    # SGLang's token_ids_logprob (a /generate request field, kept here so that the sampler
    # sees it): these ids' logprobs at every reported position, after the top-n alternatives
    # in each row's top list (split_top_logprobs separates them again). Needs `logprobs`.
    token_ids_logprob: list[int] = field(default_factory=list)
    # Structured output (SGLang's sampling_params keys; at most one): a JSON schema (as a
    # JSON string), a regular expression the whole output matches, an EBNF grammar (GBNF,
    # or llguidance's Lark syntax), or a structural tag (tool calls in free text). The
    # sampler masks every token that cannot continue it (runner/sampling/grammar.py);
    # protocol/grammar.py checks their limits here, check_grammar whether they compile.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None  # a JSON string (protocol/grammar.py struct_tags)
    # SGLang's grammar after reasoning (set by the chat route under --reasoning-parser):
    # [start id or -1, end id, 1 if the answer starts inside]: the grammar waits while the
    # answer is inside a thinking section (start_id as its first token opens one, end_id
    # closes it); runner/sampling/grammar.py ThinkingGate.
    reasoning_gate: list[int] | None = None

    def __post_init__(self) -> None:
        self.stop = _as_list(self.stop, "stop", "a non-empty string or a list of non-empty "
                             "strings", wrap=str)
        self.stop_regex = _as_list(self.stop_regex, "stop_regex", "a regular expression or a "
                                   "list of them", wrap=str)
        self.stop_token_ids = _as_list(self.stop_token_ids, "stop_token_ids",
                                       "a list of non-negative integers below 2**63")
        self.logit_bias = _logit_bias(self.logit_bias)
        self.token_ids_logprob = _as_list(self.token_ids_logprob, "token_ids_logprob",
                                          "a list of non-negative integers below 2**63")
        self.validate()

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "SamplingParams":
        d = dict(d or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unsupported sampling parameter(s): {', '.join(unknown)}")
        return cls(**{k: v for k, v in d.items() if v is not None})

    @property
    def is_greedy(self) -> bool:
        # SGLang: a temperature below 1e-6 samples greedily (dividing logits by a tiny or
        # subnormal temperature overflows them to inf and the softmax to NaN).
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    @property
    def grammar_field(self) -> str | None:
        """Which of json_schema / regex / ebnf / structural_tag constrains the output (None:
        none does)."""
        given = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:  # SGLang's rule
            raise ValueError(f"{given[0]} and {given[1]}: give at most one of json_schema, "
                             f"regex, ebnf and structural_tag")
        return given[0] if given else None

    @property
    def grammar_key(self) -> tuple[str, str] | None:
        """(field, text) of its grammar: what compiled grammars are kept by, on every rank."""
        field = self.grammar_field
        return None if field is None else (field, getattr(self, field))

    def validate(self) -> None:
        def check(name: str, ok: bool, why: str) -> None:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        check("max_new_tokens", is_int(self.max_new_tokens)
              and 0 <= self.max_new_tokens <= _TOKEN_ID_MAX, "must be an integer in [0, 2**63)")
        check("min_new_tokens", is_int(self.min_new_tokens) and 0 <= self.min_new_tokens,
              "must be an integer >= 0")
        check("min_new_tokens", self.min_new_tokens <= self.max_new_tokens,
              "must be <= max_new_tokens")
        check("temperature", is_num(self.temperature) and 0.0 <= self.temperature <= 100.0,
              "must be in [0, 100]")
        check("top_p", is_num(self.top_p) and 0.0 < self.top_p <= 1.0, "must be in (0, 1]")
        check("top_k", is_int(self.top_k) and (self.top_k == TOP_K_ALL
                                              or 1 <= self.top_k <= _TOKEN_ID_MAX),
              "must be -1 (disabled) or >= 1")
        check("min_p", is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "must be in [0, 1]")
        check("repetition_penalty",
              is_num(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0,
              "must be in (0, 2]")
        check("frequency_penalty",
              is_num(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
              "must be in [-2, 2]")
        check("presence_penalty",
              is_num(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
              "must be in [-2, 2]")
        check("seed", self.seed is None or (is_int(self.seed)
                                            and _INT64_MIN <= self.seed <= _UINT64_MAX),
              "must be an integer in [-2**63, 2**64)")
        check("stop", all(isinstance(s, str) and s for s in self.stop),
              "must be a non-empty string or a list of non-empty strings")
        check("stop_regex", all(isinstance(r, str) and r and _compiles(r)
                                for r in self.stop_regex),
              "must be a valid (Python) regular expression or a list of them")
        check("stop_token_ids",
              all(is_int(t) and 0 <= t <= _TOKEN_ID_MAX for t in self.stop_token_ids),
              "must be a list of non-negative integers below 2**63")
        check("ignore_eos", isinstance(self.ignore_eos, bool), "must be a boolean")
        check("no_stop_trim", isinstance(self.no_stop_trim, bool), "must be a boolean")
        check("token_ids_logprob",
              all(is_int(t) and 0 <= t <= _TOKEN_ID_MAX for t in self.token_ids_logprob),
              "must be a list of non-negative integers below 2**63")
        check("token_ids_logprob", not self.token_ids_logprob or self.logprobs is not None,
              "needs logprobs (return_logprob)")
        check("stream_interval", self.stream_interval is None or (
            is_int(self.stream_interval) and 1 <= self.stream_interval <= _TOKEN_ID_MAX),
              "must be null or an integer >= 1")
        for name in GRAMMAR_FIELDS:
            check(name, getattr(self, name) is None or isinstance(getattr(self, name), str),
                  "must be a string")
        if self.grammar_field is not None:
            check_grammar_limits(self)
        gate = self.reasoning_gate
        check("reasoning_gate", gate is None or (
            isinstance(gate, list) and len(gate) == 3 and all(is_int(t) for t in gate)
            and gate[0] >= -1 and 0 <= gate[1] <= _TOKEN_ID_MAX and gate[2] in (0, 1)),
              "must be null or [start id or -1, end id, 0 or 1]")
        check("logprobs", self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= 20),
              "must be null or an integer in [0, 20]")


def split_top_logprobs(row: list | None, params: SamplingParams) -> tuple[list, list]:
    """One reported position's top list -> (the top-n alternatives, the logprobs of
    params.token_ids_logprob in their order): the sampler appends the second to the first."""
    if row is None:
        return [], []
    cut = len(row) - len(params.token_ids_logprob)
    return row[:cut], row[cut:]
