"""The bootstrap fields of a request (bootstrap_host, bootstrap_port, bootstrap_room) on the
HTTP side of prefill/decode disaggregation.

A PD router (sglang-router --pd-disaggregation) sends the same request to a prefill and a
decode server with these three added: where the prefill server's bootstrap server listens and
a random room id naming this request's one KV transfer. So on a prefill or decode server:
- a request must carry a host and a room (else 400 naming the missing ones); without a port
  it uses the server's own --disaggregation-bootstrap-port, as SGLang does;
- one room is one engine request: n > 1, several prompts in one /v1/completions request, or
  a /generate batch are served when the room is a list with one distinct room per engine
  request (SGLang's list form; sglang-router 0.3.2 sends lists of n for chat n > 1), and
  refused (400) with a single room.
A co-located server (--disaggregation-mode null) ignores the fields, as SGLang does: they are
dropped here so the engine never sees a bootstrap address it has no use for.
"""
from __future__ import annotations

import random

from kvstrata.entrypoints.api.errors import ApiError
from kvstrata.frontend import ipc
from kvstrata.protocol.disagg import FAKE_BOOTSTRAP_HOST, BootstrapAddr

FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
_ROOM_BITS = 63  # SGLang's rooms: random non-negative 63-bit ids


def pd_mode(server_args) -> str:
    """'null' | 'prefill' | 'decode' (a test double without the field is co-located)."""
    return getattr(server_args, "disaggregation_mode", "null") or "null"


def _pd_note(mode: str) -> str:
    return (f"this server runs in PD mode (--disaggregation-mode {mode}): requests must come "
            f"through a PD router (sglang-router --pd-disaggregation), which adds "
            f"bootstrap_host, bootstrap_port and bootstrap_room")


def attach(server_args, req: ipc.GenerateReq, fields: dict) -> None:
    """Set `req.bootstrap` from the three fields of the HTTP request. In PD mode every engine
    request needs a host and a room; a missing port is the server's own
    --disaggregation-bootstrap-port (as in SGLang: sglang-router sends `bootstrap_port: null`
    when its --prefill URL has no port). Co-located: none (the fields are ignored)."""
    mode = pd_mode(server_args)
    if mode == "null":
        req.bootstrap = None
        return
    fields = {name: fields.get(name) for name in FIELDS}
    if fields["bootstrap_port"] is None:
        fields["bootstrap_port"] = _default_port(server_args)
    missing = [name for name in FIELDS if fields[name] is None]
    if missing:
        raise ApiError(400, f"missing {', '.join(missing)}: {_pd_note(mode)}", missing[0])
    req.bootstrap = BootstrapAddr(fields["bootstrap_host"], fields["bootstrap_port"],
                                  fields["bootstrap_room"])


def _default_port(server_args) -> int:
    return getattr(server_args, "disaggregation_bootstrap_port", 8998)


def check_choices(server_args, body, choices: list) -> None:
    """/v1/chat/completions and /v1/completions: give each engine request (choice) its
    bootstrap fields. Several choices (n > 1, several prompts) need one room each: the
    router sends lists of that length, as SGLang accepts; one room for several is refused."""
    items = per_item(pd_mode(server_args), body, len(choices), _choices_what(body))
    for choice, fields in zip(choices, items):
        attach(server_args, choice.req, fields)


def _choices_what(body) -> tuple[str, str]:
    if body.n > 1:
        return "n", f"n={body.n}"
    return "prompt", "several prompts"


def split_batch(server_args, body, n: int, field: str = "text") -> list[dict]:
    """A /generate batch of n prompts (in `field`: text or input_ids): the bootstrap fields
    of each prompt."""
    return per_item(pd_mode(server_args), body, n, (field, f"a batch of {n} prompts"))


def per_item(mode: str, body, n: int, what: tuple[str, str]) -> list[dict]:
    """The bootstrap fields of each of the n engine requests of one HTTP request. Each field
    is one value for all or a list of n; in PD mode n > 1 needs a list of n distinct rooms
    (one KV transfer each). Co-located: all None (ignored). `what` = (param, words) names
    what made n > 1 in the error."""
    lists = {name for name in FIELDS if isinstance(getattr(body, name), list)}
    if mode == "null" or (n == 1 and not lists):
        keep = mode != "null"
        return [{name: getattr(body, name) if keep else None for name in FIELDS}
                for _ in range(n)]
    per_field = {}
    for name in FIELDS:
        value = getattr(body, name)
        if name in lists:
            if len(value) != n:
                raise ApiError(400, f"{name} has {len(value)} entries for {n} requests", name)
            per_field[name] = value
        else:
            per_field[name] = [value] * n
    if n > 1 and body.bootstrap_room is not None and "bootstrap_room" not in lists:
        param, words = what
        raise ApiError(400, f"{words}: a prefill/decode server needs a list of {n} "
                       f"bootstrap_room values (one KV transfer, one room, per engine "
                       f"request), got one room", param)
    given = [r for r in per_field["bootstrap_room"] if r is not None]
    if len(set(given)) != len(given):
        raise ApiError(400, "bootstrap_room: the rooms of one request must be distinct",
                       "bootstrap_room")
    return [{name: per_field[name][i] for name in FIELDS} for i in range(n)]


def refuse_lists_outside_batch(body) -> None:
    for name in FIELDS:
        if isinstance(getattr(body, name), list):
            raise ApiError(400, f"{name} is a list but the prompt is not a batch", name)


def warmup_bootstrap(server_args) -> BootstrapAddr | None:
    """The bootstrap address of a server's own requests (/health_generate) in PD mode:
    SGLang's warm-up host, which makes both sides use the `fake` transfer (nothing moves),
    and a fresh random room. None on a co-located server."""
    if pd_mode(server_args) == "null":
        return None
    return BootstrapAddr(FAKE_BOOTSTRAP_HOST, _default_port(server_args),
                         random.getrandbits(_ROOM_BITS))
