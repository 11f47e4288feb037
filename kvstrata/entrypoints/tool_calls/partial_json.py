"""JSON that is still being generated: parse a prefix, and stream a call's arguments.

A streamed tool call's `arguments` deltas must add up to exactly the string the same call
gets without streaming (`json.dumps(args, ensure_ascii=False)`), so a delta is only ever
cut from a serialisation that cannot change any more: the part of the partial object's
serialisation before its synthesised closers and before a trailing number (`1.0` may
still become `1.0e5`). jiter (pydantic's parser) parses the prefixes.
"""
from __future__ import annotations

import json
import logging
from typing import Any

import jiter

logger = logging.getLogger(__name__)
_DECODER = json.JSONDecoder()
_LITERALS = ("true", "false", "null")
_CLOSERS = '"}] '
_NUMBER_CHARS = "0123456789.eE+-"


def dumps(value: Any) -> str:
    """The arguments string of a finished call (SGLang's and vLLM's form)."""
    return json.dumps(value, ensure_ascii=False)


def parse_prefix(text: str) -> tuple[Any, bool]:
    """(value, complete) of the JSON value `text` starts with, allowing it to be cut short
    (an unfinished trailing string is kept, an unfinished number or literal dropped).
    complete is True when the whole value is there. Raises ValueError when `text` cannot be
    the start of a JSON value."""
    stripped = text.strip()
    if not stripped:
        raise ValueError("no JSON value yet")
    try:
        return json.loads(stripped), True
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # a whole value, then something else
            return json.loads(stripped[:e.pos]), True
    try:
        return jiter.from_json(stripped.encode(), partial_mode="trailing-strings"), False
    except ValueError:
        raise ValueError(f"not the start of a JSON value: {stripped[:40]!r}") from None


def end_of_value(text: str, start: int = 0) -> int | None:
    """Index just past the JSON value at `start` in `text` (after whitespace); None while
    it is unfinished. Raises ValueError when it is not JSON (whatever follows)."""
    start = len(text) - len(text[start:].lstrip())
    try:
        _, end = _DECODER.raw_decode(text, start)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except json.JSONDecodeError as e:
        if e.msg.startswith("Unterminated string") or _unfinished(text[e.pos:].rstrip()):
            return None
        raise ValueError(f"not JSON at {text[start:start + 40]!r}: {e.msg}") from None
    return end


def _unfinished(tail: str) -> bool:
    """Whether the text a JSON decoder stopped at may still become a value: nothing yet, an
    unfinished literal or number."""
    return not tail or any(lit.startswith(tail) for lit in _LITERALS) or all(
        c in _NUMBER_CHARS for c in tail)


def stable_prefix(partial: Any) -> str:
    """The part of `dumps(partial)` no later text can change: its closing quotes and
    brackets (synthesised for what is still open) and a trailing number are cut off."""
    text = dumps(partial).rstrip(_CLOSERS)
    if text[-1:] and "\ud800" <= text[-1] <= "\udbff":  # half of a surrogate pair
        text = text[:-1]
    return text.rstrip(_NUMBER_CHARS) if text[-1:] in _NUMBER_CHARS else text


class ArgumentStreamer:
    """Arguments deltas of one call: `update` with each new partial value, `finish` with the
    final one; the deltas concatenate to `dumps(final)`."""

    def __init__(self) -> None:
        self.sent = ""

    def update(self, partial: Any) -> str:
        candidate = stable_prefix(partial)
        if len(candidate) <= len(self.sent) or not candidate.startswith(self.sent):
            return ""
        delta, self.sent = candidate[len(self.sent):], candidate
        return delta

    def finish(self, final: Any) -> str:
        whole = dumps(final)
        if not whole.startswith(self.sent):  # never expected: stable_prefix only cuts
            logger.warning("streamed tool-call arguments %r are not a prefix of %r",
                           self.sent, whole)
            return ""
        delta, self.sent = whole[len(self.sent):], whole
        return delta
