"""What a client submits to the engine, as one struct from the HTTP layer to the scheduler:
the api server builds it, it crosses the IPC as is (msgspec, tagged), and the offline LLM
hands the same struct to the engine in-process. Its id is `rid` everywhere (SGLang's name)."""
from __future__ import annotations

import msgspec

from kvstrata.protocol.disagg import BootstrapAddr
from kvstrata.protocol.sampling_params import SamplingParams


class EngineRequest(msgspec.Struct, tag="GenerateReq", omit_defaults=True):
    rid: str
    prompt_ids: list[int]
    sampling_params: SamplingParams
    # Return the logprob of each prompt token (echo); only for requests that compute it all.
    return_prompt_logprobs: bool = False
    # PD disaggregation: where the KV comes from / goes to (None on a co-located server),
    # whole: the api server refuses a request in PD mode without host and room, and fills
    # in a missing port.
    bootstrap: BootstrapAddr | None = None
    # SGLang's request priority (engine/sides/priority.py); None: --default-priority-value.
    priority: int | None = None
    # SGLang's cache_salt + extra_key (vLLM's cache_salt): the prefix cache shares pages only
    # among requests with the same salt (cache/page_keys.py salted_ids); None or "": no salt.
    cache_salt: str | None = None


__all__ = ["EngineRequest"]
