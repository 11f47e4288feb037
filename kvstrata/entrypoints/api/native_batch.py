"""A batched /generate (a list of texts or of id lists) and SGLang's parallel sampling
(`sampling_params.n`), split into one body per engine request.

SGLang's rules: n > 1 turns even a single prompt into a batch (the answer is a list); the
batch is the prompts repeated n times in order (p0, p1, p0, p1 for two prompts and n = 2);
every sampling_params of a list must give the same n; a string rid is the prefix of the
ids (`rid_0`, `rid_1`, ...), a list of rids needs one per engine request. Copy j > 0 of a
seeded prompt draws with seed + j (vLLM's rule for n > 1, and kvstrata's OpenAI routes'),
so the n samples differ.
"""
from __future__ import annotations

from kvstrata.entrypoints.api import pd_fields
from kvstrata.entrypoints.api.errors import ApiError

MAX_PARALLEL_SAMPLES = 64  # as the OpenAI routes' `n`


def parallel_samples(body) -> int:
    """sampling_params.n (1 when unset); the same in every entry of a list."""
    sps = body.sampling_params if isinstance(body.sampling_params, list) \
        else [body.sampling_params]
    ns = {1 if sp is None or sp.n is None else sp.n for sp in sps}
    if len(ns) > 1:
        raise ApiError(400, "sampling_params.n must be the same for every prompt of a "
                       "batch", "sampling_params.n")
    n = ns.pop() if ns else 1
    if isinstance(n, bool) or not 1 <= n <= MAX_PARALLEL_SAMPLES:
        raise ApiError(400, f"sampling_params.n must be in [1, {MAX_PARALLEL_SAMPLES}], "
                       f"got {n!r}", "sampling_params.n")
    return n


def _copy_params(sp, j: int):
    """Copy j of one prompt's sampling_params: n taken out, a seed moved on by j."""
    if sp is None:
        return None
    update: dict = {"n": None}
    for name in ("seed", "sampling_seed"):
        if j and isinstance(getattr(sp, name), int):
            update[name] = getattr(sp, name) + j
    return sp.model_copy(update=update)


def batch_items(body, server_args=None) -> list | None:
    """The per-request bodies of a batched /generate, or None for a single prompt without
    parallel samples (on a PD server, with one bootstrap room per request:
    entrypoints/api/pd_fields.py)."""
    n = parallel_samples(body)
    if isinstance(body.text, list):
        field, items = "text", body.text
    elif body.input_ids and isinstance(body.input_ids[0], list):
        field, items = "input_ids", body.input_ids
    elif n > 1:
        field = "text" if body.text is not None else "input_ids"
        items = [getattr(body, field)]
        if isinstance(body.sampling_params, list):
            raise ApiError(400, "sampling_params is a list but the prompt is not a batch",
                           "sampling_params")
    else:
        for name in ("sampling_params", "rid", "cache_salt", "extra_key"):
            if isinstance(getattr(body, name), list):
                raise ApiError(400, f"{name} is a list but the prompt is not a batch", name)
        pd_fields.refuse_lists_outside_batch(body)
        return None
    if not items:
        raise ApiError(400, f"{field} is an empty batch", field)
    if body.stream:
        raise ApiError(400, "not implemented yet: stream with a batch of prompts or "
                       "sampling_params.n > 1", "stream")
    prompts = len(items)
    sps = body.sampling_params if isinstance(body.sampling_params, list) \
        else [body.sampling_params] * prompts
    if len(sps) != prompts:
        raise ApiError(400, f"sampling_params has {len(sps)} entries for {prompts} prompts",
                       "sampling_params")
    total = prompts * n
    items = items * n
    sps = [_copy_params(sp, j) if n > 1 else sp for j in range(n) for sp in sps]
    if isinstance(body.rid, str):  # SGLang: a string rid is the prefix of the batch's ids
        rids = [f"{body.rid}_{i}" for i in range(total)]
    else:
        rids = body.rid if isinstance(body.rid, list) else [None] * total
    if len(rids) != total:
        raise ApiError(400, f"rid has {len(rids)} entries for {total} requests", "rid")
    named = [r for r in rids if r is not None]
    if len(set(named)) != len(named):
        raise ApiError(400, "rid: the ids in a batch must be distinct", "rid")
    per = {}  # cache_salt / extra_key: one for all, or a list of one per request
    for name in ("cache_salt", "extra_key"):
        value = getattr(body, name)
        if isinstance(value, list) and len(value) != total:
            raise ApiError(400, f"{name} has {len(value)} entries for {total} requests", name)
        per[name] = value if isinstance(value, list) else [value] * total
    asked = body.token_ids_logprob  # one id list for all, or one per prompt
    if asked and isinstance(asked[0], list):
        if len(asked) != prompts:
            raise ApiError(400, f"token_ids_logprob has {len(asked)} lists for {prompts} "
                           "prompts", "token_ids_logprob")
        per["token_ids_logprob"] = asked * n
    else:
        per["token_ids_logprob"] = [asked] * total
    bootstraps = pd_fields.split_batch(server_args, body, total, field)
    return [body.model_copy(update={field: item, "sampling_params": sp, "rid": rid, **bs,
                                    **{name: values[i] for name, values in per.items()}})
            for i, (item, sp, rid, bs) in enumerate(zip(items, sps, rids, bootstraps))]
