"""Structured output's limits (docs/api.md "Structured output"), checked on the request's text
before llguidance compiles anything, and llguidance's own limits for the compile itself.

Why these, measured with llguidance 1.9 over SmolLM2's tokenizer on 2 shared cores:
- the grammar's size bounds everything llguidance does before its own limits apply (the JSON
  schema -> grammar conversion runs first: an 8000-property schema took 2.5 s before
  max_grammar_size refused it);
- optional properties of one object cost quadratically (every subset of them may follow):
  1000 compiled in 0.2 s, 5000 in 6 s with 145 ms per token mask, and 16000 (a 1.2 MB
  schema) overflowed llguidance's symbol table after 10 s -- a panic, not an error. Past
  498 the answer fails at its second token anyway: the parser's row after `{"` holds 4 items
  per optional property, and llguidance allows 2000 (max_items_in_row);
- all properties together cost linearly (5000 required ones: 0.4 s); OpenAI allows 5000;
- nested counted repetitions (`(a{1,100}){1,100}`) are compiled lazily by the lexer, one
  state per count combination: past ~1000 combinations an answer of a's ran out of lexer
  states after a few tokens (the request failed mid-answer), while a single `a{1,10000}`
  is cheap.
Nothing here imports llguidance except parser_limits (SamplingParams runs these checks).
"""
from __future__ import annotations

import functools
import json
import re
from typing import Any

MAX_GRAMMAR_BYTES = 512 * 1024  # the request field's text (a schema as JSON)
MAX_SCHEMA_PROPERTIES = 5000  # all objects' properties together (OpenAI's limit)
MAX_OPTIONAL_PROPERTIES = 450  # properties of one object that are not `required`
MAX_NESTED_REPEAT = 1000  # product of nested {m,n} bounds in one regex

_BOUND = re.compile(r"\{(\d+)(,(\d*))?\}")
_BIG = 10 ** 9  # bounds are capped here: the product stays a small int


def parser_limits():
    """llguidance's limits for every compile (the API's check and the runner's matchers):
    its defaults, which bound the lexer's and parser's work per compile and per token, with
    error messages that never include the grammar or the parser state."""
    import llguidance  # noqa: PLC0415 - only servers that see grammars load it

    return llguidance.LLParserLimits(verbose_errors=False)


def limits_problem(field: str, text: str) -> str:
    """'' when `text` (the json_schema / regex / ebnf / structural_tag field) is within the
    limits, else why not (a phrase: "is too large: ..."). Cheap: no llguidance. Text that is
    not even JSON passes here; the compile check names that."""
    if len(text) * 4 > MAX_GRAMMAR_BYTES and len(text.encode()) > MAX_GRAMMAR_BYTES:
        return (f"is too large: {len(text.encode())} bytes (the limit is "
                f"{MAX_GRAMMAR_BYTES})")
    return _shape_problem(field, text)


# Cached (SamplingParams checks where it is built, once per choice, and again where it is
# decoded), only for texts within the size limit: at most 32 x 512 KiB held.
@functools.lru_cache(maxsize=32)
def _shape_problem(field: str, text: str) -> str:
    if field == "regex":
        return _regex_problem(text)
    if field not in ("json_schema", "structural_tag"):
        return ""  # ebnf: llguidance's own limits (parser_limits) bound its compile
    try:
        value = json.loads(text)
    except RecursionError:
        return "is nested too deeply"
    except ValueError:
        return ""
    if field == "structural_tag":
        structures = value.get("structures") if isinstance(value, dict) else None
        value = [s.get("schema") for s in structures if isinstance(s, dict)] \
            if isinstance(structures, list) else []
    return _schema_problem(value)


def _schema_problem(schema: Any) -> str:
    """Counts properties over every object of the schema(s), without recursion (a deep
    schema must not overflow the stack here)."""
    total = 0
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        props = node.get("properties")
        if isinstance(props, dict):
            total += len(props)
            required = node.get("required")
            required = {r for r in required if isinstance(r, str)} \
                if isinstance(required, list) else set()
            optional = sum(1 for name in props if name not in required)
            if optional > MAX_OPTIONAL_PROPERTIES:
                return (f"is too complex: an object has {optional} optional properties (the "
                        f"limit is {MAX_OPTIONAL_PROPERTIES} per object; list the others in "
                        f"`required`)")
        patterns = [node.get("pattern")]
        if isinstance(node.get("patternProperties"), dict):
            patterns += list(node["patternProperties"])
        for pattern in patterns:
            problem = _regex_problem(pattern) if isinstance(pattern, str) else ""
            if problem:
                return f"has a pattern that {problem}"
        stack.extend(node.values())
    if total > MAX_SCHEMA_PROPERTIES:
        return (f"is too complex: {total} properties in all (the limit is "
                f"{MAX_SCHEMA_PROPERTIES})")
    return ""


def _regex_problem(pattern: str) -> str:
    product = nested_repeat(pattern)
    if product > MAX_NESTED_REPEAT:
        return (f"is too complex: its nested counted repetitions allow {product} "
                f"combinations (the limit is {MAX_NESTED_REPEAT}; use + or * for an "
                f"outer repetition)")
    return ""


def nested_repeat(pattern: str) -> int:
    """The largest product of {m,n} bounds along one nesting path that goes through at least
    two of them (`((a{1,100}){1,100})` -> 10000; a lone `a{1,5000}` -> 1). A rough scan, not
    a parser: escapes and [classes] are skipped, `{m,}` counts m, *, + and ? count 1; a
    pattern it cannot follow (unbalanced) is left to llguidance to refuse."""
    # per open group: [best product inside, has a counted repetition inside, last element]
    stack: list[list] = [[1, False, None]]
    worst, i, n = 1, 0, len(pattern)
    while i < n:
        ch = pattern[i]
        frame = stack[-1]
        if ch == "\\":
            # \p{L}, \x{41}, \u{1F600}: the braces belong to the escape
            braced = i + 2 < n and pattern[i + 1] in "pPxu" and pattern[i + 2] == "{"
            i = (pattern.find("}", i + 3) + 1 or n) if braced else i + 2
            frame[2] = (1, False)
            continue
        if ch == "[":
            i = _class_end(pattern, i)
            frame[2] = (1, False)
            continue
        if ch == "(":
            stack.append([1, False, None])
        elif ch == ")" and len(stack) > 1:
            best, counted, _ = stack.pop()
            parent = stack[-1]
            parent[0], parent[1] = max(parent[0], best), parent[1] or counted
            parent[2] = (best, counted)
        elif ch == "|":
            frame[2] = None
        elif ch == "{" and frame[2] is not None and _BOUND.match(pattern, i):
            m = _BOUND.match(pattern, i)
            bound = min(int(m.group(3) or m.group(1)), _BIG)
            best, counted = frame[2]
            product = best * bound
            if counted:
                worst = max(worst, product)
            frame[0], frame[1] = max(frame[0], product), True
            frame[2] = (product, True)
            i = m.end()
            continue
        elif ch not in "*+?":
            frame[2] = (1, False)
        i += 1
    return worst


def _class_end(pattern: str, i: int) -> int:
    """The index after the [character class] that opens at i (nested classes and [:name:]
    included, as Rust's regex syntax allows)."""
    n, depth = len(pattern), 1
    i += 1
    if i < n and pattern[i] == "^":
        i += 1
    if i < n and pattern[i] == "]":
        i += 1  # a leading ] is a literal
    while i < n and depth:
        if pattern[i] == "\\":
            i += 1
        elif pattern[i] == "[":
            depth += 1
        elif pattern[i] == "]":
            depth -= 1
        i += 1
    return i
