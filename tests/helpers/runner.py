"""A ModelRunner built the way the server builds one (resolve, load, size one KVPlan,
allocate), for tests that drive the runner directly."""
from __future__ import annotations


def make_runner(model_path: str, **server_args):
    """`server_args` are ServerArgs fields (page_size, max_total_tokens, context_length,
    max_running_requests, dtype, ...)."""
    from kvstrata.config.server_args import ServerArgs
    from kvstrata.entrypoints.engine_factory import build_runner

    runner, _args, _plan, _resolutions = build_runner(ServerArgs(model_path=model_path,
                                                                 **server_args))
    return runner
