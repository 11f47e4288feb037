"""The bootstrap server's clients (httpx): a prefill rank registers its transfer endpoint
(`register_rank`); a decode rank looks up where to pull a room's KV from
(`resolve_prefill_route`: the prefill's parallel info, then the ranks rank_map.py names).
The server itself: bootstrap_server.py."""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass

from kvstrata import envs
from kvstrata.transfer.disagg.bootstrap_server import RESOLVE_RETRY_SECONDS, ROUTE_PARAMS
from kvstrata.transfer.disagg.rank_map import rank_route


class RouteNotReady(RuntimeError):
    """The bootstrap server answered 503 (its prefill is still registering): worth a retry
    up to the bootstrap timeout."""


class RouteUnreachable(RouteNotReady):
    """Nothing answered at the bootstrap address (refused, unreachable, connect timeout):
    worth a short retry only, for a prefill whose bootstrap server is still starting."""


@dataclass(frozen=True)
class PrefillRoute:
    """Where a decode rank's rooms with one prefill server go (rank_map.RankRoute, as
    data endpoints)."""
    endpoint: str                 # the prefill rank that sends this decode rank its pages
    fanout: int = 1               # how many decode ranks that prefill rank sends to
    silent: tuple[str, ...] = ()  # prefill ranks told that nothing is wanted from them

    @property
    def endpoints(self) -> tuple[str, ...]:
        return (self.endpoint, *self.silent)


@functools.lru_cache(maxsize=1)
def _tls_context():
    """One TLS context for this process's bootstrap calls: httpx builds one per module-level
    call (certifi's CA bundle parsed, ~50 ms of CPU), and a decode server's route look-up --
    two calls or more, on the path of the request that needs it -- paid it each time. The
    calls are plain HTTP; httpx wants a context all the same."""
    import httpx  # noqa: PLC0415

    return httpx.create_ssl_context()


def register_rank(host: str, port: int, info: dict, timeout: float = 5.0,
                  wait_s: float = 0.0) -> None:
    """PUT /route: a prefill rank announces its transfer endpoint. `wait_s`: retry a
    bootstrap server that does not answer yet (tensor-parallel ranks > 0 register with
    rank 0's, which may still be starting)."""
    import httpx  # noqa: PLC0415

    deadline = time.monotonic() + wait_s
    while True:
        try:
            httpx.put(f"http://{host}:{port}/route", json=info, timeout=timeout,
                      verify=_tls_context()).raise_for_status()
            return
        except (httpx.ConnectError, httpx.ConnectTimeout):
            if time.monotonic() >= deadline:
                raise
            time.sleep(RESOLVE_RETRY_SECONDS)


def _get_route(host: str, port: int, params: dict, timeout: float) -> dict:
    """GET /route; RouteNotReady on 503, RouteUnreachable when nothing answers,
    RuntimeError on another error status."""
    import httpx  # noqa: PLC0415

    try:
        r = httpx.get(f"http://{host}:{port}/route", params=params, verify=_tls_context(),
                      timeout=httpx.Timeout(timeout, connect=min(timeout, 2.0)))
        if r.status_code == 503:
            raise RouteNotReady(r.text)
        r.raise_for_status()
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:
        raise RouteUnreachable(f"{type(e).__name__}: {e}") from None
    except httpx.TransportError as e:
        raise RouteNotReady(f"{type(e).__name__}: {e}") from None
    except httpx.HTTPStatusError as e:
        raise RuntimeError(f"bootstrap server {host}:{port}: {e.response.status_code} "
                           f"{e.response.text}") from None
    return r.json()


def fetch_prefill_info(host: str, port: int, timeout: float = 5.0) -> dict:
    """The parallel info of the prefill server whose bootstrap server is host:port (all
    ranks -1), once every rank registered."""
    return _get_route(host, port, dict.fromkeys(ROUTE_PARAMS, -1), timeout)


