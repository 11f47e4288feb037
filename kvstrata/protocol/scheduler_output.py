"""The tensor-free contract between the scheduler (deciding) and the runner (doing).

Typed msgspec structs so the runner can later sit in another process behind one codec.

Per step the scheduler sends a SchedulerOutput:
  new_requests   -- requests the runner has not seen (first schedule, or again after a
                    retraction): their prompt/output ids (for penalties) and sampling params.
  scheduled      -- the batch of this forward, in batch order. Each entry says which tokens
                    to compute at which positions, and which KV slots to record in the
                    request's req_to_token row first.
  freed_rids  -- finished / aborted / retracted requests: the runner drops their state.
  ops         -- everything else, one ordered list of typed ops (Op), each handed to the
                 executor of its type (runner/executors/base.py).
The runner answers with a RunnerOutput holding one sampled token per entry whose
`sample` flag was set (in batch order; a verify entry, `num_draft` > 0, gives 1 ..
num_draft + 1 consecutive tokens), and one list of typed events (Event) from the executors.

Slots are token-level KV indices: slot = page_id * page_size + offset_in_page. Page 0 (slots
0..page_size-1) is the padding sink and never holds real KV.
"""
from __future__ import annotations

import msgspec

from kvstrata.protocol.disagg import BackupOp, PDEvent, PDOp, SpecHandoff
from kvstrata.protocol.logprobs import TopLogprob
from kvstrata.protocol.sampling_params import SamplingParams


# A draft token a verify entry leaves to the runner's draft model (STANDALONE): the scheduler
# reserves its position and slot, the runner fills in the token before the forward.
RUNNER_DRAFT = -1


class TreeDraft(list):
    """Draft tokens of a tree (scheduler side): the tokens in breadth-first order and, per
    token, its parent in the verify entry -- 0 is the entry's last token, j the j-th draft
    token (1-based), always an earlier one. A plain list of drafts is a chain (the parent of
    draft j is j - 1). A prefix of a BFS-ordered tree is a tree, so truncating keeps it one.
    parents None: RUNNER_DRAFT placeholders for a tree the runner's draft model shapes."""

    def __init__(self, tokens=(), parents=()):
        super().__init__(tokens)
        self.parents = None if parents is None else list(parents)
        if self.parents is not None and (len(self.parents) != len(self) or any(
                not 0 <= p <= j for j, p in enumerate(self.parents))):
            raise ValueError(f"invalid draft tree parents {self.parents} for {len(self)} "
                             f"tokens")

    def __getitem__(self, i):
        if isinstance(i, slice):
            if i.start not in (None, 0) or i.step not in (None, 1):
                raise IndexError("a draft tree is only cut to a prefix")
            cut = list.__getitem__(self, i)
            return TreeDraft(cut, None if self.parents is None else self.parents[i])
        return list.__getitem__(self, i)

    def depth(self) -> int:
        depths = [0]
        for p in self.parents:
            depths.append(depths[p] + 1)
        return max(depths)


class NewRequestData(msgspec.Struct):
    rid: str
    prompt_token_ids: list[int]
    # Tokens generated before a retraction: they count for penalties and are recomputed.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    # Return the logprob of each prompt token (position 1..n-1) under the model (echo).
    return_prompt_logprobs: bool = False
    # PD decode, DSA model: the prefill server's top-k seed (request positions, -1 padded).
    dsa_seed: list[int] | None = None
    # PD decode, EAGLE-family draft: the prefill's draft state (the first draft round).
    spec_handoff: SpecHandoff | None = None


