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

# A grammar's error message is cut here: llguidance prints the grammar after its message.
_MESSAGE_LIMIT = 400


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


@functools.lru_cache(maxsize=256)
def grammar_error(field: str, text: str) -> str:
    """'' when `text` is a valid grammar of its kind, else llguidance's message (cached: a
    request's params are checked where they are built and again where they are decoded)."""
    import llguidance  # noqa: PLC0415

    try:
        grammar = llguidance_grammar(field, text)
    except Exception as e:  # noqa: BLE001 - any conversion failure is the client's grammar
        return str(e) or type(e).__name__
    return llguidance.LLMatcher.validate_grammar(grammar)


def check_grammar(params: Any) -> None:
    """ValueError naming the field when the request's json_schema / regex / ebnf is not a
    grammar llguidance can compile."""
    field = params.grammar_field
    if field is None:
        return
    message = grammar_error(field, getattr(params, field))
    if message:
        message = " ".join(message.split("<state>")[0].split())
        if len(message) > _MESSAGE_LIMIT:
            message = message[:_MESSAGE_LIMIT] + " ..."
        raise ValueError(f"{field} is not a valid {_KIND[field]}: {message}")


_KIND = {"json_schema": "JSON schema", "regex": "regular expression",
         "ebnf": "EBNF grammar", "structural_tag": "structural tag"}
