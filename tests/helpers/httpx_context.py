"""One TLS context for httpx's module-level calls in a test process.

httpx.get / post / stream / ... build a Client per call, and each Client loads certifi's CA
bundle into a new ssl.SSLContext: ~50 ms of CPU per call on these boxes (~2 ms with a
context given), for plain-HTTP calls to loopback servers. The e2e tests make thousands of
them (each server start's /health polls, /debug/kv polls while waiting for a state, every
request), so at ~0.3 s per poll a waiting test kept a core busy on CA parsing. Each call
still opens its own connection (no pooling: the tests of disconnects and shutdowns see the
same traffic); only the context, built once as httpx builds it (SSL_CERT_FILE / SSL_CERT_DIR
honoured), is shared. A caller's own `verify` wins.
"""
from __future__ import annotations

import functools

CALLS = ("request", "get", "post", "put", "patch", "delete", "head", "options", "stream")


def share_one_ssl_context() -> None:
    import httpx

    if getattr(httpx, "_kvstrata_tests_shared_context", False):
        return
    context = httpx.create_ssl_context()

    def with_context(call):
        @functools.wraps(call)
        def wrapper(*args, **kwargs):
            kwargs.setdefault("verify", context)
            return call(*args, **kwargs)
        return wrapper

    for name in CALLS:
        setattr(httpx, name, with_context(getattr(httpx, name)))
    httpx._kvstrata_tests_shared_context = True