class ScheduledRequest(msgspec.Struct):
    rid: str
    row: int  # req_to_token row (row 0 is reserved)
    # KV for positions [0, start_pos) is already in the pool and listed in the row.
    start_pos: int
    # Tokens to run now, at positions start_pos .. start_pos + len(token_ids) - 1.
    token_ids: list[int]
    # Record `slots` at req_to_token[row, slot_write_start : slot_write_start + len(slots)]
    # before the forward. Covers any prefix-cache hit plus the new tokens' slots.
    slot_write_start: int
    slots: list[int]
    # Sample a next token after this chunk (False for a non-final prefill chunk).
    sample: bool
    # Speculative verify: the last `num_draft` token_ids are draft tokens. The runner
    # returns the longest prefix of them the target accepts plus one token of its own, as
    # consecutive RunnerOutput entries of this rid (runner/spec/verify.py). Drafts given
    # as RUNNER_DRAFT are proposed by the runner's draft model (runner/spec/standalone.py).
    num_draft: int = 0
    # A tree of drafts (TreeDraft.parents): each draft token's parent in the entry (0: the
    # last token). None: a chain. The runner attends each draft to its ancestors only, at
    # position start_pos + its depth, and moves the accepted path's KV to the positions
    # after start_pos before it answers.
    draft_parents: list[int] | None = None
    # The RUNNER_DRAFT placeholders are a tree the runner's draft model shapes (top-k
    # expansion, --speculative-eagle-topk > 1); the runner sets draft_parents itself.
    runner_tree: bool = False
    # Hybrid SWA memory (KVPlan.num_swa_pages > 0): the sliding-window layers' slots for the
    # same positions as `slots` (recorded in the runner's SWA req_to_token table from
    # slot_write_start); 0 where a position's SWA page was freed or never held (out of
    # every window: never read). None without an SWA pool.
    swa_slots: list[int] | None = None
    # Recurrent state (KVPlan.num_state_slots > 0): the request's working state slot, which
    # this step's recurrent layers read as the state at start_pos and leave as the state
    # after the last token run (0 = the model keeps no state). Before the forward the
    # runner zeroes it (`state_reset`: no cached prefix, start_pos 0 or a recompute) or
    # copies the prefix cache's snapshot slot `state_copy_from` into it (a hit: the
    # snapshot is the state at start_pos; copy-on-write, the snapshot is never changed);
    # neither: the slot already holds the state at start_pos (a later chunk, a decode).
    # After the forward it copies the slot into `state_snapshot_to` (> 0: the prefix
    # cache keeps the state at start_pos + len(token_ids) there). A speculative verify
    # leaves the state after the accepted tokens only. `state_snapshot_at` (a prefill
    # entry only, start_pos < at < its end): the snapshot is the state after position
    # at - 1 instead, taken inside the forward (SGLang's extra_buffer tracks a state inside
    # an extend the same way); 0 = at the end.
    state_slot: int = 0
    state_reset: bool = False
    state_copy_from: int = 0
    state_snapshot_to: int = 0
    state_snapshot_at: int = 0


class TransferOp(msgspec.Struct, tag="transfer"):
    """Move whole pages between tiers (HiCache). Ops run in list order. `sync` ops finish
    before this step's forward (loads it reads, write-backs of pages it may overwrite); the
    others run in the background.

    Device <-> host ("d2h", "h2d"): every op's job_id comes back exactly once, as a
    TransferDone event.
    Host <-> storage ("h2s" backup, "s2h" prefetch; never sync, device_pages empty): `keys`
    are the pages' storage keys (cache/page_keys.py), one per host page. These report
    StorageProgress events instead, and end with exactly one whose `finished` is True. An "s2h" op first asks the backend how many leading keys exist,
    then reads those pages in order; an "h2s" op skips keys already stored."""

    job_id: int
    kind: str  # "d2h" | "h2d" | "h2s" | "s2h"
    device_pages: list[int]
    host_pages: list[int]
    sync: bool
    keys: list[str] = []
    # Hybrid SWA memory ("d2h", "h2d"): the SWA device page of each of device_pages, 0 where
    # only the full layers move. Its host copy sits under the same host page id, in the host
    # SWA pool (cache/swa_hiradix.py).
    swa_pages: list[int] = []
    # ... and an "h2d" that brings back only the SWA halves (into a device tombstone, whose
    # full pages stay as they are: cache/swa_hiradix.py `_revive`)
    swa_only: bool = False
    # Hybrid SWA memory ("h2s", "s2h"): the storage key of each host page's SWA half (the
    # window layers' K/V in the host SWA pool), one per key, or [] when only the full layers
    # move (cache/swa_storage.py). An "h2s" op stores both halves; an "s2h" op reads the
    # SWA halves the store has of the last `swa_window_pages` pages before the end of each
    # batch it read (the window a match ending there needs; StorageProgress.swa_read).
    swa_keys: list[str] = []
    swa_window_pages: int = 0
    # Recurrent state with HiCache ("d2h", "h2d", always sync, no pages): state pool slots
    # copied to / from host state slots, pairwise (cache/state_hiradix.py).
    state_slots: list[int] = []
    host_state_slots: list[int] = []
    # ... and with L3 (cache/state_storage.py): an "h2s" with no pages stores host state
    # slots `host_state_slots` under `state_keys` (one each); an "s2h" has one state key per
    # page of `keys` (the snapshot after that page) and one host state slot, into which it
    # reads the furthest of them stored among the leading hit pages, then reads the pages
    # up to there only (StorageProgress.state_page).
    state_keys: list[str] = []


