"""SGLang's stop_regex in the stop checker: the first token whose text completes a match ends
the request (finish stop, matched = the pattern), bounded patterns search a tail window,
unbounded ones the whole output; bad patterns are refused by name."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvstrata.engine.scheduler.stop_checker import StopChecker, max_match_chars
from kvstrata.protocol.sampling_params import SamplingParams

PIECES = ["he", "llo", " wor", "ld", " 4", "2", "!", "\n", "x"]


class Pieces:
    """Token i decodes to PIECES[i]."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(PIECES[i] for i in ids)


def _first_stop(pattern, ids, **kw):
    checker = StopChecker([99], 10_000, Pieces())
    params = SamplingParams(stop_regex=pattern, max_new_tokens=100, **kw)
    for n in range(1, len(ids) + 1):
        req = SimpleNamespace(params=params, output_ids=ids[:n], seq_len=n)
        reason = checker.check(req)
        if reason is not None:
            return n, reason
    return None, None


@pytest.mark.parametrize("pattern,stop_at", [
    (r"wor", 3), (r"world", 4), (r"[0-9]+", 5), (r"\d{2}", 6), (r"!$", 7),
    (r"hello.*42", 6), (r"(?i)HELLO", 2), (r"\n", 8), (r"nope", None)])
def test_stops_at_the_token_that_completes_the_first_match(pattern, stop_at):
    n, reason = _first_stop(pattern, list(range(9)))
    assert n == stop_at
    if stop_at is not None:
        assert (reason.type, reason.matched) == ("stop", pattern)


def test_several_patterns_and_min_new_tokens():
    n, reason = _first_stop(["zz", r"l+o"], list(range(9)))
    assert (n, reason.matched) == (2, r"l+o")
    n, _ = _first_stop(r"he", list(range(9)), min_new_tokens=3)
    assert n == 3  # the match is still in the (whole-output) window when allowed to stop


def test_match_width():
    assert max_match_chars("abc") == 3 and max_match_chars(r"\d{2,5}") == 5
    assert max_match_chars("a+") is None and max_match_chars("x{1,9999}") is None


@pytest.mark.parametrize("bad", ["a(", "", ["ok", "(?P<"], 5, ["ok", 3]])
def test_bad_patterns_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="^stop_regex"):
        SamplingParams(stop_regex=bad)
