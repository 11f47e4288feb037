"""The multi-turn PD bench's per-turn summary and the decode radix cache's ratios."""
from __future__ import annotations

import math

from kvstrata.bench.pd_multiturn import per_turn, radix_ratios


def test_per_turn_means_and_radix_ratios():
    rows = [{"turn": 1, "bytes": 1000, "ttft_ms": 50.0}, {"turn": 2, "bytes": 1200,
                                                         "ttft_ms": 60.0},
            {"turn": 1, "bytes": 3000, "ttft_ms": 70.0}, {"turn": 2, "bytes": 1400,
                                                         "ttft_ms": 80.0}]
    off = per_turn(rows)
    assert off[1] == {"n": 2, "bytes_mean": 2000.0, "ttft_p50_ms": 60.0}
    assert off[2]["bytes_mean"] == 1300.0
    on = per_turn([{"turn": 1, "bytes": 2000, "ttft_ms": 60.0},
                   {"turn": 2, "bytes": 130, "ttft_ms": 35.0}])
    r = radix_ratios(off, on)
    assert list(r) == [2]  # turn 1 has nothing to reuse
    assert math.isclose(r[2]["bytes_without_over_with"], 10.0)
    assert math.isclose(r[2]["ttft_p50_with_over_without"], 0.5)
    assert radix_ratios(off, per_turn([{"turn": 2, "bytes": 0, "ttft_ms": 1.0}]))[2][
        "bytes_without_over_with"] == float("inf")  # a whole-prompt hit moves nothing


def test_multiturn_followup_length_is_its_own_knob():
    """--followup-len sets the words of every message after the first (default a quarter
    of --input-len), so a long-context chat with short follow-ups can be benchmarked."""
    import argparse
    import random

    from kvstrata.bench.serve_client import make_conversations
    ns = argparse.Namespace(dataset="multiturn", num_prompts=6, num_turns=3, input_len=100)
    convs = make_conversations(ns, random.Random(0))
    assert len(convs) == 2 and all(len(c) == 3 for c in convs)
    assert [len(m.split()) for m in convs[0]] == [100, 25, 25]
    ns.followup_len = 7
    assert [len(m.split()) for m in make_conversations(ns, random.Random(0))[1]] == [100, 7, 7]
