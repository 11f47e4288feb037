"""--reasoning-parser: a thinking model's answer split into `reasoning_content` (its thinking
section) and `content` (SGLang's parsers and names; docs/api.md "Reasoning").

The thinking section is what comes between the format's start and end markers; a model
starts inside it when its parser says so (DeepSeek-R1 writes no start marker) or when the
rendered prompt already ends with the start marker (templates that open it for the model).
As for tool calls (tool_calls/), one split of the whole text so far answers both a finished
response and, after every chunk, a stream, which sends what the split added.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvstrata.entrypoints.tool_calls.core import held_prefix


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    forced: bool = False  # the answer always starts inside the thinking section
    # a marker that ends thinking too (Qwen3.5 / Kimi-K2 may open a tool call without
    # closing the section); it stays in the content, for the tool-call parser
    tool_start: str | None = None


_THINK, _END = "<think>", "</think>"
FORMATS = {
    "deepseek-r1": ReasoningFormat(_THINK, _END, forced=True),
    "deepseek-v3": ReasoningFormat(_THINK, _END),  # thinking when the template opens it
    "qwen3": ReasoningFormat(_THINK, _END, tool_start="<tool_call>"),
    "qwen3-thinking": ReasoningFormat(_THINK, _END, forced=True, tool_start="<tool_call>"),
    "glm45": ReasoningFormat(_THINK, _END),
    "kimi": ReasoningFormat("◁think▷", "◁/think▷"),
    "kimi_k2": ReasoningFormat(_THINK, _END, tool_start="<|tool_calls_section_begin|>"),
    "step3": ReasoningFormat(_THINK, _END, forced=True),
    "minimax": ReasoningFormat(_THINK, _END, forced=True),
    "mistral": ReasoningFormat("[THINK]", "[/THINK]"),  # Magistral
}


def split(fmt: ReasoningFormat, text: str, thinking: bool, final: bool) -> tuple[str, str]:
    """(reasoning, content) of `text`. `thinking`: the answer starts inside the section
    (so does every answer of a `forced` format). A partial split (final False) holds back
    what may still become a marker, so its parts only ever grow; the final one gives
    everything."""
    thinking = thinking or fmt.forced
    body = text.lstrip()
    if body.startswith(fmt.start):  # written by the model (or echoed after the prompt's)
        body, thinking = body[len(fmt.start):], True
    elif not final and (not body or fmt.start.startswith(body)):
        return "", ""  # may still open the section
    if not thinking:
        return "", text
    body = body.lstrip()
    stops = [(p, m) for m in (fmt.end, fmt.tool_start) if m and (p := body.find(m)) >= 0]
    if not stops:
        if final:
            return body, ""  # cut off while thinking
        keep = max(held_prefix(body, m) for m in (fmt.end, fmt.tool_start) if m)
        return body[:len(body) - keep], ""
    at, marker = min(stops)
    rest = body[at + len(marker):] if marker == fmt.end else body[at:]
    return body[:at], rest.lstrip()


@dataclass
class ReasoningPlan:
    fmt: ReasoningFormat
    thinking: bool  # the answer starts inside the thinking section
    stream_reasoning: bool = True  # False: the reasoning goes out in one delta, once done

    def split(self, text: str, final: bool = True) -> tuple[str, str]:
        return split(self.fmt, text, self.thinking, final)

    def grammar_gate(self, tokenizer) -> list[int] | None:
        """SamplingParams.reasoning_gate: a grammar waits for the thinking section to end.
        Needs the end marker to be one token (and the start marker, to let the answer open
        a section itself); None otherwise (the grammar holds from the first token)."""
        def one_id(text: str) -> int | None:
            ids = tokenizer.encode(text, add_special_tokens=False)
            return ids[0] if len(ids) == 1 else None

        end = one_id(self.fmt.end)
        if end is None:
            return None
        start = one_id(self.fmt.start)
        thinking = self.thinking or self.fmt.forced
        return [-1 if start is None else start, end, int(thinking)]


def plan_reasoning(server_args, body, prompt_tail: str) -> ReasoningPlan | None:
    """The chat request's plan under --reasoning-parser; None without it or with
    separate_reasoning false (the thinking stays in the content, as in SGLang)."""
    name = getattr(server_args, "reasoning_parser", None)
    if not name or not body.separate_reasoning:
        return None
    fmt = FORMATS[name]
    return ReasoningPlan(fmt, fmt.forced or opens_section(fmt, prompt_tail),
                         body.stream_reasoning)


def opens_section(fmt: ReasoningFormat, prompt_tail: str) -> bool:
    """Whether the prompt leaves the answer inside a thinking section: its last start
    marker comes after its last end marker (a template that opens the section for the model,
    or SGLang's continue_final_message on an assistant turn still thinking)."""
    start = prompt_tail.rfind(fmt.start)
    return start >= 0 and prompt_tail.rfind(fmt.end) < start


class ReasoningStream:
    """One streamed choice: text chunks in, (reasoning delta, content delta) out."""

    def __init__(self, plan: ReasoningPlan):
        self.plan = plan
        self.text = ""
        self.sent = ["", ""]

    def feed(self, chunk: str) -> tuple[str, str]:
        self.text += chunk
        return self._diff(*self.plan.split(self.text, final=False), final=False)

    def finish(self) -> tuple[str, str]:
        return self._diff(*self.plan.split(self.text, final=True), final=True)

    def _diff(self, reasoning: str, content: str, final: bool) -> tuple[str, str]:
        if not self.plan.stream_reasoning and not (content or final):
            reasoning = self.sent[0]  # held until the section is done
        out = []
        for k, now in enumerate((reasoning, content)):
            delta = now[len(self.sent[k]):] if now.startswith(self.sent[k]) else ""
            self.sent[k] += delta
            out.append(delta)
        return out[0], out[1]
