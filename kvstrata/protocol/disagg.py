"""Prefill/decode disaggregation (PD): the tensor-free contract between the scheduler
(engine/, which decides) and the runner's transfer layer (runner/ + transfer/disagg/, which
moves bytes). Same seam as the HiCache jobs: the scheduler puts `PDOp`s in its
SchedulerOutput, the runner applies them in order before the step's forward, polls every
live sender/receiver, and returns the state *changes* as `PDEvent`s in RunnerOutput.

One KV transfer per request, keyed by its bootstrap room (a random 63-bit id the router
puts in both copies of the request). States (SGLang's KVPoll numbers):

  prefill sender:   BOOTSTRAPPING --(decode sent its destination pages)--> WAITING_FOR_INPUT
                    --send()--> TRANSFERRING --(every page and the metadata acknowledged)-->
                    SUCCESS;   any state --(abort, dead peer, timeout)--> FAILED (once
                    pages were shipped: after the decode answered with its page count)
  decode receiver:  BOOTSTRAPPING --(prefill's bootstrap server answered)--> WAITING_FOR_INPUT
                    --init(dst pages)--> TRANSFERRING --(pages + metadata arrived)--> SUCCESS;
                    any state --> FAILED

Ops per side, in the order a request sees them:
  prefill: sender_create -> sender_init (once WAITING_FOR_INPUT; num_pages, metadata_index)
           -> send (page_ids, last=False ...) -> send (last=True, metadata) -> release
  decode:  receiver_create -> receiver_init (page_ids = reserved destination pages,
           metadata_index) -> release (after SUCCESS, once the metadata is read)
  either:  abort (client abort / error; idempotent) -> release
`release` forgets the room in the runner (after SUCCESS or FAILED were reported); a room
is never reused while the runner still knows it.
"""
from __future__ import annotations

import enum

import msgspec

from kvstrata.protocol.logprobs import TopLogprob

# SGLang's warm-up host: a request addressed to it uses the `fake` backend (moves nothing).
FAKE_BOOTSTRAP_HOST = "2.2.2.2"


class KVPoll(enum.IntEnum):
    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4


class BootstrapAddr(msgspec.Struct, frozen=True):
    """Where a request's KV comes from / goes to: the prefill server's bootstrap server and
    the room id. Both servers get the same three values from the router."""

    host: str
    port: int
    room: int


# EAGLE's top-k travels with at most this many entries (SGLang's metadata buffers).
SPEC_TOPK_LIMIT = 16


class SpecHandoff(msgspec.Struct, array_like=True):
    """An EAGLE-family draft's state after the prefill server's draft-extend (SGLang's
    output_topk_p / output_topk_index / output_hidden_states): the first draft step's
    top-k (probabilities and token ids, best first) and the draft's hidden state at the
    last prompt position, raw bytes in the model dtype (the carry of the next draft step)."""

    topk_p: list[float]
    topk_index: list[int]
    hidden: bytes
    hidden_dtype: str


class PDMetadata(msgspec.Struct):
    """What travels with the last chunk, besides the KV pages: the prefill's first output
    token (the decode server's first token comes from here; no forward there), its
    logprob(s), counters, the DSA seed (`extras`) and an EAGLE-family draft's state."""

    room: int
    first_token_id: int
    first_logprob: float | None = None
    first_top_logprobs: list[TopLogprob] | None = None
    cached_tokens: int = 0  # prefix-cache hit on the prefill server
    extras: dict[str, list[int]] = {}
    spec: SpecHandoff | None = None


# DSA seed transport (sglang-behaviour.md 5.2): the prefill server's last-position top-k as
# request-relative POSITIONS (the two servers' allocators are independent), padded with -1;
# a request without a seed sends all -1, which the decode side reads back as no seed.
DSA_SEED_KEY = "dsa_topk_positions"


def dsa_seed_extras(positions: list[int] | None, topk: int) -> dict[str, list[int]]:
    """PDMetadata.extras entry for one request of a DSA model."""
    if positions is None:
        return {DSA_SEED_KEY: [-1] * topk}
    if len(positions) != topk:
        raise ValueError(f"a DSA seed has index_topk={topk} entries, got {len(positions)}")
    return {DSA_SEED_KEY: [int(p) for p in positions]}


