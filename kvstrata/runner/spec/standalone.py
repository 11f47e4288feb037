"""STANDALONE speculative decoding's draft: a second checkpoint with the target's vocabulary
(a smaller model, or the target itself quantized) that proposes each verify entry's draft
tokens inside the runner, greedily, one forward per draft position.

Its KV lives in a pool of its own over the *same slots* as the target's (the KVPlan's
draft components; one req_to_token table for both), so a slot the scheduler hands out holds
a token's target KV and its draft KV. Which slots hold valid draft KV is tracked per slot:
  - set where the draft computed KV (its catch-up extends, its draft positions);
  - cleared for draft positions the target rejected, and for pages another writer filled
    without the draft: HiCache load-backs (h2d), PD receives, retraction restores.
Before drafting, a request's draft "catches up": it runs an extend from its first position
without valid draft KV (usually only the last token or two; the whole prompt the first time:
the draft never runs beside prefill, so a request the gate keeps plain -- a busy batch --
never pays for the draft), in chunks of CATCH_UP_CHUNK tokens. So prefix-cache hits share
draft KV like target KV, and draft KV is rebuilt by draft-extend wherever it is missing.
Exactness never depends on any of this: the target verifies every draft token, so stale
draft KV could only lower the acceptance rate.

Drafts are the draft model's argmax (a deterministic draft: for sampled requests the
runner's one-token acceptance rule keeps the target's distribution, runner/spec/verify.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvstrata.config.kv_plan import KVComponent, KVPlan, mha_components
from kvstrata.kv.device_pool import MHATokenToKVPool
from kvstrata.kv.req_to_token import ReqToTokenTable
from kvstrata.protocol.disagg import BackupOp, PDOp
from kvstrata.protocol.scheduler_output import RUNNER_DRAFT, TransferOp
from kvstrata.runner.attention.torch_native import TorchNativeAttnBackend
from kvstrata.runner.forward_batch import ForwardBatch
from kvstrata.runner.model_setup import load_serving_model
from kvstrata.runner.spec.tree import build_trees, scratch_per_request

def copied_in_pages(ops: list, num_full_pages: int) -> list[int]:
    """Device pages this step's ops fill by copying (HiCache load-back, a retraction
    restore, a PD receive's destination): their draft KV is not the tokens' now."""
    pages: list[int] = []
    for op in ops:
        if isinstance(op, TransferOp) and op.kind == "h2d":
            pages += op.device_pages
        elif isinstance(op, BackupOp) and op.kind == "restore":
            pages += op.device_pages
        elif isinstance(op, PDOp) and op.kind == "receiver_init":
            pages += received_full_pages(op, num_full_pages)
    return pages


def received_full_pages(op: PDOp, num_full_pages: int) -> list[int]:
    """A PD receive's full pages: with hybrid SWA memory its page ids also name the prompt's
    last-window SWA pages, as wire ids past the full pool's (cache/swa_pd.py), which hold no
    draft KV (the draft's pool sits over the full slots)."""
    return [p for p in op.page_ids if p <= num_full_pages]


# Draft KV rebuilt per forward at most (a first prompt, a long load-back): bounds the catch-up
# extend's activations the way --chunked-prefill-size bounds the target's.
CATCH_UP_CHUNK = 1024


@dataclass
class CatchUp:
    """One request's draft extend: tokens at positions [start, start + len(tokens))."""
    rid: str
    row: int
    start: int
    tokens: list[int]


class DraftModel:
    def __init__(self, model_path: str, dtype: str, device: torch.device,
                 quantization: str | None, target_vocab_size: int,
                 tree: tuple[int, int] = (1, 1), deterministic: bool = False):
        self.device = device
        self.deterministic = deterministic  # batch-invariant kernels, as the target's
        self.model, self.source, self.hf_config, self.quantization_info = load_serving_model(
            model_path, dtype, device, quantization, "--speculative-draft-model-quantization",
            deterministic=deterministic)
        if self.model.pool_kind != "mha":
            raise ValueError(f"--speculative-draft-model-path {model_path}: a STANDALONE "
                             f"draft must be a llama-family decoder, not "
                             f"{type(self.model).__name__}")
        if self.model.dims.vocab_size != target_vocab_size:
            raise ValueError(f"--speculative-draft-model-path {model_path}: its vocabulary "
                             f"({self.model.dims.vocab_size} tokens) differs from the target's "
                             f"({target_vocab_size}); a draft must share the target's "
                             f"tokenizer")
        self._init_state(tree)

    def _init_state(self, tree: tuple[int, int] = (1, 1)) -> None:
        # (topk, num_steps): topk > 1 shapes runner_tree entries (runner/spec/tree.py)
        self.topk, self.num_steps = tree
        self.scratch_base = 0  # first scratch slot of the tree steps (past the pool's pages)
        self.pool: MHATokenToKVPool | None = None
        self.valid: torch.Tensor | None = None  # [num_slots] bool: slot holds draft KV
        self._known: dict[str, int] = {}  # rid -> leading positions known to hold draft KV
        self.catch_up_tokens = 0  # this step's draft extend beyond each request's usual

    def kv_components(self) -> tuple[KVComponent, ...]:
        d = self.model.dims
        return mha_components(d.num_layers, d.num_kv_heads, d.head_dim,
                              str(self.model.dtype).removeprefix("torch."))

    @property
    def max_position_embeddings(self) -> int | None:
        return getattr(self.hf_config, "max_position_embeddings", None)

    def allocate(self, plan: KVPlan, req_to_token: ReqToTokenTable) -> None:
        sub = plan.draft_plan()
        if self.topk > 1:  # tree steps' scratch slots, past the pages the scheduler hands out
            scratch = plan.num_rows * scratch_per_request(self.topk, self.num_steps)
            self.scratch_base = (plan.num_pages + 1) * plan.page_size
            sub = dataclasses.replace(sub, num_pages=plan.num_pages + -(-scratch //
                                                                        plan.page_size))
        self.pool = MHATokenToKVPool(sub, self.device)
        d = self.model.dims
        self.model.attn_backend = TorchNativeAttnBackend(
            self.pool, req_to_token, d.num_heads, d.num_kv_heads, d.head_dim,
            scale=getattr(self.model, "attn_scale", None), page_size=plan.page_size,
            deterministic=self.deterministic,
            layer_windows=getattr(self.model, "layer_windows", None),
            softmax_extras=getattr(self.model, "softmax_extras", False))
        self.req_to_token = req_to_token
        self.page_size = plan.page_size
        self.num_full_pages = plan.num_pages  # (PD receives name SWA pages past them)
        self.valid = torch.zeros(self.pool.num_slots, dtype=torch.bool, device=self.device)

    # ---- validity
    def accept_handoff(self, rid: str, handoff, prompt_len: int) -> None:
        """A PD handoff drives only the EAGLE family's first round (a STANDALONE draft is
        rebuilt from the prompt on the decode server)."""

    def take_seed_outcomes(self) -> dict[str, int]:
        return {}

    def use_seed_keeper(self, keeper) -> None:
        """Only NEXTN's MTP layer reads the PD DSA seeds."""

    def forget(self, rid: str) -> None:
        self._known.pop(rid, None)

    def on_copies(self, ops: list) -> None:
        """The step's ops that fill device pages by copying (before its forward)."""
        self.invalidate_pages(copied_in_pages(ops, self.num_full_pages))

    def invalidate_pages(self, pages: list[int]) -> None:
        """Pages whose target KV was written by a copy, not a forward (load-back, PD
        receive, restore): whatever draft KV they held belongs to another token."""
        if pages:
            P = self.page_size
            idx = torch.tensor(pages, dtype=torch.int64, device=self.device)
            slots = (idx[:, None] * P + torch.arange(P, device=self.device)).reshape(-1)
            self.valid[slots] = False

    def after_verify(self, rid: str, row: int, start: int, num_draft: int, accepted: int,
                     tree: bool = False) -> None:
        """A verify entry at `start` (the last token) with `num_draft` drafts kept
        `accepted`: draft KV at start + 1 + accepted .. start + num_draft - 1 was computed
        from rejected tokens. A tree's drafts never had draft KV in the entry's slots (its
        steps ran in scratch slots): only the last token's."""
        if tree:  # this step's extend gave positions up to `start` draft KV
            self._known[rid] = start + 1
            return
        lo, hi = start + 1 + accepted, start + num_draft
        if hi > lo:
            self.valid[self.req_to_token.table[row, lo:hi]] = False
        self._known[rid] = start + 1 + min(accepted, num_draft - 1)

    def _first_missing(self, rid: str, row: int, upto: int) -> int:
        """The first position < upto without valid draft KV (upto if none)."""
        known = min(self._known.get(rid, 0), upto)
        if known < upto:
            ok = self.valid[self.req_to_token.table[row, known:upto]]
            bad = (~ok).nonzero()
            known = upto if bad.numel() == 0 else known + int(bad[0])
        self._known[rid] = known
        return known

    def catch_up_plan(self, rid: str, row: int, all_ids: list[int], end: int) -> CatchUp | None:
        """The extend that gives positions [0, end) draft KV (None: nothing to do)."""
        start = self._first_missing(rid, row, end)
        if start >= end:
            return None
        return CatchUp(rid, row, start, list(all_ids[start:end]))

    # ---- one step
    def run_step(self, reqs: list, all_ids_of, out_slots: torch.Tensor) -> list[list[int]]:
        """Before the target's forward over `reqs` (ScheduledRequests whose slots are in
        req_to_token; `out_slots` the slots that forward writes): the draft's part of the
        step. Returns every entry's token ids, drafts filled in.
          - every slot the target writes now loses its draft KV (a reused slot may hold
            another token's), before the draft writes its own;
          - verify entries holding RUNNER_DRAFT tokens get the draft's tokens, after the
            draft's catch-up extend (the first one of a request covers its whole prompt).
        `all_ids_of(rid)`: the request's tokens so far (prompt + output)."""
        self.valid[out_slots] = False
        self.catch_up_tokens = 0
        self.before_step(reqs, all_ids_of)
        token_ids = [list(r.token_ids) for r in reqs]
        drafting = [i for i, r in enumerate(reqs) if r.num_draft and RUNNER_DRAFT in
                    r.token_ids[-r.num_draft:]]
        if not drafting:
            return token_ids
        plans = []
        for i in drafting:
            r = reqs[i]
            ids = self._ids(r, all_ids_of)[:r.start_pos] + [r.token_ids[0]]
            self._known[r.rid] = min(self._known.get(r.rid, 0), r.start_pos)
            plans.append(self.catch_up_plan(r.rid, r.row, ids, r.start_pos + 1))
            self.catch_up_tokens += max(0, len(plans[-1].tokens) - self._usual_extend(r))
        chains = [k for k, i in enumerate(drafting) if not reqs[i].runner_tree]
        trees = [k for k, i in enumerate(drafting) if reqs[i].runner_tree]
        if chains:
            drafts = self.propose([plans[k] for k in chains],
                                  [reqs[drafting[k]].num_draft for k in chains])
            for k, d in zip(chains, drafts):
                token_ids[drafting[k]][-len(d):] = d
        if trees:
            built = build_trees(self, [plans[k] for k in trees],
                                [reqs[drafting[k]].num_draft for k in trees], self.topk,
                                self.num_steps, self.scratch_base)
            for k, (tokens, parents) in zip(trees, built):
                r = reqs[drafting[k]]
                token_ids[drafting[k]][-len(tokens):] = tokens
                r.draft_parents = parents
        return token_ids

    def before_step(self, reqs: list, all_ids_of) -> None:
        """Before drafting (an EAGLE-family draft takes a PD prefill's state here)."""

    def page_buffers(self) -> list[torch.Tensor]:
        """Draft KV that PD moves with the target's pages: none for a draft model (the decode
        server rebuilds its draft KV with one extend, runner/spec/standalone.py)."""
        return []

    def tree_forward(self, fb: ForwardBatch, carry: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A tree step over scratch slots (never valid draft KV): every token's logits."""
        return self.model(fb), None

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """A tree's accepted drafts moved (runner/spec/verify.py move_accepted_kv): a draft
        model keeps nothing per slot that the move must carry (its KV there is invalid)."""

    def _usual_extend(self, r) -> int:
        """Tokens a drafting request's extend takes in a steady step: its last token (the
        draft computed everything before it in its previous step)."""
        return 1

    def after_target_forward(self, out_slots: torch.Tensor, target) -> None:
        """After the target's forward of the step (an EAGLE draft keeps its features)."""

    @staticmethod
    def _ids(r, all_ids_of) -> list[int]:
        """The request's tokens up to the end of this entry (this entry's own from it)."""
        ids = all_ids_of(r.rid)[:r.start_pos]
        if len(ids) < r.start_pos:
            raise RuntimeError(f"request {r.rid!r}: the runner knows {len(ids)} tokens, the "
                               f"entry starts at position {r.start_pos}")
        return ids + [t for t in r.token_ids if t != RUNNER_DRAFT]

    # ---- forwards
    def _forward(self, token_ids: list[list[int]], rows: list[int], starts: list[int],
                 carry: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft over each request's tokens at its positions (slots from req_to_token);
        the logits of each request's last token, and what a next draft step carries over
        (None here: a draft model needs only its tokens)."""
        fb = self._batch(token_ids, rows, starts)
        logits = self.model(fb)
        self.valid[fb.out_slots] = True
        return logits, None

    def _batch(self, token_ids: list[list[int]], rows: list[int],
               starts: list[int]) -> ForwardBatch:
        fb = ForwardBatch.build(token_ids, rows, starts, self.device)
        fb.out_slots = self.req_to_token.table[fb.token_rows, fb.positions]
        ends = torch.tensor([len(t) for t in token_ids], dtype=torch.int64).cumsum(0) - 1
        fb.logits_idx = ends.to(self.device)
        return fb

    def extend(self, plans: list[CatchUp]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every plan's catch-up extend (long ones CATCH_UP_CHUNK tokens a forward first):
        the logits of each plan's last token and the carry of its draft steps."""
        plans = list(plans)
        while True:
            long = [i for i, p in enumerate(plans) if len(p.tokens) > CATCH_UP_CHUNK]
            if not long:
                break
            self._forward([plans[i].tokens[:CATCH_UP_CHUNK] for i in long],
                          [plans[i].row for i in long], [plans[i].start for i in long])
            for i in long:
                p = plans[i]
                plans[i] = CatchUp(p.rid, p.row, p.start + CATCH_UP_CHUNK,
                                   p.tokens[CATCH_UP_CHUNK:])
        return self._forward([p.tokens for p in plans], [p.row for p in plans],
                             [p.start for p in plans])

    @torch.inference_mode()
    def propose(self, plans: list[CatchUp], num_drafts: list[int]) -> list[list[int]]:
        """Per verify entry: `plans[i]`'s extend ends just before the draft positions;
        returns num_drafts[i] greedy draft tokens for the entry. The first round extends
        each request's catch-up; round j > 1 feeds draft j - 1 at the next position (slots
        the scheduler already assigned to the entry)."""
        logits, carry = self.extend(plans)
        drafts = [[t] for t in logits.argmax(dim=-1).tolist()]
        last_pos = [p.start + len(p.tokens) - 1 for p in plans]
        prev = list(range(len(plans)))  # the requests whose rows `carry` holds
        for j in range(1, max(num_drafts, default=0)):
            live = [i for i, k in enumerate(num_drafts) if k > j]
            if not live:
                break
            if carry is not None and len(live) < len(prev):
                carry = carry[[prev.index(i) for i in live]]
            prev = live
            logits, carry = self._forward([[drafts[i][-1]] for i in live],
                                          [plans[i].row for i in live],
                                          [last_pos[i] + j for i in live], carry)
            for i, tok in zip(live, logits.argmax(dim=-1).tolist()):
                drafts[i].append(tok)
        return [d[:k] for d, k in zip(drafts, num_drafts)]


__all__ = ["CatchUp", "DraftModel", "RUNNER_DRAFT", "copied_in_pages",
           "received_full_pages"]
