"""Chat templates rendered to text as transformers 5's `apply_chat_template(tokenize=False)`
renders them, without importing transformers (~0.9 s of CPU in every api server start).

What the template sees is transformers' contract, so that a model's template renders the
same text here as in transformers (tests/unit/test_plain_tokenizer.py compares both):
  - a sandbox that cannot mutate its inputs, with trim_blocks and lstrip_blocks, `break` /
    `continue`, and transformers' `{% generation %}` marker (rendered as its body);
  - `tojson` without HTML escaping (ensure_ascii, indent, separators, sort_keys as in
    json.dumps), `raise_exception(message)`, `strftime_now(format)`, `dict(...)`, and a
    `namespace(...)` that refuses underscore-prefixed attribute names;
  - the variables messages, tools, documents, add_generation_prompt, the tokenizer's named
    special tokens (bos_token, eos_token, ...) and the caller's extra variables (which win
    over a special token of the same name);
  - each message with its None-valued keys dropped, and a reasoning given under
    `reasoning_content`, `thinking` or `reasoning` offered under `reasoning_content` and
    `thinking` both (gpt-oss templates read `thinking`).
"""
from __future__ import annotations

import datetime
import functools
import json

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The names a message's reasoning may come under, the one templates read first.
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class _GenerationMarker(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's text with
    it (for its training masks); rendering keeps the body as it is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _refuse_underscore_name(name) -> None:
    """_Namespace's check (a module function: jinja2's Namespace answers attribute lookups
    on itself from the template's attributes, so `self._check` would not find a method)."""
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"a chat template cannot set the underscore-prefixed attribute {name!r} on a "
            "namespace")


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace(), refusing attribute names that start with "_" (a template must
    not reach interpreter internals through one)."""

    def __init__(*args, **kwargs):  # jinja2's own signature trick: `self` may be a kwarg
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _refuse_underscore_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _refuse_underscore_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class _DictBuilder:
    """The template's `dict(...)`: builds a dict, and exposes nothing else of the type."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(text: str) -> jinja2.Template:
    """The template compiled once per text (jinja2.TemplateSyntaxError when it does not
    parse)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationMarker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_DictBuilder(), namespace=_Namespace)
    return env.from_string(text)


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as the template sees them: new dicts without None values, the reasoning
    under both names templates read."""
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"a chat message must be a dict, not {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_KEYS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_chat(template: str, messages: list[dict], *, tools: list[dict] | None = None,
                documents: list[dict] | None = None, add_generation_prompt: bool = False,
                special_tokens: dict[str, str] | None = None, **variables) -> str:
    """The conversation rendered by `template` (tools and documents as JSON-like dicts)."""
    if not messages:
        raise ValueError("cannot apply a chat template to an empty conversation")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TypeError("documents must be dicts (with 'title' and 'text' keys)")
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise ValueError("tools must be JSON schemas (dicts)")
    return compile_template(template).render(
        messages=template_messages(messages), tools=tools, documents=documents,
        add_generation_prompt=add_generation_prompt, **{**(special_tokens or {}), **variables})
