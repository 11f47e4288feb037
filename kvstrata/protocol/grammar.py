"""Structured output requests -> llguidance grammars (no torch; llguidance is imported on first
use, so a server that never sees a grammar never loads it).

SGLang's request kinds, with SGLang's field names: `json_schema` (a JSON schema as a JSON
string; OpenAI's response_format json_object / json_schema become one), `regex` (the whole
output matches it), `ebnf` (a GBNF grammar as xgrammar and llama.cpp write them,
`root ::= ...`, or llguidance's Lark syntax) and `structural_tag` (free text with tool calls
whose arguments follow JSON schemas, response_format's structural_tag). llguidance is one of SGLang's grammar backends
(`--grammar-backend llguidance`) and vLLM's `guidance`; the runner turns a grammar into a
token mask per step (runner/sampling/grammar.py).
"""
from __future__ import annotations

import functools
import json
from typing import Any, Callable

from kvstrata.protocol.grammar_limits import limits_problem, parser_limits

# A grammar's error message is cut here: llguidance prints the grammar after its message.
_MESSAGE_LIMIT = 400
# How the runner's message for a grammar that failed while decoding starts (the API names
# the request's field in the 400 it becomes: serving_openai.output_error).
GRAMMAR_FAILED = "The request's grammar failed: "


def json_options(disable_any_whitespace: bool = False,
                 whitespace_pattern: str | None = None) -> dict[str, Any]:
    """llguidance's JSON compile options for the server's flags: by default any JSON
    whitespace may appear between tokens (SGLang's and vLLM's default);
    --constrained-json-disable-any-whitespace allows none (compact JSON),
    --constrained-json-whitespace-pattern gives the pattern."""
    if whitespace_pattern:
        return {"whitespace_pattern": whitespace_pattern}
    return {"whitespace_flexible": not disable_any_whitespace}


def llguidance_grammar(field: str, text: str, options: dict[str, Any] | None = None,
                       is_special: Callable[[str], bool] | None = None) -> str:
    """The llguidance grammar (a JSON string) of one request field. Raises ValueError for
    text that is not even JSON (json_schema, structural_tag) or not convertible GBNF (ebnf);
    a grammar that converts but is wrong is found by check_grammar / the matcher.
    `is_special(trigger)`: whether a structural tag's trigger is one special token of the
    model's tokenizer (the runner knows; without it, triggers are text)."""
    import llguidance  # noqa: PLC0415 - only servers that see grammars load it
    from llguidance.gbnf_to_lark import any_to_lark  # noqa: PLC0415

    if field == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=options)
    if field == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if field == "ebnf":
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(text))
    if field == "structural_tag":
        tags = struct_tags(text)
        special = is_special is not None and all(is_special(t.trigger) for t in tags)
        return llguidance.LLMatcher.grammar_from_lark(
            llguidance.StructTag.to_grammar(tags, assume_special=special))
    raise ValueError(f"unknown grammar field {field!r}")


def struct_tags(text: str) -> list:
    """SGLang's structural tag (a JSON string: {"structures": [{"begin", "schema", "end"}],
    "triggers": [...]}, the response_format's type key allowed) -> llguidance StructTags:
    free text until a trigger, then a structure whose begin starts with that trigger, its
    JSON schema, its end; then free text again. Each structure takes the trigger its begin
    starts with (the longest)."""
    import llguidance  # noqa: PLC0415

    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    structures = spec.get("structures") if isinstance(spec, dict) else None
    triggers = spec.get("triggers") if isinstance(spec, dict) else None
    if not (isinstance(structures, list) and structures and isinstance(triggers, list)
            and triggers and all(isinstance(t, str) and t for t in triggers)):
        raise ValueError("needs a non-empty list of structures and of non-empty trigger "
                         "strings")
    tags = []
    for i, st in enumerate(structures):
        if not (isinstance(st, dict) and isinstance(st.get("begin"), str)
                and isinstance(st.get("end"), str)
                and isinstance(st.get("schema"), (dict, bool))):
            raise ValueError(f"structures[{i}] needs begin and end strings and a JSON schema "
                             f"object")
        starts = [t for t in triggers if st["begin"].startswith(t)]
        if not starts:
            raise ValueError(f"structures[{i}].begin {st['begin']!r} starts with no trigger")
        tags.append(llguidance.StructTag(trigger=max(starts, key=len), begin=st["begin"],
                                         grammar=json.dumps(st["schema"]), end=st["end"]))
    return tags


@functools.lru_cache(maxsize=64)
def grammar_error(field: str, text: str) -> str:
    """'' when `text` is a valid grammar of its kind, else llguidance's message, as it is
    (cached: 64 texts, each within the size limit when grammar_problem calls it). Compiles
    under parser_limits, so it takes as long as the grammar is large: call it where that
    blocks nothing (grammar_problem checks the cheap limits first)."""
    import llguidance  # noqa: PLC0415

    try:
        grammar = llguidance_grammar(field, text)
    except Exception as e:  # noqa: BLE001 - any conversion failure is the client's grammar
        return str(e) or type(e).__name__
    return llguidance.LLMatcher.validate_grammar(grammar, limits=parser_limits())


def clean_message(message: str) -> str:
    """llguidance's message for a client: without what it appends (the parser state, a
    panic's backtrace with the build's paths), on one line, at most _MESSAGE_LIMIT long. A
    panic (an internal assertion, e.g. a grammar past its symbol table) says only that the
    grammar is too large: its text means nothing to the client."""
    for marker in ("<state>", "<backtrace>", "<non-verbose/>"):
        message = message.split(marker)[0]
    message = " ".join(message.split())
    if message.startswith("panic") or "panicked at" in message:
        return "too large or complex to compile"
    if len(message) > _MESSAGE_LIMIT:
        message = message[:_MESSAGE_LIMIT] + " ..."
    return message


def grammar_problem(field: str, text: str) -> str:
    """'' when the field's text is within the limits and compiles, else why not, as a
    phrase that follows the field's name ("is not a valid JSON schema: ...")."""
    problem = limits_problem(field, text)
    if problem:
        return problem
    message = grammar_error(field, text)
    return f"is not a valid {_KIND[field]}: {clean_message(message)}" if message else ""


def check_grammar_limits(params: Any) -> None:
    """ValueError naming the field when the request's grammar is past the limits
    (grammar_limits.py). Cheap: SamplingParams runs it wherever it is built or decoded."""
    field = params.grammar_field
    problem = limits_problem(field, getattr(params, field)) if field else ""
    if problem:
        raise ValueError(f"{field} {problem}")


def check_grammar(params: Any) -> None:
    """ValueError naming the field when the request's grammar is past the limits or is not
    one llguidance can compile. Slow for a large grammar: the API server runs it off its
    event loop (api/grammar_check.py), LLM() before it adds the request."""
    field = params.grammar_field
    problem = grammar_problem(field, getattr(params, field)) if field else ""
    if problem:
        raise ValueError(f"{field} {problem}")


_KIND = {"json_schema": "JSON schema", "regex": "regular expression",
         "ebnf": "EBNF grammar", "structural_tag": "structural tag"}
