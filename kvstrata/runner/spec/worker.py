"""Speculative decoding's worker half as the model runner sees it: the one interface every
draft implements (STANDALONE, EAGLE / EAGLE3, NEXTN), so the runner never asks which draft it
holds. tests/unit/test_spec_worker.py checks that ModelRunner touches nothing else of its
draft and that every draft class implements it.

What crosses the seam for speculation stays data, like every side's ops and events: the
scheduler's drafts ride in each verify entry (`ScheduledRequest.num_draft` / `draft_parents`,
NGRAM's drafted in the engine), a PD decode's first round in `NewRequestData.spec_handoff`,
and the runner reports `RunnerOutput.draft_catch_up_tokens`, `spec_handoffs` and
`dsa_seed_outcomes`; the engine's half is engine/sides/speculative.py.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only
    import torch

    from kvstrata.config.kv_plan import KVComponent, KVPlan
    from kvstrata.kv.req_to_token import ReqToTokenTable
    from kvstrata.protocol.disagg import SpecHandoff


@runtime_checkable
class SpecWorker(Protocol):
    model: Any  # the draft's network (its weights count in the memory budget)
    topk: int  # draft tree width (1: a chain)
    catch_up_tokens: int  # this step's draft extend beyond each request's usual

    # ---- sizing and memory (start-up)
    def kv_components(self) -> tuple[KVComponent, ...]:
        """The draft's per-token KV beside the target's, for the one KVPlan."""

    @property
    def max_position_embeddings(self) -> int | None:
        """The longest context the draft reads (None: no limit of its own)."""

    def allocate(self, plan: KVPlan, req_to_token: ReqToTokenTable) -> None:
        """Build the draft's pools once the plan is sized."""

    def page_buffers(self) -> list[torch.Tensor]:
        """Draft KV that travels with the target's pages under PD ([] when none)."""

    # ---- a step
    def on_copies(self, ops: list) -> None:
        """The step's ops, before they run: pages moved or reused drop the draft's KV."""

    def run_step(self, reqs: list, all_ids_of, out_slots: torch.Tensor) -> list[list[int]]:
        """Fill the verify entries' drafts (the runner's part before the target forward);
        returns every entry's token ids."""

    def after_target_forward(self, out_slots: torch.Tensor, target) -> None:
        """Read what the draft needs of the target's forward (hidden states)."""

    def accept_handoff(self, rid: str, handoff: SpecHandoff, prompt_len: int) -> None:
        """PD decode: the prefill's draft state that drives this request's first round."""

    def take_seed_outcomes(self) -> dict[str, int]:
        """PD decode + NEXTN: how this step's first rounds got their sparse-attention seed
        (then cleared); {} for drafts without one."""

    def use_seed_keeper(self, keeper) -> None:
        """PD decode + NEXTN: where the prefill's DSA seeds wait for the first round."""

    def forget(self, rid: str) -> None:
        """The request ended or was retracted: drop its draft state."""


__all__ = ["SpecWorker"]
