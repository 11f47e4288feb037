"""EAGLE speculative decoding's draft: an EAGLE-2 head (runner/models/eagle.py) that reads
the target's hidden states, in the runner, with the same step shape as a STANDALONE draft
model (runner/spec/standalone.py: catch-up extend, then one forward per further draft token,
draft KV in its own pool over the target's slots, validity per slot).

What differs, and why:
  - **Features.** Every target forward keeps each token's final-normed hidden state in a
    per-slot store (`features`, sized in the KVPlan as the EAGLE_HIDDEN draft component).
    The head's position i reads (x_{i+1}, h_i), so a request's extend covers positions up to
    s - 1 (s: its verify entry's last token) and its last logits give the first draft; the
    following draft steps feed the head's own output hidden state instead of h (the target
    has not computed those positions yet) -- SGLang's draft steps do the same.
  - **Validity.** A slot's head KV depends on the next token too, so a slot is valid only
    when the draft computed it from true features *and* with the token that now follows
    it (`next_tok`); draft-step positions (self-fed features) are never valid: the next
    extend recomputes accepted ones with the target's features (SGLang's draft-extend after
    verify).
  - **Missing features.** Pages filled by a copy (HiCache load-back, retraction restore, PD
    receive) bring target KV but no hidden states: the head extends those positions with a
    zero feature. Only the acceptance rate can suffer; the target verifies every draft.
"""
from __future__ import annotations

import torch

from kvstrata import envs
from kvstrata.config.kv_plan import EAGLE_HIDDEN, KVComponent, KVPlan, mha_components
from kvstrata.config.model_source import load_hf_config, resolve_model_path
from kvstrata.kv.device_pool import page_buffers_of
from kvstrata.kv.req_to_token import ReqToTokenTable
from kvstrata.protocol.disagg import SpecHandoff
from kvstrata.runner.cpu import packed_linear
from kvstrata.runner.models.eagle import load_eagle_head
from kvstrata.runner.models.eagle3 import aux_layers
from kvstrata.runner.spec.handoff import hidden_from_bytes, start_logits
from kvstrata.runner.spec.standalone import (RUNNER_DRAFT, CatchUp, DraftModel,
                                              received_full_pages)


