"""Per-request sampling state the runner keeps (penalties, grammar) and the prompt logprobs
a request asked for, accumulated across its prefill chunks and sent once its prompt is done.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstrata.protocol.scheduler_output import RunnerOutput, TopLogprob
from kvstrata.runner.sampling.logit_rows import finite_logprobs, top_rows
from kvstrata.runner.sampling.sampler import SamplingState


@dataclass
class RequestSampling:
    """One live request's sampling state and its prompt logprobs so far."""
    sampling: SamplingState
    want_prompt_logprobs: bool
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[TopLogprob]] = field(default_factory=list)
    prompt_logprobs_sent: bool = False


def accumulate_prompt_logprobs(state: RequestSampling, r, logits: torch.Tensor,
                               out: RunnerOutput) -> None:
    """Logits at positions p predict token p + 1; keep those that are prompt tokens.
    (Positions before the first computed chunk, e.g. a prefix-cache hit, are not
    recomputed; the scheduler must not reuse cached prefixes for echo requests.)"""
    prompt = state.sampling.prompt_token_ids
    lo, hi = r.start_pos, min(r.start_pos + len(r.token_ids), len(prompt) - 1)
    if hi > lo:
        targets = torch.tensor(prompt[lo + 1:hi + 1], dtype=torch.int64,
                               device=logits.device)
        lps = finite_logprobs(torch.log_softmax(logits[:hi - lo].float(), dim=-1))
        state.prompt_logprobs.extend(lps.gather(1, targets[:, None])[:, 0].tolist())
        params = state.sampling.params
        if params.logprobs or params.token_ids_logprob:  # top-n, then the asked ids
            state.prompt_top_logprobs.extend(
                [TopLogprob(t, v) for t, v in row]
                for row in top_rows(lps, [params] * (hi - lo)))
    if r.start_pos + len(r.token_ids) >= len(prompt):
        out.prompt_logprobs[r.rid] = state.prompt_logprobs
        if state.prompt_top_logprobs:
            out.prompt_top_logprobs[r.rid] = state.prompt_top_logprobs
        state.prompt_logprobs_sent = True
