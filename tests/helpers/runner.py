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


def forward_logits(runner, token_ids: list[int]):
    """Full-prompt logits [T, V] (float32) by a no-cache forward: touches no KV slot and no
    req_to_token row, so it is safe while requests are live."""
    from kvstrata.runner.forward_batch import ForwardBatch

    fb = ForwardBatch.build([list(token_ids)], [0], [0], runner.device)
    return runner.model(fb)


def num_live_requests(runner) -> int:
    return len(runner._reqs)