def fetch_prefill_rank(host: str, port: int, tp_rank: int, timeout: float = 5.0) -> str:
    """Tensor-parallel rank `tp_rank`'s data endpoint (kvstrata's ranks are tp ranks: dp
    group = cp = pp rank 0)."""
    rank = _get_route(host, port, {**dict.fromkeys(ROUTE_PARAMS, 0), "target_tp_rank": tp_rank},
                      timeout)
    return f"tcp://{rank['rank_ip']}:{rank['rank_port']}"


def resolve_prefill_route(key: tuple[str, int], timeout: float, expect: tuple,
                          stopping=lambda: False, unreachable_timeout: float | None = None,
                          tp: tuple[int, int] = (0, 1), kv_replicated: bool = False,
                          on_refused=lambda endpoint: None, swa: bool = False
                          ) -> tuple[PrefillRoute | None, str]:
    """The decode side's look-up: (the route to the prefill at bootstrap `key`, "") or
    (None, why). Retries every RESOLVE_RETRY_SECONDS: a bootstrap server that answers "not
    ready" until `timeout`; one that nothing answers for (refused: a definite answer) only
    for `unreachable_timeout` in a row (KVSTRATA_DISAGG_UNREACHABLE_TIMEOUT), then fails
    with SGLang's "Could not fetch prefill parallel info ..." text. `expect` = our
    (page_size, kv_cache_dtype), which the prefill's must equal (equal page bytes could hide
    a different split). `tp`: this decode rank and the decode server's --tp-size;
    `kv_replicated`: every rank holds the whole KV (MLA), so the sizes may differ
    (rank_map.py; `swa`: this side has an SWA pool, which no size mismatch may split).
    `on_refused(endpoint)`: called when the prefill answered but does not
    fit, so that the caller can fail the prefill's half of its rooms at once (not at its
    timeout)."""
    if unreachable_timeout is None:
        unreachable_timeout = envs.KVSTRATA_DISAGG_UNREACHABLE_TIMEOUT.get()
    start = time.monotonic()
    deadline = start + timeout
    error = "stopped"
    attempts, unreachable_since = 0, None
    while not stopping() and time.monotonic() < deadline:
        attempts += 1
        try:
            info = fetch_prefill_info(*key)
            prefill_size = int(info.get("attn_tp_size", 1))
            try:
                ranks = rank_route(tp[0], tp[1], prefill_size, kv_replicated, swa)
            except ValueError as e:
                on_refused(fetch_prefill_rank(*key, min(tp[0], prefill_size - 1)))
                return None, str(e)
            endpoint = fetch_prefill_rank(*key, ranks.source)
            silent = tuple(fetch_prefill_rank(*key, p) for p in ranks.silent)
        except RouteUnreachable as e:
            now = time.monotonic()
            unreachable_since = now if unreachable_since is None else unreachable_since
            if now - unreachable_since >= unreachable_timeout:
                return None, (f"Could not fetch prefill parallel info from bootstrap_addr "
                              f"{key[0]}:{key[1]} after {attempts} attempts in "
                              f"{now - start:.1f} s: {e}")
            time.sleep(RESOLVE_RETRY_SECONDS)
            continue
        except RouteNotReady as e:
            error, unreachable_since = str(e), None
            time.sleep(RESOLVE_RETRY_SECONDS)
            continue
        except Exception as e:
            return None, str(e)
        theirs = (info.get("page_size"), info.get("kv_cache_dtype"))
        if theirs != tuple(expect):
            on_refused(endpoint)
            return None, (f"prefill page_size/kv dtype {theirs[0]}/{theirs[1]} != decode "
                          f"{expect[0]}/{expect[1]}")
        return PrefillRoute(endpoint, ranks.fanout, silent), ""
    if stopping():
        return None, "the decode transfer manager closed"
    return None, f"not ready within {timeout:g} s (bootstrap timeout); last: {error}"


__all__ = ["PrefillRoute", "RouteNotReady", "RouteUnreachable", "fetch_prefill_info",
           "fetch_prefill_rank", "register_rank", "resolve_prefill_route"]
