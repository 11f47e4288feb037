"""Structured output fields of the OpenAI routes -> SamplingParams' json_schema / regex / ebnf,
and the server-level refusals (docs/api.md "Structured output").

OpenAI's `response_format`: {"type": "text"} (no grammar), {"type": "json_object"} (any JSON
object), {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}},
{"type": "structural_tag", "structures": [...], "triggers": [...]} (SGLang's); SGLang's
chat/completions extras `regex` and `ebnf`, and /v1/completions' `json_schema` (a string).
As in SGLang, a request gives at most one of them (SamplingParams checks that and each
grammar's limits, naming the field; api/grammar_check.py whether it compiles).
"""
from __future__ import annotations

import json
from typing import Any

from kvstrata.entrypoints.api.errors import bad_request

ANY_JSON_OBJECT = '{"type": "object"}'


def _schema_of(response_format: Any) -> str | None:
    if not isinstance(response_format, dict):
        raise bad_request("response_format must be an object", "response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_JSON_OBJECT
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise bad_request("response_format.json_schema.schema must be a JSON schema "
                              "object", "response_format")
        return json.dumps(schema)
    raise bad_request(f"response_format.type must be one of text, json_object, json_schema, "
                      f"structural_tag; got {kind!r}", "response_format")


# vLLM's `structured_outputs` keys -> SamplingParams fields (choice and json_object below).
_VLLM_KEYS = {"json": "json_schema", "regex": "regex", "grammar": "ebnf",
              "structural_tag": "structural_tag"}


def _vllm_fields(spec: Any) -> dict[str, str]:
    """vLLM's `structured_outputs` object (its `guided_*` fields' successor): one of json (a
    schema, object or string), regex, choice (a list of strings: the answer is one of
    them), grammar (GBNF or Lark), json_object (true), structural_tag (a JSON string)."""
    param = "structured_outputs"
    if not isinstance(spec, dict):
        raise bad_request("structured_outputs must be an object", param)
    given = {k: v for k, v in spec.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(_VLLM_KEYS) - {"choice", "json_object"})
    if unknown:
        raise bad_request(f"not implemented yet: structured_outputs.{unknown[0]}", param)
    if len(given) != 1:
        raise bad_request("structured_outputs must give exactly one of json, regex, choice, "
                          "grammar, json_object, structural_tag", param)
    key, value = next(iter(given.items()))
    if key == "json_object":
        return {"json_schema": ANY_JSON_OBJECT}
    if key == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise bad_request("structured_outputs.choice must be a non-empty list of strings",
                              param)
        return {"ebnf": "start: " + " | ".join(json.dumps(c) for c in value)}
    if key == "json" and isinstance(value, (dict, bool)):
        value = json.dumps(value)
    if not isinstance(value, str):
        raise bad_request(f"structured_outputs.{key} must be a string", param)
    return {_VLLM_KEYS[key]: value}


def grammar_fields(body) -> dict[str, str | None]:
    """json_schema / regex / ebnf / structural_tag for SamplingParams from an OpenAI request
    body (a structural_tag response_format passes whole, as SGLang passes it)."""
    fields = {"json_schema": getattr(body, "json_schema", None), "regex": body.regex,
              "ebnf": body.ebnf, "structural_tag": None}
    vllm = getattr(body, "structured_outputs", None)
    if vllm is not None:
        for name, value in _vllm_fields(vllm).items():
            if fields[name] is not None:
                raise bad_request(f"give one of structured_outputs and {name}",
                                  "structured_outputs")
            fields[name] = value
    rf = body.response_format
    if isinstance(rf, dict) and rf.get("type") == "structural_tag":
        fields["structural_tag"] = json.dumps(rf)
    elif rf is not None:
        schema = _schema_of(rf)
        if schema is not None:
            if fields["json_schema"] is not None:
                raise bad_request("give one of response_format and json_schema",
                                  "response_format")
            fields["json_schema"] = schema
    return fields


def check_grammar_allowed(server_args, sp, param: str) -> None:
    """A grammar needs the grammar backend (not --grammar-backend none) and the tokenizer
    (llguidance matches text, so token-in-token-out servers cannot constrain it)."""
    field = sp.grammar_field
    if field is None:
        return
    if getattr(server_args, "grammar_backend", "llguidance") == "none":
        raise bad_request(f"{param}: structured output is off on this server "
                          f"(--grammar-backend none)", param)
    if getattr(server_args, "skip_tokenizer_init", False):
        raise bad_request(f"{param}: structured output needs the tokenizer (this server runs "
                          f"with --skip-tokenizer-init)", param)
