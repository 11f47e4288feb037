"""NEXTN speculative decoding's draft: the target checkpoint's own MTP layer
(runner/models/deepseek_mtp.py), run exactly like an EAGLE head (runner/spec/eagle.py:
features from the target's forwards, catch-up extend, one forward per further draft, validity
per slot) over an MLA pool of one layer beside the target's: latent + DSA indexer keys with
sparse attention on DeepSeek-V3.2, the latent alone with dense MLA attention on DeepSeek-V3
(attention/mla_dense.py, the target's own backend). DeepSeek-V2 checkpoints have no MTP layer.

IndexShare (`index_share_for_mtp_iteration` in the checkpoint's config, SGLang's semantics,
chains only): the draft steps after a request's extend do not run the indexer; they attend
to the KV slots the extend's last position selected (its top-k: the "seed"). The slots of
tokens drafted since are not added -- the seed is what the extend chose, no more.

Under PD (runner/spec/handoff.py) the prefill server's extend computes that seed and the first
draft; the decode server's first round starts from them instead of re-running the extend.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvstrata import envs
from kvstrata.config.kv_plan import EAGLE_HIDDEN, KVComponent, KVPlan, mla_components
from kvstrata.kv.device_pool import MLATokenToKVPool
from kvstrata.kv.req_to_token import ReqToTokenTable
from kvstrata.runner.attention.dsa_seed import slots_to_positions
from kvstrata.runner.attention.dsa_sparse import DSASparseMLABackend
from kvstrata.runner.attention.mla_dense import MLADenseBackend
from kvstrata.runner.models.deepseek_mtp import load_mtp_head
from kvstrata.runner.spec.eagle import EagleDraft


@dataclass
class MTPCarry:
    """What a draft step hands the next, per request row: the MTP's normed hidden state and
    (IndexShare) the KV slots to attend to, -1 padded; `shared[b]` False where row b has
    none yet (a PD first round without a usable seed: its first step runs the indexer and
    the later ones reuse that step's choice). None = every row shared."""
    hidden: torch.Tensor
    share: torch.Tensor | None
    shared: torch.Tensor | None = None

    def __getitem__(self, rows) -> "MTPCarry":
        return MTPCarry(self.hidden[rows], None if self.share is None else self.share[rows],
                        None if self.shared is None else self.shared[rows])

    @staticmethod
    def cat(carries: list["MTPCarry"]) -> "MTPCarry":
        if any(c.share is None for c in carries):
            return MTPCarry(torch.cat([c.hidden for c in carries]), None)
        share = _cat_padded([c.share for c in carries])
        shared = torch.cat([torch.ones(len(c.hidden), dtype=torch.bool, device=c.hidden.device)
                            if c.shared is None else c.shared for c in carries])
        return MTPCarry(torch.cat([c.hidden for c in carries]), share,
                        None if bool(shared.all()) else shared)


def _cat_padded(rows: list[torch.Tensor]) -> torch.Tensor:
    width = max(r.shape[1] for r in rows)
    return torch.cat([F.pad(r, (0, width - r.shape[1]), value=-1) for r in rows])


class MTPDraft(EagleDraft):
    def __init__(self, model_path: str, target, device: torch.device,
                 tree: tuple[int, int] = (1, 1), fused_topk: bool = True):
        if getattr(target, "pool_kind", None) != "mla":
            raise ValueError("--speculative-algorithm NEXTN drafts with a DeepSeek "
                             "checkpoint's MTP layer; this target has none")
        if target.arch == "DeepseekV2ForCausalLM":
            raise ValueError("--speculative-algorithm NEXTN: DeepseekV2ForCausalLM has no MTP "
                             "layer (DeepSeek-V3 and V3.2 checkpoints carry one); use NGRAM "
                             "or STANDALONE")
        if tree[0] > 1:
            raise NotImplementedError("not implemented yet: --speculative-eagle-topk > 1 with "
                                      "NEXTN (MTP tree drafts; SGLang's IndexShare is "
                                      "chain-only too)")
        self.fused_topk = fused_topk
        self._init_own_layer(model_path, target, device, tree, load_mtp_head)
        self.seed_keeper = None  # the runner's DSASeedKeeper (PD decode seeds)
        self.seed_outcomes: dict[str, int] = {}  # this step's first rounds, by outcome
        self.use_pd_seed = envs.KVSTRATA_PD_DSA_SEED.get()

    def take_seed_outcomes(self) -> dict[str, int]:
        outcomes, self.seed_outcomes = self.seed_outcomes, {}
        return outcomes

    def use_seed_keeper(self, keeper) -> None:
        self.seed_keeper = keeper

    @property
    def index_share(self) -> bool:
        return self.model.index_share

    @property
    def max_position_embeddings(self) -> int | None:
        return getattr(self.hf_config, "max_position_embeddings", None)

    def kv_components(self) -> tuple[KVComponent, ...]:
        d = self.model.dims
        dtype = str(self.model.dtype).removeprefix("torch.")
        return mla_components(1, d.kv_lora_rank + d.qk_rope_head_dim, dtype,
                              d.index_head_dim) + (
            KVComponent(EAGLE_HIDDEN, 1, (self.model.feature_size,), dtype),)

    def allocate(self, plan: KVPlan, req_to_token: ReqToTokenTable) -> None:
        self.pool = MLATokenToKVPool(plan.draft_plan(), self.device)
        d, t = self.model.dims, self.model.target
        self.model.attn_backend = (DSASparseMLABackend(
            self.pool, req_to_token, d.kv_lora_rank, d.index_topk, d.index_head_dim,
            t.scaling, fused_topk=self.fused_topk) if d.uses_dsa else MLADenseBackend(
            self.pool, req_to_token, d.kv_lora_rank, t.scaling))
        self.req_to_token = req_to_token
        self.page_size = plan.page_size
        self.num_full_pages = plan.num_pages
        n, h = self.pool.num_slots, self.model.feature_size
        self.valid = torch.zeros(n, dtype=torch.bool, device=self.device)
        self.features = torch.zeros(n, h, dtype=self.model.dtype, device=self.device)
        self.feature_ok = torch.zeros(n, dtype=torch.bool, device=self.device)
        self.next_tok = torch.full((n,), -1, dtype=torch.int64, device=self.device)

    def tree_forward(self, fb, carry):
        raise NotImplementedError("MTP tree drafts are refused at start-up")

    def _forward(self, token_ids: list[list[int]], rows: list[int], starts: list[int],
                 carry: MTPCarry | None = None) -> tuple[torch.Tensor, MTPCarry]:
        """An extend (carry None: the target's features at the same slots) or a draft step
        (the previous step's carry; with IndexShare the extend's selection, no indexer)."""
        fb = self._batch(token_ids, rows, starts)
        backend = self.model.attn_backend
        if carry is None:
            logits, hidden = self._extend_forward(fb)
            share = (backend.last_selected[0].index_select(0, fb.logits_idx)
                     if self.index_share else None)
            return logits, MTPCarry(hidden, share)
        fb.dsa_forced_slots, fb.dsa_forced_rows = carry.share, carry.shared
        logits, hidden = self.model(fb, carry.hidden)
        share = carry.share
        if carry.shared is not None:  # rows without a share keep this step's selection
            chosen = backend.last_selected[0]
            share, chosen = _cat_padded([share, chosen]).split(len(share))
            share = torch.where(carry.shared[:, None], share, chosen)
        return logits, MTPCarry(hidden, share)

    # ---- PD handoff (runner/spec/handoff.py)
    def handoff_rows(self, carry: MTPCarry, i: int, plan) -> tuple[torch.Tensor, list | None]:
        """Prefill: the hidden state, and with IndexShare the extend's top-k of the last
        prompt position as request positions (the seed)."""
        if carry.share is None:
            return carry.hidden[i], None
        end = plan.start + len(plan.tokens)
        row_slots = self.req_to_token.table[plan.row, :end]
        return carry.hidden[i], slots_to_positions(carry.share[i], row_slots,
                                                   self.model.dims.index_topk)

    def _start_state(self, r, handoff):
        start = super()._start_state(r, handoff)
        if start is None or not self.index_share:
            return None if start is None else (start[0], MTPCarry(start[1], None))
        row_slots = self.req_to_token.table[r.row]
        seed, outcome = self.seed_keeper.take(r.rid, row_slots)
        if not self.use_pd_seed:  # KVSTRATA_PD_DSA_SEED=0: the benchmark's recompute arm
            seed, outcome = None, "recomputed"
        self.seed_outcomes[outcome] = self.seed_outcomes.get(outcome, 0) + 1
        if seed is None:  # the first draft step recomputes the indexer
            width = self.model.dims.index_topk
            return start[0], MTPCarry(start[1], torch.full((1, width), -1, dtype=torch.long,
                                                           device=self.device),
                                      torch.zeros(1, dtype=torch.bool, device=self.device))
        return start[0], MTPCarry(start[1], seed.view(1, -1))

    def _cat_carries(self, carries: list) -> MTPCarry:
        return MTPCarry.cat(carries)


__all__ = ["MTPCarry", "MTPDraft"]
