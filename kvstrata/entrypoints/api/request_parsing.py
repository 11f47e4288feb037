"""Request bodies: parsed by hand (not FastAPI body injection) so that every failure --
malformed or too deeply nested JSON, an unknown field, a wrong type, a known field we do not
implement -- is one OpenAI-style 400 naming the field; and declared in /openapi.json all the
same, so that clients and fuzzers can see the schemas.
"""
from __future__ import annotations

import msgspec
from fastapi import Request
from starlette.requests import ClientDisconnect
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema

from kvstrata.entrypoints.api.errors import ClientDisconnected, bad_request
from kvstrata.entrypoints.api.protocol_base import RequestModel

_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}
_SCHEMA_REF = "#/components/schemas/{model}"


def _param_from_loc(loc: tuple) -> str | None:
    """pydantic locs include union member names ("str", "list[int]") and the tags of
    discriminated unions ("image_url" before the part's own fields): drop those."""
    parts = [str(p) for p in loc
             if isinstance(p, int) or (p.isidentifier() and p.lower() not in _TYPE_NAMES
                                       and not p[:1].isupper())]
    return ".".join(parts) or None


def _most_specific(errors: list[dict]) -> dict:
    """A union reports one error per member; the deepest one is about what the client
    meant (a list of parts with a bad part, not "Input should be a valid string"), and
    at equal depth, a broken constraint (an empty list) rather than a type mismatch."""
    return max(errors, key=lambda err: (len(err["loc"]), not err["type"].endswith("_type")))


async def parse_body(request: Request, model: type[BaseModel]):
    try:
        raw = await request.body()
    except ClientDisconnect:
        # The client left mid-body: one INFO line (the app's handler), not a traceback.
        raise ClientDisconnected() from None
    try:
        obj = msgspec.json.decode(raw) if raw else None
    except msgspec.DecodeError as e:
        raise bad_request(f"malformed JSON body: {e}") from None
    except RecursionError:
        raise bad_request("the JSON body is nested too deeply") from None
    if not isinstance(obj, dict):
        raise bad_request("the request body must be a JSON object")
    if issubclass(model, RequestModel):
        name = model.first_unimplemented(obj)
        if name is not None:
            raise bad_request(f"not implemented yet: {name}", name)
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        err = _most_specific(e.errors())
        param = _param_from_loc(err["loc"])
        if err["type"] == "extra_forbidden":
            raise bad_request(f"unknown field: {param}", param) from None
        message = err["msg"].removeprefix("Value error, ")
        raise bad_request(f"{param}: {message}" if param else message, param) from None


def body_spec(model: type[BaseModel]) -> dict:
    """`openapi_extra` for a route that parses `model` with parse_body."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _SCHEMA_REF.format(model=model.__name__)}}}}}


def add_request_schemas(app, models: list[type[BaseModel]]) -> None:
    """Put the request models (and the models they use) into the app's OpenAPI components,
    where body_spec's references point."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            _, defs = models_json_schema([(m, "validation") for m in models],
                                         ref_template=_SCHEMA_REF)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(
                defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
