"""ModelRunner: owns the model, the KV pool and req_to_token; applies SchedulerOutputs.

The scheduler decides which tokens run where (rows, slots); the runner only records those
decisions in req_to_token, runs one forward over every scheduled request, and samples.
Per live request it keeps a SamplingState (for penalties) and, when asked, the prompt
logprobs accumulated across prefill chunks (runner/sampling/prompt_logprobs.py). The
executor half -- the step's ops around the forward, PD and L3 set-up, shutdown -- is a mixin:
runner/executors/wiring.py.
"""
from __future__ import annotations

import logging

import torch

from kvstrata.config.kv_plan import KVPlan, mha_components
from kvstrata.config.kv_sizing import ModelKVFacts
from kvstrata.kv.device_pool import MHATokenToKVPool, MLATokenToKVPool
from kvstrata.kv.req_to_token import ReqToTokenTable
from kvstrata.platform import detected_platform
from kvstrata.protocol.scheduler_output import (NewRequestData, RunnerOutput, SchedulerOutput,
                                                TopLogprob)
from kvstrata.runner import state_ops
from kvstrata.runner.attention.dsa_seed import DSASeedKeeper
from kvstrata.runner.attention.dsa_sparse import DSASparseMLABackend
from kvstrata.runner.attention.mla_dense import MLADenseBackend
from kvstrata.runner.attention.torch_native import TorchNativeAttnBackend
from kvstrata.runner.executors.hicache import HiCacheExecutor
from kvstrata.runner.executors.retraction_backup import (RetractionBackupExecutor,
                                                        retraction_pool_backup)
from kvstrata.runner.executors.wiring import ExecutorWiring
from kvstrata.runner.forward_batch import ForwardBatch, apply_trees, write_swa_slots
from kvstrata.runner.memory import default_kv_budget_bytes, kv_budget_from_fraction
from kvstrata.runner.model_setup import eos_token_ids, load_serving_model, unhonoured_window
from kvstrata.runner.quant.w8a8 import weight_bytes
from kvstrata.runner.sampling.grammar import new_failures
from kvstrata.runner.sampling.prompt_logprobs import RequestSampling, accumulate_prompt_logprobs
from kvstrata.runner.sampling.sampler import Sampler, SamplingState
from kvstrata.runner.spec import verify as spec_verify
from kvstrata.runner.spec.drafts import build_draft
from kvstrata.runner.spec.handoff import prefill_draft_extend
from kvstrata.runner.spec.worker import SpecWorker

logger = logging.getLogger(__name__)