class EagleDraft(DraftModel):
    def __init__(self, model_path: str, target, device: torch.device,
                 tree: tuple[int, int] = (1, 1), token_map: str | None = None,
                 target_source=None, algorithm: str = "EAGLE", deterministic: bool = False):
        if getattr(target, "pool_kind", None) != "mha":
            raise ValueError(f"--speculative-algorithm EAGLE: the target must be a "
                             f"llama-family decoder, not {type(target).__name__} (NEXTN / MTP "
                             f"heads are not built yet)")
        self.device = device
        self.source = resolve_model_path(model_path)
        self.hf_config = load_hf_config(self.source)
        self.model = load_eagle_head(self.source, self.hf_config, target, algorithm)
        self.deterministic = deterministic  # batch-invariant kernels, as the target's
        if deterministic:
            packed_linear.pack_draft_head(self.model, fixed=True)
        elif envs.KVSTRATA_CPU_PACKED_LINEAR.get() and packed_linear.available(self.model):
            packed_linear.pack_draft_head(self.model)
        if algorithm == "EAGLE3":  # its features: three of the target's residual streams
            target.capture_layers = tuple(aux_layers(self.hf_config, target.dims.num_layers))
        if token_map is not None:
            self.model.use_token_map(load_token_map(token_map),
                                     float_output_head(target, target_source))
        self._init_head_state(target, tree)

    def _init_own_layer(self, model_path: str, target, device: torch.device,
                        tree: tuple[int, int], load) -> None:
        """NEXTN: the head is the checkpoint's own MTP layer, `load(source, config, target)`."""
        self.device = device
        self.source = resolve_model_path(model_path)
        self.hf_config = load_hf_config(self.source)
        self.model = load(self.source, self.hf_config, target)
        self._init_head_state(target, tree)

    def _init_head_state(self, target, tree: tuple[int, int]) -> None:
        """What every head over the target's hidden states keeps (EAGLE's, an MTP layer's)."""
        self.quantization_info = {"quantization": None}  # in the target's dtype
        target.capture_hidden = True
        self._init_state(tree)
        self.features: torch.Tensor | None = None   # [num_slots, H]: h of the slot's token
        self.feature_ok: torch.Tensor | None = None  # [num_slots] bool: set by a target forward
        self.next_tok: torch.Tensor | None = None   # [num_slots]: token the head KV assumed next
        # rid -> (position, drafts) of its last verify entry with drafts
        self._verified_at: dict[str, tuple[int, int]] = {}
        self._init_handoff()

    def _init_handoff(self) -> None:
        # PD decode (runner/spec/handoff.py): rid -> (the prefill's state, prompt length)
        # until the request's first step; rid -> (start logits, carry) for its first draft.
        self.handoffs: dict[str, tuple[SpecHandoff, int]] = {}
        self._start: dict[str, tuple[torch.Tensor, object]] = {}
        self.handoffs_used = 0  # first rounds that started from a prefill's state
        # Pages a PD receive filled (the prefill's draft KV with the target's) and nothing
        # has overwritten since: the only slots a handoff may mark valid.
        self._received: set[int] = set()

    def kv_components(self) -> tuple[KVComponent, ...]:
        d = self.model.dims
        dtype = str(self.model.dtype).removeprefix("torch.")
        return mha_components(d.num_layers, d.num_kv_heads, d.head_dim, dtype) + (
            KVComponent(EAGLE_HIDDEN, 1, (self.model.feature_size,), dtype),)

    def allocate(self, plan: KVPlan, req_to_token: ReqToTokenTable) -> None:
        super().allocate(plan, req_to_token)
        n, h = self.pool.num_slots, self.model.feature_size
        self.features = torch.zeros(n, h, dtype=self.model.dtype, device=self.device)
        self.feature_ok = torch.zeros(n, dtype=torch.bool, device=self.device)
        self.next_tok = torch.full((n,), -1, dtype=torch.int64, device=self.device)

    # ---- PD handoff (runner/spec/handoff.py)
    def page_buffers(self) -> list[torch.Tensor]:
        """The head's KV travels with the target's pages (the decode server has no features
        to rebuild it from); a tree's scratch pages make the pool larger: no transfer then."""
        return page_buffers_of(self.pool) if self.topk == 1 else []

    def handoff_rows(self, carry, i: int, plan) -> tuple[torch.Tensor, list[int] | None]:
        """Prefill: the hidden state to ship for plan i (and a DSA seed: none here)."""
        return carry[i], None

    def before_step(self, reqs: list, all_ids_of) -> None:
        """A request's first step on a PD decode server: its transferred prompt slots hold
        the prefill's draft KV; a first step that drafts starts from the shipped state
        (when every prompt position then holds valid draft KV; else the extend rebuilds)."""
        if self._received:  # pages this step's forward writes are no longer the received ones
            written = {s // self.page_size for r in reqs if r.rid not in self.handoffs
                       for s in r.slots}
            self._received.difference_update(written)
        if not self.handoffs:
            return
        for r in reqs:
            if r.rid not in self.handoffs:
                continue
            handoff, n = self.handoffs.pop(r.rid)
            ids = all_ids_of(r.rid)
            if self.topk != 1 or r.start_pos != n or len(ids) < n + 1:
                continue  # stale (a plain step ran first) or a tree: the extend rebuilds
            slots = self.req_to_token.table[r.row, :n]
            pages = slots // self.page_size
            got = torch.tensor([int(p) in self._received for p in pages.tolist()],
                               dtype=torch.bool, device=self.device)
            self._received.difference_update(pages[got].tolist())
            nxt = torch.tensor(ids[1:n + 1], dtype=torch.int64, device=self.device)
            self.valid[slots[got]] = True  # a decode-tree prefix keeps its own validity
            self.next_tok[slots[got]] = nxt[got]
            self._known[r.rid] = 0  # the catch-up finds the first invalid position
            if not (r.num_draft and RUNNER_DRAFT in r.token_ids[-r.num_draft:]):
                continue  # a plain first step (the gate): the next one extends as usual
            if not bool(self.valid[slots].all()):
                continue  # e.g. a decode-tree prefix without draft KV: extend from there
            start = self._start_state(r, handoff)
            if start is not None:
                self._start[r.rid] = start
                self.handoffs_used += 1

    def _start_state(self, r, handoff: SpecHandoff):
        hidden = hidden_from_bytes(handoff, self.model.feature_size, self.model.dtype,
                                   self.device)
        if hidden is None:
            return None
        return start_logits(handoff, self.model.dims.vocab_size, self.device), hidden

    def _cat_carries(self, carries: list):
        return torch.cat(carries)

    def extend(self, plans):
        """Plans of requests with a start state skip their extend (the prefill ran it)."""
        starts = [self._start.pop(p.rid, None) for p in plans]
        if all(st is None for st in starts):
            return super().extend(plans)
        todo = [i for i, st in enumerate(starts) if st is None]
        if todo:
            logits, carry = super().extend([plans[i] for i in todo])
            for k, i in enumerate(todo):
                starts[i] = (logits[k:k + 1], carry[k:k + 1])
        return (torch.cat([st[0] for st in starts]),
                self._cat_carries([st[1] for st in starts]))

    def on_copies(self, ops: list) -> None:
        """PD receives bring the prefill's draft KV (a page buffer of ours); other copies
        (load-backs, restores) bring target KV only."""
        from kvstrata.protocol.disagg import PDOp  # noqa: PLC0415

        super().on_copies(ops)
        if self.topk != 1:
            return
        for op in ops:
            if isinstance(op, PDOp) and op.kind == "receiver_init":
                self._received.update(received_full_pages(op, self.num_full_pages))
            elif getattr(op, "kind", None) in ("h2d", "restore"):
                self._received.difference_update(op.device_pages)

    # ---- validity
    def accept_handoff(self, rid: str, handoff: SpecHandoff, prompt_len: int) -> None:
        self.handoffs[rid] = (handoff, prompt_len)

    def forget(self, rid: str) -> None:
        super().forget(rid)
        self._verified_at.pop(rid, None)
        self.handoffs.pop(rid, None)
        self._start.pop(rid, None)

    def invalidate_pages(self, pages: list[int]) -> None:
        super().invalidate_pages(pages)
        if pages:
            P = self.page_size
            idx = torch.tensor(pages, dtype=torch.int64, device=self.device)
            self.feature_ok[(idx[:, None] * P + torch.arange(P, device=self.device))
                            .reshape(-1)] = False

    def after_target_forward(self, out_slots: torch.Tensor, target) -> None:
        self.features[out_slots] = target.last_hidden.to(self.features.dtype)
        self.feature_ok[out_slots] = True
        target.last_hidden = None

    def after_verify(self, rid: str, row: int, start: int, num_draft: int, accepted: int,
                     tree: bool = False) -> None:
        # Positions before `start` got head KV from true features in this step's extend;
        # from `start` on the draft steps fed their own hidden states (never valid).
        self._known[rid] = start
        self._verified_at[rid] = (start, num_draft)

    def tree_forward(self, fb, carry: torch.Tensor | None):
        return self.model(fb, carry)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """A tree's accepted drafts moved to the committed positions: their features (the
        target's hidden states there) move with them."""
        self.features[dst] = self.features[src]
        self.feature_ok[dst] = self.feature_ok[src]

    def catch_up_plan(self, rid: str, row: int, all_ids: list[int], end: int) -> CatchUp | None:
        """`all_ids` ends with the entry's last token x_s (s = end - 1): the extend covers
        positions [first without valid head KV, s - 1] reading x_{i+1}, at least s - 1 (its
        logits are the first draft)."""
        s = end - 1
        known = min(self._known.get(rid, 0), s)
        if known < s:
            slots = self.req_to_token.table[row, known:s]
            following = torch.tensor(all_ids[known + 1:s + 1], dtype=torch.int64,
                                     device=self.device)
            ok = self.valid[slots] & (self.next_tok[slots] == following)
            bad = (~ok).nonzero()
            known = s if bad.numel() == 0 else known + int(bad[0])
        start = min(known, s - 1)
        self._known[rid] = s  # once this step's extend ran
        return CatchUp(rid, row, start, list(all_ids[start + 1:s + 1]))

    def _usual_extend(self, r) -> int:
        # Steady state: the positions the previous verify step committed (SGLang's
        # draft-extend after verify): from its entry to just before this one, at most its
        # drafts + 1 (more: plain steps since, or a rebuild).
        if r.rid not in self._verified_at:
            return 1
        start, num_draft = self._verified_at[r.rid]
        return max(1, min(r.start_pos - start, num_draft + 1))

    def _forward(self, token_ids: list[list[int]], rows: list[int], starts: list[int],
                 carry: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """An extend (carry None: the target's features at the same slots, zero where a copy
        brought the KV) or a draft step (carry: the head's previous hidden per request)."""
        fb = self._batch(token_ids, rows, starts)
        if carry is None:
            return self._extend_forward(fb)
        return self.model(fb, carry)

    def _extend_forward(self, fb) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over positions whose features the target stored (zero where a copy
        brought the KV); their head KV becomes valid for the tokens that follow them."""
        slots = fb.out_slots
        feats = torch.where(self.feature_ok[slots, None], self.features[slots], 0)
        logits, hidden = self.model(fb, feats)
        self.valid[slots] = True
        self.next_tok[slots] = fb.input_ids
        return logits, hidden


def load_token_map(path: str) -> torch.Tensor:
    """SGLang's FR-Spec file: a torch-saved 1-D tensor (or list) of the hot token ids."""
    import os

    if not os.path.isfile(path):
        raise ValueError(f"--speculative-token-map {path}: no such file (a torch-saved list "
                         f"of token ids, e.g. FR-Spec's freq_32768.pt)")
    ids = torch.load(path, map_location="cpu", weights_only=True)
    return torch.as_tensor(ids, dtype=torch.int64)


def float_output_head(target, source) -> torch.Tensor:
    """The target's output matrix in float: the embedding when tied, the parameter when
    plain, else (packed or quantized for the target's own use) read again from the
    checkpoint."""
    if target.dims.tie_word_embeddings or target.lm_head is target.embed:
        # an embedding kept in GGUF blocks (runner/quant/gguf_linear.py) dequantized
        return (target.embed if isinstance(target.embed, torch.Tensor)
                else target.embed.dequantize().to(target.dtype))
    if isinstance(target.lm_head, torch.Tensor):
        return target.lm_head
    from kvstrata.runner.models.loader import iter_checkpoint

    for name, tensor in iter_checkpoint(source, target.config,
                                        target.spec.gguf_permute_qk):
        if name == "lm_head.weight":
            return tensor.to(target.dtype)
    return target.embed  # a GGUF without output.weight: llama.cpp's tied fallback


__all__ = ["EagleDraft", "load_token_map"]
