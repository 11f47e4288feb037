"""Scheduler-side request state (no torch).

A request's KV lives in `pages` (device page ids, one per page_size tokens):

    pages:  [ tree-owned, locked via last_node | request-owned ............ ]
             0 ........ num_tree_pages - 1     num_tree_pages ... len - 1

The tree-owned part came from a prefix-cache hit or from inserting our own computed pages
(chunked prefill); it is pinned by `last_node`'s lock. The rest belongs to the request and is
freed or handed to the tree when the request finishes.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kvstrata.protocol import FinishReason, SamplingParams
from kvstrata.protocol.disagg import BootstrapAddr, SpecHandoff
from kvstrata.protocol.engine_request import EngineRequest  # noqa: F401  (what clients submit)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_index: int
    return_prompt_logprobs: bool = False
    bootstrap: BootstrapAddr | None = None  # PD only
    # Resolved on arrival (engine/sides/priority.py); None only without priority scheduling.
    priority: int | None = None
    # Shares cached prefixes only with requests of the same salt (cache/page_keys.py).
    cache_salt: str | None = None
    # PD decode, DSA model: the seed the prefill server sent (request positions), for the
    # runner (which remaps it to local slots); None without one.
    dsa_seed_positions: list[int] | None = None
    # PD decode, EAGLE-family draft: the prefill's draft state for the first draft round.
    spec_handoff: SpecHandoff | None = None
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING

    # --- KV state (see module docstring) ---
    row: int = 0  # req_to_token row; 0 = none
    pages: list[int] = field(default_factory=list)
    num_tree_pages: int = 0
    last_node: Any = None  # locked radix node, or None
    # Tokens whose KV is in the pool (positions [0, num_computed_tokens)).
    num_computed_tokens: int = 0
    # req_to_token entries from this position on must be (re)written before the next forward.
    row_stale_from: int = 0
    known_to_runner: bool = False
    # Hybrid SWA memory (cache/swa_pages.py): leading pages whose SWA page this request
    # released (out of every window), and where its SWA lock on its tree prefix starts.
    swa_evicted_pages: int = 0
    swa_lock_from: int | None = None
    # Recurrent state (cache/state_slots.py): its working state slot, whether its next
    # forward starts clean, the pinned snapshot node it copies from first, a snapshot it
    # took for the prefix cache (slot, position), where its prefill ends a chunk to
    # snapshot a branch point (0: nowhere), and whether its working slot's state lies past
    # its end (a stop inside a verified run, or an abort while a verify ran: the slot holds
    # the state after every accepted draft) -- never donated to the prefix cache then.
    state_slot: int = 0
    state_fresh: bool = False
    state_copy_node: Any = None
    state_aside_slot: int = 0
    state_aside_pos: int = 0
    state_branch_end: int = 0
    state_past_end: bool = False

    # --- accounting ---
    cached_tokens: int = 0
    retraction_count: int = 0
    # Speculative decoding: decode steps (each a verify pass), drafts proposed, accepted.
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_drafts: int = 0
    finish_reason: FinishReason | None = None
    num_reported_tokens: int = 0
    pending_logprobs: list[float] = field(default_factory=list)
    pending_top_logprobs: list = field(default_factory=list)
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def remaining_new_tokens(self) -> int:
        return max(self.params.max_new_tokens - len(self.output_ids), 0)

    def reset_for_retract(self) -> None:
        """Forget all KV; keep generated tokens (they are recomputed on resume)."""
        self.row = 0
        self.pages = []
        self.num_tree_pages = 0
        self.last_node = None
        self.num_computed_tokens = 0
        self.row_stale_from = 0
        self.swa_evicted_pages = 0
        self.swa_lock_from = None
        assert not self.state_slot and not self.state_aside_slot, "state slots not released"
        self.state_branch_end = 0
        self.known_to_runner = False
        self.status = RequestStatus.WAITING
        self.retraction_count += 1