def dsa_seed_from_extras(extras: dict[str, list[int]]) -> list[int] | None:
    """The wire seed, or None when absent or all negative."""
    seed = extras.get(DSA_SEED_KEY)
    if not seed or all(p < 0 for p in seed):
        return None
    return list(seed)


class PDOp(msgspec.Struct, omit_defaults=True, tag="pd"):
    room: int
    # sender_create | sender_init | send | receiver_create | receiver_init | abort | release
    kind: str
    bootstrap_host: str = ""  # *_create
    bootstrap_port: int = 0   # *_create
    num_pages: int = 0        # sender_init: pages the whole prompt will send
    metadata_index: int = -1  # sender_init / receiver_init: the request's metadata slot
    page_ids: list[int] = []  # send: source pages in order; receiver_init: destination pages
    # receiver_init: the prompt's first pages the decode server already holds (its radix
    # cache); page_ids are the pages after them and the prefill sends only those.
    prefix_pages: int = 0
    # receiver_init with hybrid SWA memory: the SWA pages of the prompt's last window that
    # lie in those prefix pages (the decode's tree holds them live); the prefill skips them
    # too, the first ones of its SWA pages (cache/swa_pd.py)
    prefix_swa_pages: int = 0
    last: bool = False        # send: the last chunk; `metadata` goes with it
    metadata: PDMetadata | None = None


class PDEvent(msgspec.Struct, omit_defaults=True, tag="pd_event"):
    room: int
    state: int  # KVPoll
    error: str | None = None  # FAILED: why (shown to the client in the HTTP 500)
    metadata: PDMetadata | None = None  # decode SUCCESS: what the prefill server sent
    # SUCCESS or FAILED: the KV pages that crossed -- written into the decode's reserved
    # pages while its room was live; the prefill reports what the decode confirmed, so
    # both sides give the same number (transfer/disagg/messages.py)
    pages: int = 0
    swa_pages: int = 0  # of `pages`, the SWA pool's (hybrid SWA memory; smaller pages)
    state_pages: int = 0  # of `pages`, state slots (recurrent state: one per request)


class BackupOp(msgspec.Struct, omit_defaults=True, tag="backup"):
    """Decode retraction with KV backup (a decode server cannot recompute a prompt it never
    ran). Synchronous: the runner applies every BackupOp of a step first, before the PD ops
    and the forward (a backed-up request's pages may be handed to another request in the
    same step). `num_tokens` = the tokens whose KV is kept (seq_len - 1 at retraction);
    `device_pages` cover them in order (the last page may be partly used).

      backup   copy device_pages -> the backup (cpu_tensor: CPU tensors the runner keeps
               under `rid`; host_pool: the host pool's `host_pages`, allocated by the
               scheduler); the scheduler frees the device pages after emitting it.
      restore  copy the backup -> device_pages (newly allocated, same count), then drop it
               (cpu_tensor: forget the tensors; host_pool: the scheduler frees host_pages).
      discard  drop a backup without restoring it (abort of a retracted request);
               idempotent."""

    kind: str  # backup | restore | discard
    rid: str
    backend: str  # cpu_tensor | host_pool
    num_tokens: int = 0
    device_pages: list[int] = []
    host_pages: list[int] = []
    # hybrid SWA memory: the SWA pool's pages of the live window (the last window before
    # num_tokens, cache/swa_pd.py: those of the last len(swa_pages) device_pages), backed up
    # and restored beside the full pages; host_pool keeps them in the host pool's SWA half
    # under the host page ids of their full pages (the last len(swa_pages) host_pages)
    swa_pages: list[int] = []
    # recurrent state: the request's state slot (backup: copied out beside the KV, always a
    # CPU copy -- SGLang's get_cpu_copy of KV and mamba slot; restore: the new slot it is
    # written into), 0 for a model without recurrent state
    state_slot: int = 0


__all__ = ["SPEC_TOPK_LIMIT", "SpecHandoff", "DSA_SEED_KEY", "dsa_seed_extras", "dsa_seed_from_extras", "FAKE_BOOTSTRAP_HOST", "KVPoll", "BootstrapAddr", "BackupOp", "PDMetadata", "PDOp",
           "PDEvent"]