class StorageCancel(msgspec.Struct, tag="storage_cancel"):
    """Stop a storage prefetch ("s2h") job now: the runner stops it after the page it is
    reading and reports its final StorageProgress (finished=True) in this step's output."""
    job_id: int


class TransferDone(msgspec.Struct, tag="transfer_done"):
    """A device <-> host TransferOp ended (once per job): `ok` False if it failed."""
    job_id: int
    ok: bool = True


class StorageProgress(msgspec.Struct, tag="storage_progress"):
    """Where a host <-> storage job stands (see TransferOp). Pages complete in key order:
    `done_pages` n means host_pages[:n] hold (s2h) / were stored from (h2s) keys[:n]."""

    job_id: int
    hit_pages: int   # s2h: leading keys found in storage (-1 until asked); h2s: len(keys)
    done_pages: int
    finished: bool   # no more progress will come for this job
    error: str = ""  # why it stopped short (a backend failure), "" otherwise
    # s2h with swa_keys: the indices (< done_pages, ascending) of the pages whose SWA half
    # was read too; the other read pages hold the full layers only.
    swa_read: list[int] = []
    # s2h with state_keys: the pages whose end the state read into the op's host state slot
    # is at (hit_pages is cut there: pages past the last stored state cannot be resumed);
    # 0 when no state was read (then hit_pages is 0 too). h2s of states: hit_pages is the
    # number of states, done_pages how many were stored.
    state_page: int = 0


# The op/event unions of the seam (tagged: one codec reads them all).
Op = BackupOp | TransferOp | StorageCancel | PDOp
Event = TransferDone | StorageProgress | PDEvent


def of_type(items: list, cls: type) -> list:
    """The ops (or events) of one type, in order."""
    return [x for x in items if isinstance(x, cls)]


class SchedulerOutput(msgspec.Struct):
    step: int
    is_prefill: bool
    new_requests: list[NewRequestData]
    scheduled: list[ScheduledRequest]
    freed_rids: list[str]
    # Everything besides the forward, one ordered list of typed ops (Op); the runner hands
    # each to the executor registered for its type, in executor order: BackupOps first (a
    # backed-up request's pages may be reused this step), then tier moves (TransferOp,
    # StorageCancel), then PD ops, then the forward. Order within a type is kept.
    ops: list[Op] = []


class RunnerOutput(msgspec.Struct):
    # One entry per ScheduledRequest with sample=True, in batch order (a verify entry:
    # one per token it produced, consecutive).
    rids: list[str]
    token_ids: list[int]
    # Filled only for requests whose sampling_params.logprobs is not None (else None).
    logprobs: list[float | None]
    top_logprobs: list[list[TopLogprob] | None]
    # rid -> logprob of prompt tokens 1..n-1 (only for return_prompt_logprobs requests,
    # filled once the whole prompt has been prefilled; chunks accumulate inside the runner).
    prompt_logprobs: dict[str, list[float]] = {}
    # rid -> top-n alternatives per prompt position (n = sampling_params.logprobs; only
    # when n > 0), same positions as prompt_logprobs: what harnesses use for is_greedy.
    prompt_top_logprobs: dict[str, list[list[TopLogprob]]] = {}
    # What the executors report since the last step, one list of typed events (Event):
    # device <-> host jobs that ended, storage job progress, PD transfer state changes. The
    # scheduler learns that asynchronous work moved on only from these.
    events: list[Event] = []
    # PD prefill, DSA model: rid -> last prompt position's top-k positions (-1 padded),
    # for each request whose first token was sampled this step (the PD seed).
    dsa_seeds: dict[str, list[int]] = {}
    # PD prefill, EAGLE-family draft: rid -> the draft's state after its extend (same rids).
    spec_handoffs: dict[str, SpecHandoff] = {}
    # PD decode, NEXTN with IndexShare: first draft rounds by what fed their sparse
    # attention this step ("used" | "recomputed" | "failed_closed" -> count).
    dsa_seed_outcomes: dict[str, int] = {}
    # STANDALONE: tokens the draft model extended this step beyond one per drafting request
    # (draft KV rebuilt: a first prompt, a host load-back). The speculation gate leaves such
    # steps out of its cost averages: they are not what a drafting step usually costs.
    draft_catch_up_tokens: int = 0
    # Structured output: rid -> why its grammar failed (past llguidance's limits with this
    # tokenizer, or output it cannot take). The request's token this step is an EOS; the
    # engine turns its finish into an abort (400) carrying the message.
    grammar_errors: dict[str, str] = {}
