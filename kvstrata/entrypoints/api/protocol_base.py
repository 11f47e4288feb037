"""The base of every HTTP request model, and the "known but not implemented" rule.

Requests are parsed with extra="forbid" in strict JSON mode: an unknown field or a wrong type
is a 400 that names the field, never a silent accept-and-ignore. Clients and sglang-router
serialise SGLang's and OpenAI's full request schemas, filling every field with its default;
so every field of those schemas is declared here. A field kvstrata does not implement is
accepted only at its "off" value (null or SGLang's default), and any other value is refused
by name with "not implemented yet: <field>" -- the same rule as for server flags.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

# Integers that cross the process boundary (msgpack holds [-2**63, 2**64)).
UInt64 = Annotated[int, Field(ge=0, le=(1 << 64) - 1)]
Int64 = Annotated[int, Field(ge=-(1 << 63), le=(1 << 63) - 1)]
Port = Annotated[int, Field(ge=0, le=65535)]
# Prompts: what the schema can say about them (the vocabulary bound is checked later).
TokenId = Annotated[int, Field(ge=0)]
Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def declare_off_values(schema: dict[str, Any], cls: type[RequestModel]) -> None:
    """In the JSON schema, a field we do not implement admits only its off values: clients
    and fuzzers see what is really accepted (the type SGLang gives it is in the message)."""
    props = schema.get("properties", {})
    for name in cls.NOT_IMPLEMENTED:
        default = cls.model_fields[name].default
        offs = [default, *cls.ALSO_OFF.get(name, ())]
        if name in props:
            props[name] = {"enum": offs, "default": default, "title": props[name].get("title"),
                           "description": "not implemented yet: accepted only when off"}


class RequestModel(StrictModel):
    """A model with fields accepted only when off (the top-level request bodies, and the
    chat messages, which carry SGLang's tool-calling fields)."""
    model_config = ConfigDict(extra="forbid", strict=True,
                              json_schema_extra=declare_off_values)
    # Declared fields accepted only at their off value: null, the declared default, or one
    # of ALSO_OFF[name].
    NOT_IMPLEMENTED: ClassVar[frozenset[str]] = frozenset()
    ALSO_OFF: ClassVar[dict[str, tuple]] = {}

    @classmethod
    def first_unimplemented(cls, body: dict[str, Any]) -> str | None:
        """The first field (in the client's order) set to something we do not implement."""
        for name, value in body.items():
            if name in cls.NOT_IMPLEMENTED and not is_off(
                    value, cls.model_fields[name].default, cls.ALSO_OFF.get(name, ())):
                return name
        return None


def is_off(value: Any, default: Any, also_off: tuple = ()) -> bool:
    if value is None:
        return True
    # bool is an int in Python: 0 must not pass for False, nor 1 for True.
    same_kind = isinstance(value, bool) == isinstance(default, bool)
    if same_kind and value == default:
        return True
    return any(isinstance(value, bool) == isinstance(off, bool) and value == off
               for off in also_off)
