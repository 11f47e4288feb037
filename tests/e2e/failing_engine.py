"""An engine factory for the failure tests (KVSTRATA_ENGINE_FACTORY=tests.e2e.failing_engine):
the real engine, whose step raises once a request asks for exactly FAILING_MAX_TOKENS new
tokens -- an engine bug as the server meets it, in the scheduler's loop."""
from __future__ import annotations

FAILING_MAX_TOKENS = 13
MESSAGE = "an engine step failed on purpose (tests/e2e/failing_engine.py)"


def build_engine(server_args, defer_tokenizer: bool = False):
    from kvstrata.entrypoints.engine_factory import build_engine as real_build_engine

    engine, tokenizer = real_build_engine(server_args, defer_tokenizer=defer_tokenizer)
    real_step, real_add = engine.step, engine.add_request
    doomed = []

    def add_request(req, *args, **kwargs):
        if getattr(req.sampling_params, "max_new_tokens", None) == FAILING_MAX_TOKENS:
            doomed.append(req)
        return real_add(req, *args, **kwargs)

    def step(*args, **kwargs):
        if doomed:
            raise RuntimeError(MESSAGE)
        return real_step(*args, **kwargs)

    engine.add_request, engine.step = add_request, step
    return engine, tokenizer
