"""--reasoning-parser (entrypoints/reasoning.py): a thinking model's answer split into its
thinking section and the rest, whole and streamed (the stream adds up to the whole split for
any chunking: hypothesis), and where the section starts (the model's marker, the parser, or
a prompt whose template opened it)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.config.server_args import REASONING_PARSERS
from kvstrata.entrypoints.reasoning import (FORMATS, ReasoningPlan, ReasoningStream,
                                            plan_reasoning, split)

EXAMPLES = int(os.environ.get("KVSTRATA_FUZZ_EXAMPLES", "150"))
QWEN3, R1 = FORMATS["qwen3"], FORMATS["deepseek-r1"]


def test_flag_choices_are_the_built_formats():
    assert set(REASONING_PARSERS) == set(FORMATS)


@pytest.mark.parametrize("fmt,text,thinking,want", [
    (QWEN3, "<think>\nLet me see.\n</think>\n\nParis.", False, ("Let me see.\n", "Paris.")),
    (QWEN3, "Paris.", False, ("", "Paris.")),  # no section: all content
    (QWEN3, "Paris </think> x", False, ("", "Paris </think> x")),
    (QWEN3, "Hmm.</think>Paris.", True, ("Hmm.", "Paris.")),  # the prompt opened it
    (R1, "Hmm.</think>Paris.", False, ("Hmm.", "Paris.")),  # R1 always starts thinking
    (R1, "<think>Hmm.</think>Paris.", False, ("Hmm.", "Paris.")),  # R1-0528 writes it
    (QWEN3, "<think>still thinking", False, ("still thinking", "")),  # cut off
    # Qwen3.5 may open a tool call without closing the section: the call is content
    (QWEN3, "<think>Call it.<tool_call>\n{}", False, ("Call it.", "<tool_call>\n{}")),
    (FORMATS["kimi"], "◁think▷a◁/think▷b", False, ("a", "b")),
    (FORMATS["mistral"], "[THINK]a[/THINK]b", False, ("a", "b")),
])
def test_split_whole(fmt, text, thinking, want):
    assert split(fmt, text, thinking, final=True) == want


def test_prompt_that_opens_the_section():
    args = SimpleNamespace(reasoning_parser="qwen3")
    body = SimpleNamespace(separate_reasoning=True, stream_reasoning=True)
    assert plan_reasoning(args, body, "<|im_start|>assistant\n<think>\n").thinking
    # enable_thinking false: Qwen3's template writes an empty, closed section
    assert not plan_reasoning(args, body, "assistant\n<think>\n\n</think>\n\n").thinking
    assert not plan_reasoning(args, body, "<|im_start|>assistant\n").thinking
    # an earlier turn's closed section; continue_final_message on a turn still thinking
    assert not plan_reasoning(args, body, "<think>a</think>b<|im_start|>assistant\n").thinking
    assert plan_reasoning(args, body, "assistant\n<think>I was sayi").thinking
    assert plan_reasoning(SimpleNamespace(reasoning_parser="deepseek-r1"), body, "").thinking
    assert plan_reasoning(SimpleNamespace(reasoning_parser=None), body, "") is None
    body.separate_reasoning = False  # the thinking stays in the content
    assert plan_reasoning(args, body, "") is None


def _stream(plan: ReasoningPlan, text: str, cuts: list[int]) -> list[tuple[str, str]]:
    stream = ReasoningStream(plan)
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    return [stream.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [stream.finish()]


def test_stream_reasoning_false_sends_the_thinking_in_one_delta():
    plan = ReasoningPlan(QWEN3, thinking=False, stream_reasoning=False)
    parts = _stream(plan, "<think>a b c</think>Paris", [8, 10, 12, 15, 20])
    assert [r for r, _ in parts if r] == ["a b c"]
    assert "".join(c for _, c in parts) == "Paris"


_piece = st.sampled_from(["<think>", "</think>", "<", "</", "<thi", "think>", "\n", " ",
                          "Paris", "é", "<tool_call>", "[THINK]", "[/THINK]", "x"])


@settings(max_examples=EXAMPLES, deadline=None)
@given(name=st.sampled_from(sorted(FORMATS)), pieces=st.lists(_piece, max_size=12),
       thinking=st.booleans(), stream_reasoning=st.booleans(),
       cuts=st.lists(st.integers(0, 120), max_size=20))
def test_stream_adds_up_to_the_whole_split(name, pieces, thinking, stream_reasoning, cuts):
    plan = ReasoningPlan(FORMATS[name], thinking, stream_reasoning)
    text = "".join(pieces)
    parts = _stream(plan, text, cuts)
    assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == \
        split(plan.fmt, text, thinking, final=True)


class _Tok:
    """Encodes the thinking markers as one token each (as Qwen3's tokenizer does)."""

    def __init__(self, ids: dict[str, int]):
        self.ids = ids

    def encode(self, text, add_special_tokens=False):
        return [self.ids[text]] if text in self.ids else [1, 2]


def test_grammar_gate_needs_one_token_markers():
    tok = _Tok({"<think>": 7, "</think>": 8})
    assert ReasoningPlan(QWEN3, thinking=True).grammar_gate(tok) == [7, 8, 1]
    assert ReasoningPlan(QWEN3, thinking=False).grammar_gate(tok) == [7, 8, 0]
    assert ReasoningPlan(R1, thinking=False).grammar_gate(tok) == [7, 8, 1]  # forced
    assert ReasoningPlan(QWEN3, False).grammar_gate(_Tok({"</think>": 8})) == [-1, 8, 0]
    assert ReasoningPlan(QWEN3, False).grammar_gate(_Tok({"<think>": 7})) is None


def test_the_gate_goes_only_with_a_grammar():
    from kvstrata.entrypoints.api.openai_protocol import ChatCompletionRequest
    from kvstrata.entrypoints.api.serving_openai import build_sampling_params

    def params(**extra):
        body = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], **extra}, strict=False)
        return build_sampling_params(body, 8, None, 0, "max_tokens", reasoning_gate=[7, 8, 1])

    assert params(regex="(yes|no)").reasoning_gate == [7, 8, 1]
    assert params().reasoning_gate is None
