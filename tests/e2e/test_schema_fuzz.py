"""Schema fuzzing: schemathesis generates requests from the server's own /openapi.json, valid
ones and invalid ones, for every route; none may get a 5xx, every 4xx carries the OpenAI error
body, and afterwards the server is healthy with its KV pool whole.

Bounded for `make test`: KVSTRATA_FUZZ_EXAMPLES (default 15) examples per route and mode,
a few hundred requests in all, against a server whose 64-token context keeps any generation
short. Raise it for a soak: KVSTRATA_FUZZ_EXAMPLES=500 pytest tests/e2e/test_schema_fuzz.py
KVSTRATA_FUZZ_SERVER_ARGS adds server flags for a soak of another engine configuration, e.g.
"--speculative-algorithm NGRAM --enable-hierarchical-cache".
"""
from __future__ import annotations

import os
import shlex
from collections import Counter

import httpx
import pytest

from tests.e2e.server_utils import ServerProcess
from tests.e2e.test_routes_and_disconnect import wait_idle

schemathesis = pytest.importorskip("schemathesis")
import requests  # noqa: E402  (a schemathesis dependency)
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

EXAMPLES = int(os.environ.get("KVSTRATA_FUZZ_EXAMPLES", "15"))
SERVER_ARGS = shlex.split(os.environ.get("KVSTRATA_FUZZ_SERVER_ARGS", ""))


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_path):
    srv = ServerProcess(tiny_model_path, "--served-model-name", "tiny",
                        "--context-length", "64", "--max-total-tokens", "8192", *SERVER_ARGS,
                        env={"KVSTRATA_MAX_REQUEST_BYTES": str(1 << 16)})
    yield srv
    srv.stop()


def _served_model_only(openapi: dict) -> dict:
    """Valid requests name the served model (or none): otherwise nearly every generated
    "valid" request would stop at the 404, and the engine behind it would go untested."""
    for model in openapi["components"]["schemas"].values():
        if "model" in model.get("properties", {}):
            model["properties"]["model"] = {"enum": [None, "tiny"]}
    return openapi


def _modes(operation) -> tuple:
    # Only a route with a request body has invalid inputs to generate.
    if "requestBody" in operation.definition.raw:
        return GenerationMode.POSITIVE, GenerationMode.NEGATIVE
    return (GenerationMode.POSITIVE,)


def test_no_server_errors_on_generated_requests(fuzz_server):
    base = fuzz_server.base_url
    schema = schemathesis.openapi.from_dict(_served_model_only(
        httpx.get(base + "/openapi.json").json()))
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions",
                                              "/generate", "/abort_request"}
    statuses: Counter = Counter()
    server_errors: list = []
    bad_error_bodies: list = []

    # One keep-alive session for everything: an error response must not break it.
    with requests.Session() as session:
        for op in operations:
            for mode in _modes(op):
                @given(case=op.as_strategy(generation_mode=mode))
                @settings(max_examples=EXAMPLES, deadline=None, database=None,
                          phases=[Phase.generate], suppress_health_check=list(HealthCheck))
                def run(case):
                    r = case.call(base_url=base, session=session, timeout=60)
                    statuses[r.status_code] += 1
                    if r.status_code >= 500:
                        server_errors.append((op.method, op.path, case.body, r.text[:500]))
                    elif r.status_code >= 400 and set(r.json().get("error", {})) != {
                            "message", "type", "param", "code"}:
                        bad_error_bodies.append((op.path, case.body, r.text[:300]))
                run()

    total = sum(statuses.values())
    print("schema fuzz:", total, "requests, statuses", dict(statuses))
    assert total >= 8 * EXAMPLES, statuses
    assert not server_errors, f"{len(server_errors)} 5xx of {total}: {server_errors[:5]}"
    assert not bad_error_bodies, bad_error_bodies[:5]
    assert statuses[200] > 0 and statuses[400] > 0, statuses
    # The server survived all of it, and no request left KV pages behind.
    assert httpx.get(base + "/health", timeout=10).status_code == 200
    st = wait_idle(fuzz_server, timeout=30)
    assert st["ok"] and st["num_used_tokens"] == 0, st