class ModelRunner(ExecutorWiring):
    """Two phases, so that the KV plan is computed once, outside: the constructor loads the
    model; the engine factory reads `kv_facts()` and `kv_budget_bytes()`, sizes a KVPlan
    (config/kv_sizing.py) and hands it to `allocate_kv`, which builds every KV tensor."""

    def __init__(self, model_path: str, dtype: str = "auto",
                 device: str | torch.device | None = None, quantization: str | None = None,
                 dsa_fused_topk: bool = True, dsa_remap_pd_seed: bool = False,
                 draft_model_path: str | None = None, draft_quantization: str | None = None,
                 draft_algorithm: str = "STANDALONE", draft_tree: tuple[int, int] = (1, 1),
                 draft_token_map: str | None = None, tp_group=None,
                 deterministic: bool = False):
        if device is None:
            device = detected_platform().device_type  # "cuda" on CUDA and ROCm
        self.device = torch.device(device)
        # tp_group: this rank's share of the model (runner/parallel/); None = the whole
        # --enable-deterministic-inference: batch-invariant GEMMs and attention (a request's
        # tokens and logprobs never depend on its batch, its chunks or where its KV came from)
        self.deterministic = deterministic
        self.model, self.source, self.hf_config, self.quantization_info = load_serving_model(
            model_path, dtype, self.device, quantization, tp_group=tp_group,
            deterministic=deterministic)
        # DSA models: which top-k domain the indexer feeds attention (resolved
        # dsa_fused_topk: fused scores -> slots, or positions then req_to_token).
        self.dsa_fused_topk = dsa_fused_topk
        # PD seed of a DSA model (runner/attention/dsa_seed.py); the remap follows the resolved
        # dsa_remap_pd_seed_to_local_slots gate.
        self.dsa_seeds = (DSASeedKeeper(self.model.dims.index_topk, dsa_remap_pd_seed)
                          if self.model.pool_kind == "mla" and self.model.dims.uses_dsa
                          else None)
        self.pd_role: str | None = None
        # STANDALONE / EAGLE speculative decoding: the draft fills verify entries' drafts.
        self.draft: SpecWorker | None = build_draft(
            self.model, self.device, dtype, draft_model_path, draft_algorithm,
            draft_quantization, draft_tree, draft_token_map, self.source, dsa_fused_topk,
            deterministic)
        if self.draft is not None:  # NEXTN: the PD seed feeds its first round
            self.draft.use_seed_keeper(self.dsa_seeds)
        self.dtype = self.model.dtype
        # The whole vocabulary (a tensor-parallel rank holds a slice of the table)
        self.vocab_size = getattr(self.model, "full_dims", self.model.dims).vocab_size
        self.eos_token_ids = eos_token_ids(self.source, self.hf_config)
        self.sampler = Sampler(self.vocab_size, self.eos_token_ids)
        self._reqs: dict[str, RequestSampling] = {}
        self.plan: KVPlan | None = None
        # Hybrid SWA memory (plan.pool_kind "swa"): the windowed layers' pool and the table
        # of their slots (written from ScheduledRequest.swa_slots); None without one.
        self.swa_pool: MHATokenToKVPool | None = None
        self.swa_req_to_token: ReqToTokenTable | None = None
        # SSM / linear-attention models: the recurrent layers' state slots (runner/state_ops.py)
        self.state_pool = None
        self.hicache: HiCacheExecutor | None = None
        # Decode retraction KV backups (BackupOps): built by allocate_kv with a retraction
        # host pool, else on the first BackupOp (cpu_tensor only).
        self.backup: RetractionBackupExecutor | None = None
        self.disagg = None  # DisaggExecutor once enable_disagg() ran (PD prefill/decode)
        # --speculative-accept-threshold-single / -acc (sampled verify rows only)
        self.spec_accept_thresholds = (1.0, 1.0)
        self.grammar = None  # structured output's GrammarBackend (runner/sampling/grammar.py)

    # ------------------------------------------------------------------ KV sizing and allocation
    def kv_facts(self) -> ModelKVFacts:
        dims = self.model.dims
        if hasattr(self.model, "kv_components"):  # MLA; hybrids: their attention layers
            components = self.model.kv_components()
        else:
            components = mha_components(dims.num_layers, dims.num_kv_heads, dims.head_dim,
                                        str(self.dtype).removeprefix("torch."))
        max_pos = getattr(self.hf_config, "max_position_embeddings", None)
        draft: tuple = ()
        if self.draft is not None:
            draft = self.draft.kv_components()
            if self.draft.max_position_embeddings and max_pos:  # the draft reads every position
                max_pos = min(max_pos, self.draft.max_position_embeddings)
        windows = getattr(self.model, "layer_windows", None)
        return ModelKVFacts(
            pool_kind=self.model.pool_kind, components=components,
            max_position_embeddings=max_pos, sliding_window=unhonoured_window(self.model, self.hf_config),
            draft_components=draft,
            layer_windows=tuple(windows) if windows and self.model.pool_kind == "mha"
            else None, state_components=state_ops.model_state_components(self.model))

    def kv_budget_bytes(self, mem_fraction_static: float | None = None) -> int:
        """Memory the KV pool may take, measured now that the weights are loaded."""
        if mem_fraction_static is not None:
            weights = weight_bytes(self.model) + (weight_bytes(self.draft.model)
                                                  if self.draft is not None else 0)
            return kv_budget_from_fraction(self.device, mem_fraction_static, weights)
        return default_kv_budget_bytes(self.device)

    def allocate_kv(self, plan: KVPlan) -> None:
        """Build the device pool, req_to_token and (if planned) the host pool from `plan`."""
        if self.plan is not None:
            raise RuntimeError("the KV cache is already allocated")
        self.plan = plan
        dims = self.model.dims
        self.req_to_token = ReqToTokenTable(plan.num_rows, plan.context_len, self.device)
        self.state_pool = state_ops.allocate_state(self.model, plan, self.device)
        if plan.pool_kind == "none" and self.state_pool is not None:
            self.kv_pool = None  # all-recurrent (Mamba2): no layer keeps K/V
        elif plan.pool_kind == "mla":
            self.kv_pool = MLATokenToKVPool(plan, self.device)
            self.model.attn_backend = DSASparseMLABackend(
                self.kv_pool, self.req_to_token, dims.kv_lora_rank, dims.index_topk,
                dims.index_head_dim, self.model.scaling, fused_topk=self.dsa_fused_topk,
                deterministic=self.deterministic
            ) if dims.uses_dsa else MLADenseBackend(self.kv_pool, self.req_to_token,
                                                    dims.kv_lora_rank, self.model.scaling,
                                                    deterministic=self.deterministic)
        else:
            if plan.pool_kind == "swa":
                # the full layers' pool (none for an all-SWA model) and the windowed ones'
                full = plan.full_pool_plan()
                self.kv_pool = MHATokenToKVPool(full, self.device) if full else None
                self.swa_pool = MHATokenToKVPool(plan.swa_pool_plan(), self.device)
                self.swa_req_to_token = ReqToTokenTable(plan.num_rows, plan.context_len,
                                                        self.device)
            else:
                self.kv_pool = MHATokenToKVPool(plan, self.device)
            self.model.attn_backend = TorchNativeAttnBackend(
                self.kv_pool, self.req_to_token, dims.num_heads, dims.num_kv_heads,
                dims.head_dim, scale=getattr(self.model, "attn_scale", None),
                page_size=plan.page_size, deterministic=self.deterministic,
                layer_windows=getattr(self.model, "layer_windows", None),
                softmax_extras=getattr(self.model, "softmax_extras", False),
                swa_pool=self.swa_pool, swa_req_to_token=self.swa_req_to_token)
        if self.draft is not None:
            self.draft.allocate(plan, self.req_to_token)
        self.hicache = None
        if plan.has_host_pool and plan.host_pool_use == "retraction":
            # A decode server's host pool holds retraction backups only: no transfer thread.
            self.backup = retraction_pool_backup(plan, self.kv_pool, self.swa_pool)
        elif plan.has_host_pool:
            self.hicache = HiCacheExecutor(self.kv_pool, plan, swa_pool=self.swa_pool,
                                           state_pool=self.state_pool)
        quant = self.quantization_info["quantization"]
        logger.info("model %s (%s%s) on %s; %s", self.source.display_name, self.dtype,
                    f", {quant}" if quant else "", self.device, plan.summary())

    @property
    def max_context_len(self) -> int:
        return self.plan.context_len

    # ------------------------------------------------------------------ one step (forward)
    def _execute_forward(self, sched: SchedulerOutput) -> RunnerOutput:
        for rid in sched.freed_rids:
            self._reqs.pop(rid, None)
            if self.dsa_seeds is not None:
                self.dsa_seeds.forget(rid)
            if self.draft is not None:
                self.draft.forget(rid)
        for new in sched.new_requests:
            self._register(new)
        if not sched.scheduled:
            return RunnerOutput([], [], [], [])

        reqs = sched.scheduled
        fresh = {new.rid for new in sched.new_requests}
        for r in reqs:
            if r.start_pos + len(r.token_ids) > self.max_context_len or not r.token_ids:
                raise ValueError(f"request {r.rid!r}: positions {r.start_pos}.."
                                 f"{r.start_pos + len(r.token_ids) - 1} invalid for context "
                                 f"length {self.max_context_len}")
            # A row is reused from request to request: a new one's first entry lists its slots
            # from position 0 (any prefix hit included), or it would read its predecessor's.
            if r.rid in fresh and r.slot_write_start != 0:
                raise ValueError(f"request {r.rid!r}: its first entry records its row from "
                                 f"position {r.slot_write_start}, not 0 (the row's earlier "
                                 f"entries belong to the request that held it before)")
        self.req_to_token.write_many([r.row for r in reqs], [r.slot_write_start for r in reqs],
                                     [r.slots for r in reqs])
        token_ids = [r.token_ids for r in reqs]
        fb = ForwardBatch.build(token_ids, [r.row for r in reqs],
                                [r.start_pos for r in reqs], self.device)
        # The new tokens' slots, read back from the rows just written: one gather.
        fb.out_slots = self.req_to_token.table[fb.token_rows, fb.positions]
        if self.swa_pool is not None:
            write_swa_slots(self.swa_req_to_token, reqs, fb)
        if self.dsa_seeds is not None and self.dsa_seeds.pending:  # before an MTP drafts
            self.dsa_seeds.apply_pending(reqs, self.req_to_token.table, self._slot_rows())
        if self.draft is not None:  # a draft in the runner: its part of the step first
            token_ids = self.draft.run_step(reqs, self._all_ids, fb.out_slots)
            fb.input_ids = torch.tensor([t for ids in token_ids for t in ids],
                                        dtype=torch.int64).to(self.device)
        apply_trees(fb, {i: [-1] + r.draft_parents for i, r in enumerate(reqs)
                         if r.draft_parents is not None})
        if self.state_pool is not None:  # resets and copy-on-write before the forward
            state_ops.before_forward(self.state_pool, reqs, fb)

        # Logits wanted: the last token of each sampled request, and every token of a
        # prompt-logprobs request whose chunk still lies within its prompt.
        want: list[int] = []
        sample_pos: list[int] = []       # index into `want` of each sampled request
        lp_spans: list[tuple[int, int, int]] = []  # (batch index, first index in want, n)
        verify_spans: list[tuple[int, int]] = []   # (batch index, first index in want)
        offset = 0
        for i, r in enumerate(reqs):
            n = len(r.token_ids)
            state = self._reqs.get(r.rid)
            if state is None:
                raise KeyError(f"request {r.rid!r} scheduled but never sent as new")
            if r.num_draft:
                # Speculative verify: the last token and every draft predict a token each.
                verify_spans.append((i, len(want)))
                want.extend(range(offset + n - r.num_draft - 1, offset + n))
            elif state.want_prompt_logprobs and not state.prompt_logprobs_sent and \
                    r.start_pos < len(state.sampling.prompt_token_ids):
                lp_spans.append((i, len(want), n))
                want.extend(range(offset, offset + n))
                if r.sample:
                    sample_pos.append(len(want) - 1)
            elif r.sample:
                sample_pos.append(len(want))
                want.append(offset + n - 1)
            offset += n
        fb.logits_idx = torch.tensor(want, dtype=torch.int64).to(self.device)
        logits = self.model(fb)

        out = RunnerOutput([], [], [], [])
        if self.draft is not None:
            self.draft.after_target_forward(fb.out_slots, self.model)
            out.draft_catch_up_tokens = self.draft.catch_up_tokens
        if self.dsa_seeds is not None and self.pd_role == "prefill":
            out.dsa_seeds = self.dsa_seeds.prefill_seeds(
                reqs, self.model.attn_backend.last_selected[-1],
                lambda rid: len(self._reqs[rid].sampling.prompt_token_ids),
                self.req_to_token.table, self._slot_rows())
        for i, first, n in lp_spans:
            accumulate_prompt_logprobs(self._reqs[reqs[i].rid], reqs[i],
                                       logits[first:first + n], out)
        produced: dict[str, list[tuple]] = {}
        if verify_spans:
            produced = spec_verify.verify_entries(
                self, reqs, token_ids, logits, verify_spans,
                [self._reqs[reqs[i].rid].sampling for i, _ in verify_spans])
        sampled = [r for r in reqs if r.sample and not r.num_draft]
        if sampled:
            states = [self._reqs[r.rid].sampling for r in sampled]
            rows = logits if len(sample_pos) == logits.shape[0] else logits[sample_pos]
            result = self.sampler(rows, states)
            for r, st, tok, lp, top in zip(sampled, states, result.token_ids,
                                           result.logprobs, result.top_logprobs):
                st.record(tok)
                produced[r.rid] = [(tok, lp, top)]
        if self.state_pool is not None:  # verify commits, then snapshots
            state_ops.after_forward(self.state_pool, self.model.recurrent_backend, reqs, fb,
                                    produced)
        if self.draft is not None:
            self._draft_handoffs(reqs, produced, out)
        if self.grammar is not None:
            out.grammar_errors = new_failures((r.rid, self._reqs[r.rid].sampling.grammar)
                                              for r in reqs)
        for r in reqs:  # batch order; a verify entry's tokens stay consecutive
            for tok, lp, top in produced.get(r.rid, ()):
                out.rids.append(r.rid)
                out.token_ids.append(tok)
                out.logprobs.append(lp)
                out.top_logprobs.append(None if top is None else
                                        [TopLogprob(t, lv) for t, lv in top])
        return out

    def _draft_handoffs(self, reqs, produced: dict, out: RunnerOutput) -> None:
        """PD prefill: the draft extends the prompt positions this step completed (its KV
        and, after the last chunk, its state cross to the decode server). PD decode: how
        the first draft rounds' seeds went."""
        if self.pd_role == "prefill":
            out.spec_handoffs, seeds = prefill_draft_extend(
                self.draft, reqs, lambda rid: self._reqs[rid].sampling.prompt_token_ids,
                {rid: toks[0][0] for rid, toks in produced.items()}, self.draft.topk)
            out.dsa_seeds.update(seeds)
        outcomes = self.draft.take_seed_outcomes()
        if outcomes:
            out.dsa_seed_outcomes = outcomes

    def _all_ids(self, rid: str) -> list[int]:
        st = self._reqs[rid].sampling
        return st.prompt_token_ids + st.output_token_ids

    def _slot_rows(self) -> torch.Tensor:
        """(L, slots, row) view of the MLA pool: each slot's latent + indexer key per layer."""
        return self.kv_pool.kv[0, :, :, 0]

    def _register(self, new: NewRequestData) -> None:
        if new.dsa_seed is not None and self.dsa_seeds is not None:
            self.dsa_seeds.pending[new.rid] = list(new.dsa_seed)
        if new.spec_handoff is not None and self.draft is not None:
            self.draft.accept_handoff(new.rid, new.spec_handoff, len(new.prompt_token_ids))
        state = SamplingState(new.sampling_params, list(new.prompt_token_ids),
                              list(new.output_token_ids))
        if self.grammar is not None:  # structured output: its matcher replays the output
            state.grammar = self.grammar.matcher(new.sampling_params, state.output_token_ids)
        self._reqs[new.rid] = RequestSampling(state, want_prompt_logprobs=new.return_prompt_logprobs)

    # ------------------------------------------------------------------ test helpers
    def check_req_to_token(self, expected: dict[int, list[int]],
                           swa_expected: dict[int, tuple[int, list[int]]] | None = None) -> None:
        """Assert each live row's current entries are the slots the scheduler assigned
        (KVSTRATA_CHECK_INTEGRITY): a stale entry reads another request's KV. With an SWA
        pool, the SWA table's entries each row's next window reads, too."""
        self.req_to_token.check_rows(expected)
        if swa_expected is not None and self.swa_req_to_token is not None:
            self.swa_req_to_token.check_spans(swa_expected, "SWA req_to_token")
