"""Whether a request's grammar compiles, found before it goes to the scheduler, off the API
server's event loop (docs/api.md "Structured output").

llguidance compiles a large grammar for seconds (it drops the GIL meanwhile): on the event
loop that stalled every stream of the server. Here it runs on a small thread pool, under
--grammar-timeout: a grammar still compiling then is refused (a 400 naming the field)
and its compile finishes in the background, where a second request with the same text
waits for it instead of starting another. SamplingParams has already refused what is past
the cheap limits (protocol/grammar_limits.py), so this is rare.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future, ThreadPoolExecutor

from kvstrata.entrypoints.api.errors import bad_request
from kvstrata.protocol.grammar import grammar_problem

logger = logging.getLogger(__name__)
# Two threads: a slow compile does not hold up every other check (the machine's cores are
# the model's; more would not make one compile faster).
_POOL = ThreadPoolExecutor(2, thread_name_prefix="grammar-check")
_inflight: dict[tuple[str, str], Future] = {}


async def check_grammars(choices, timeout: float) -> None:
    """ApiError (400, naming choice.grammar_param) for the first choice whose grammar does
    not compile, or not within `timeout` seconds; each distinct grammar is checked once."""
    seen = set()
    for choice in choices:
        sp = choice.req.sampling_params
        field = sp.grammar_field
        key = (field, getattr(sp, field)) if field else None
        if key is None or key in seen:
            continue
        seen.add(key)
        problem = await _problem(key, timeout)
        if problem:
            param = choice.grammar_param or field
            raise bad_request(f"{param} {problem}", param)


def _safe_problem(field: str, text: str) -> str:
    try:
        return grammar_problem(field, text)
    except Exception:  # never expected: the client gets a 400, not our text
        logger.exception("checking a %s failed", field)
        return "could not be compiled"


async def _problem(key: tuple[str, str], timeout: float) -> str:
    for done in [k for k, f in _inflight.items() if f.done()]:
        del _inflight[done]  # grammar_problem caches what they found
    future = _inflight.get(key)
    if future is None:
        future = _inflight[key] = _POOL.submit(_safe_problem, *key)
    try:
        # shield: a timeout (or a client that leaves) must not cancel the compile that
        # another request with the same grammar waits for
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout)
    except asyncio.TimeoutError:
        return (f"is too complex: it did not compile within {timeout:g} s "
                f"(--grammar-timeout)")
