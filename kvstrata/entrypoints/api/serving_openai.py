"""/v1/chat/completions and /v1/completions: OpenAI requests -> engine requests -> responses.

A request with several prompts and/or n > 1 fans out into one engine request per choice
(choice index = prompt_index * n + j); their output streams are merged into one. The
bootstrap fields (PD) are given to each choice by pd_fields.check_choices.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import msgspec

from kvstrata.entrypoints.api.chat_prompt import chat_prompt_ids
from kvstrata.entrypoints.api.errors import ApiError, bad_request, from_sampling_error
from kvstrata.entrypoints.api.grammar_check import check_grammars
from kvstrata.entrypoints.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from kvstrata.entrypoints.api.structured_output import check_grammar_allowed, grammar_fields
from kvstrata.entrypoints.api.tool_choice import ToolPlan, plan_tools
from kvstrata.entrypoints.reasoning import ReasoningPlan, plan_reasoning
from kvstrata.frontend import ipc
from kvstrata.frontend.tokenizer_loader import TokenizerSkipped
from kvstrata.frontend.tokenizer_manager import DuplicateRequestError
from kvstrata.protocol import SamplingParams
from kvstrata.protocol.grammar import GRAMMAR_FAILED
from kvstrata.protocol.sampling_params import GRAMMAR_FIELDS, LOGIT_BIAS_LIMIT

logger = logging.getLogger(__name__)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class Choice:
    index: int
    req: ipc.GenerateReq
    prompt_text: str | None = None  # for echo
    tools: ToolPlan | None = None  # chat with tools: how its answer is read
    tool_constrained: bool = False  # the tool constraint (required / named / strict) applies
    reasoning: ReasoningPlan | None = None  # --reasoning-parser: how the thinking is split
    grammar_param: str | None = None  # the request field its grammar came from (errors)


def check_lengths(prompt_len: int, max_tokens: int | None, context_len: int | None,
                  prompt_param: str, max_param: str) -> None:
    if prompt_len == 0:
        raise bad_request(f"{prompt_param} is empty", prompt_param)
    if max_tokens is not None and max_tokens < 0:
        raise bad_request(f"{max_param} must be >= 0, got {max_tokens}", max_param)
    if context_len is None:
        return
    if prompt_len >= context_len:
        raise bad_request(f"{prompt_param} has {prompt_len} tokens; the model's context length "
                          f"is {context_len}", prompt_param)
    if max_tokens is not None and prompt_len + max_tokens > context_len:
        raise bad_request(f"{max_param}={max_tokens} plus {prompt_len} prompt tokens exceeds "
                          f"the context length {context_len}", max_param)


def build_sampling_params(body, max_new_tokens: int, logprobs: int | None, seed_offset: int,
                          max_param: str, tools: ToolPlan | None = None,
                          tool_constrained: bool = False,
                          reasoning_gate: list[int] | None = None) -> SamplingParams:
    """tool_constrained: the tool plan's constraint is the answer's grammar (chat_choices
    decides); reasoning_gate: a grammar waits for the thinking to end."""
    grammar = grammar_fields(body)
    check_logit_bias_range(body.logit_bias)
    if tool_constrained:
        grammar.update(tools.constraint)
    fields = dict(
        max_new_tokens=max_new_tokens, temperature=body.temperature, top_p=body.top_p,
        top_k=body.top_k, min_p=body.min_p, repetition_penalty=body.repetition_penalty,
        frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty,
        seed=None if body.seed is None else body.seed + seed_offset,
        stop=body.stop, stop_regex=body.stop_regex, stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        min_new_tokens=body.min_tokens, skip_special_tokens=body.skip_special_tokens,
        no_stop_trim=body.no_stop_trim, logprobs=logprobs, logit_bias=body.logit_bias,
        **grammar)
    if tools is not None and tools.detector is not None:
        # SGLang: tool-call markers are often special tokens; the reader needs them
        fields["skip_special_tokens"] = False
    if reasoning_gate is not None and any(v is not None for v in grammar.values()):
        fields["reasoning_gate"] = reasoning_gate  # the grammar starts after the thinking
    try:
        return SamplingParams.from_dict({k: v for k, v in fields.items() if v is not None})
    except ValueError as e:
        lp_param = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
        overrides = {"max_new_tokens": max_param, "logprobs": lp_param}
        overrides.update({f: grammar_param(body, f, tool_constrained) for f in GRAMMAR_FIELDS})
        raise from_sampling_error(e, overrides=overrides) from None


def check_logit_bias_range(logit_bias: dict | None) -> None:
    """OpenAI answers 400 for a value outside [-100, 100]; SamplingParams clamps to it instead
    (for SGLang's /generate and LLM(), where "-1e9 bans a token" is common)."""
    for token, bias in (logit_bias or {}).items():
        # (a value that is not a number: SamplingParams names it); NaN fails the range too
        if isinstance(bias, (int, float)) and not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise bad_request(f"logit_bias values must be numbers in [-100, 100], got {bias!r} "
                              f"for token {token}", "logit_bias")


def grammar_param(body, field: str | None, tools: bool = False) -> str | None:
    """The request field a SamplingParams grammar field came from: the tool constraint,
    vLLM's structured_outputs, /v1/completions' json_schema, response_format, regex, ebnf."""
    if field is None:
        return None
    if tools:
        return "tools"  # the constraint holds the tools' parameter schemas
    if getattr(body, "structured_outputs", None) is not None:
        return "structured_outputs"
    if field in ("regex", "ebnf"):
        return field
    return "json_schema" if getattr(body, "json_schema", None) is not None \
        else "response_format"


def check_openai_params(tm, body, sp: SamplingParams, tools: bool = False) -> str | None:
    """tools: the request's tool constraint is what sp's grammar is. Returns the request
    field sp's grammar came from (None: no grammar)."""
    check_logit_bias(tm, sp)
    param = grammar_param(body, sp.grammar_field, tools)
    if param is not None:  # (a tool constraint is off when tool_choice asks for it)
        check_grammar_allowed(tm.server_args, sp, "tool_choice" if tools else param)
    return param


def cache_salt(body) -> str | None:
    """SGLang's cache_salt + extra_key, joined as SGLang joins them (vLLM has cache_salt):
    cached prefixes are shared only among requests with the same salt. One string each; a
    list (one per choice) is refused by name."""
    parts = []
    for name in ("cache_salt", "extra_key"):
        value = getattr(body, name)
        if isinstance(value, list):
            raise bad_request(f"not implemented yet: {name} as a list (give one string)", name)
        if value:
            parts.append(value)
    return "".join(parts) or None


def request_rid(body) -> str:
    if isinstance(body.rid, list):
        raise bad_request("not implemented yet: rid as a list (give one string)", "rid")
    return body.rid or uuid.uuid4().hex


def check_token_ids(tm, ids: list[int], param: str) -> None:
    if ids and (min(ids) < 0 or max(ids) >= len(tm.tokenizer)):
        raise bad_request(f"{param}: token ids must be in [0, vocab size)", param)


def check_logit_bias(tm, sp: SamplingParams, param: str = "logit_bias") -> None:
    """vLLM's rule: a bias for a token the vocabulary does not have is the client's mistake."""
    check_token_ids(tm, list(sp.logit_bias), param)


def chat_choices(tm, body: ChatCompletionRequest, context_len: int | None) -> list[Choice]:
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
    tools = plan_tools(tm.server_args, body)
    prompt_ids = chat_prompt_ids(tm, body, tools.template_tools if tools else None)
    if body.input_ids is not None:
        check_token_ids(tm, prompt_ids, "input_ids")
    max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{max_param} must be >= 1, got {max_tokens}", max_param)
    check_lengths(len(prompt_ids), max_tokens, context_len, "messages", max_param)
    if max_tokens is None:  # OpenAI: unbounded, i.e. up to the context length
        max_tokens = (context_len - len(prompt_ids)) if context_len else 4096
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    rid = request_rid(body)
    reasoning, gate = None, None
    if getattr(tm.server_args, "reasoning_parser", None):
        # the prompt's tail: a template may open the thinking section for the model
        tail = tm.tokenizer.decode(prompt_ids[-64:])
        if body.continue_final_message and body.messages[-1].role == "assistant":
            tail += body.messages[-1].text()  # the turn the model continues (all of it)
        reasoning = plan_reasoning(tm.server_args, body, tail)
        gate = reasoning.grammar_gate(tm.tokenizer) if reasoning else None
    constrained = tools is not None and bool(tools.constraint)
    if constrained and any(v is not None for v in grammar_fields(body).values()):
        logger.warning("Constrained decoding is not compatible with tool calls.")
        constrained = False  # SGLang: the client's grammar wins
    params = [build_sampling_params(body, max_tokens, logprobs, j, max_param, tools,
                                    constrained, gate) for j in range(body.n)]
    param = check_openai_params(tm, body, params[0], tools=constrained)
    salt = cache_salt(body)
    return [Choice(j, ipc.GenerateReq(
        rid=f"{rid}-{j}" if body.n > 1 else rid, prompt_ids=prompt_ids,
        sampling_params=params[j], priority=body.priority, cache_salt=salt),
        tools=tools, tool_constrained=constrained, reasoning=reasoning, grammar_param=param)
        for j in range(body.n)]


def completion_choices(tm, body: CompletionRequest, context_len: int | None) -> list[Choice]:
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts:
        raise bad_request("prompt must not be empty", "prompt")
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    rid = request_rid(body)
    salt = cache_salt(body)
    choices = []
    for i, p in enumerate(prompts):
        ids = tm.encode_prompt(p) if isinstance(p, str) else list(p)
        check_token_ids(tm, ids, "prompt")
        check_lengths(len(ids), max_tokens, context_len, "prompt", "max_tokens")
        text = p if isinstance(p, str) else tm.tokenizer.decode(ids)
        for j in range(body.n):
            index = i * body.n + j
            sp = build_sampling_params(body, max_tokens, body.logprobs, j, "max_tokens")
            param = check_openai_params(tm, body, sp)
            choices.append(Choice(index, ipc.GenerateReq(
                rid=f"{rid}-{index}" if len(prompts) * body.n > 1 else rid, prompt_ids=ids,
                sampling_params=sp,
                return_prompt_logprobs=body.echo and body.logprobs is not None,
                priority=body.priority, cache_salt=salt),
                prompt_text=text, grammar_param=param))
    return choices


async def merged_outputs(tm, choices: list[Choice], log_metrics: bool = True):
    """Run every choice's engine request; yield (choice, TextOutput) as they arrive.
    Closing this generator (client gone) cancels the pumps, which aborts the requests.
    First, each grammar compiles in the API's check (a 400 naming its field if it does not,
    before the scheduler sees anything)."""
    await check_grammars(choices, getattr(tm.server_args, "grammar_timeout", 10.0))
    queue: asyncio.Queue = asyncio.Queue()
    by_rid = {c.req.rid: c for c in choices}

    async def pump(choice: Choice) -> None:
        try:
            async for out in tm.generate(choice.req, log_metrics=log_metrics):
                queue.put_nowait((choice, out))
        except DuplicateRequestError as e:  # the client's rid: its mistake, not ours
            queue.put_nowait((choice, bad_request(str(e), "rid")))
        except TokenizerSkipped as e:  # a stop string under --skip-tokenizer-init
            queue.put_nowait((choice, bad_request(str(e), e.param or "stop")))
        except Exception as e:  # surface as an error output, not a hung stream
            queue.put_nowait((choice, e))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    remaining = len(by_rid)
    try:
        while remaining:
            choice, out = await queue.get()
            if isinstance(out, Exception):
                raise out
            if out.finished:
                remaining -= 1
            yield choice, out
    finally:
        for task in tasks:
            task.cancel()


def output_error(out: ipc.TextOutput, choice: Choice | None = None) -> ApiError | None:
    """An aborted output as the error the client gets; a grammar that failed while decoding
    (the runner's GRAMMAR_FAILED message) names the field it came from."""
    if out.finish_type != "abort":
        return None
    status = out.error_status or 500
    message = out.error_message or "request aborted"
    param = choice.grammar_param if choice is not None and status == 400 \
        and message.startswith(GRAMMAR_FAILED) else None
    return ApiError(status, message, param=param,
                    type_="invalid_request_error" if status < 500 else None)


class TokenText:
    """Per-token strings for logprobs; cached because the same ids repeat a lot."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text


def chat_logprobs(tt: TokenText, out: ipc.TextOutput) -> list[dict]:
    content = []
    tops = out.new_top_logprobs or [None] * len(out.new_token_ids)
    for tid, lp, top in zip(out.new_token_ids, out.new_logprobs or [], tops):
        tok = tt(tid)
        content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()),
                        "top_logprobs": [{"token": tt(t.token_id), "logprob": t.logprob,
                                          "bytes": list(tt(t.token_id).encode())}
                                         for t in (top or [])]})
    return content


def completion_logprobs(tt: TokenText, ids: list[int], lps: list, tops: list | None,
                        text_start: int) -> dict:
    tokens = [tt(t) for t in ids]
    offsets, pos = [], text_start
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    top = [None if tp is None else {tt(t.token_id): t.logprob for t in tp}
           for tp in (tops or [None] * len(ids))]
    return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": top,
            "text_offset": offsets}


def merge_logprobs(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}


def finish_reason(out: ipc.TextOutput) -> str | None:
    return out.finish_type if out.finished else None


def encode_sse(obj) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def now() -> int:
    return int(time.time())
