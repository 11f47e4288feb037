"""Turns one step's logits into next tokens (plus optional logprobs) for a batch of requests.

Pipeline per row, in this order:
  1. penalties on float32 logits: repetition (HF/vLLM: over prompt+output ids, positive logits
     divided, negative multiplied), then frequency/presence (OpenAI: over OUTPUT ids only:
     logit -= count * frequency_penalty + presence_penalty);
     then logit_bias (added after the penalties, as SGLang; ids past the logits ignored);
  2. a grammar (json_schema / regex / ebnf: runner/sampling/grammar.py): tokens that cannot continue
     it -> -inf; then min_new_tokens: while len(output) < min_new_tokens, EOS ids and
     stop_token_ids -> -inf, unless they are all the grammar still allows (it is complete);
  3. greedy rows (temperature < 1e-6, as SGLang, or top_k == 1): argmax of those adjusted logits;
  4. other rows: / temperature, top-k, top-p (on the top-k-renormalised distribution),
     min-p (relative to the max remaining prob), then one draw.
Top-k and top-p are applied as value thresholds: tokens tied with the last kept one are
kept too (so a "top_k=2" row with three tied leaders keeps three), as vLLM's top-k does.

Logprobs are log_softmax (float32) of the logits after steps 1-2 and before temperature and
truncation, like vLLM's default "raw" logprobs: they describe the model's (penalised)
distribution, so they do not change when a client only varies temperature/top_p. A token
blocked by min_new_tokens therefore reports LOGPROB_FLOOR (-9999.0, vLLM's stand-in for -inf:
JSON has no infinities), and is never the sampled one.

Sampling is inverse-CDF: one uniform u per row, the token whose interval of the cumulative
(token-id ordered) probabilities holds u. For a request with a seed, u for its k-th output
token is a pure function of (seed, k) (splitmix64), so the draw depends only on (seed, k, its
own logits), never on which other rows share the batch.
Rows without a seed take u from torch's global generator (torch.manual_seed controls it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvstrata.protocol.sampling_params import SamplingParams
from kvstrata.runner.sampling.grammar import fill_masks
# The row helpers live in logit_rows.py; imported here so callers keep one import.
from kvstrata.runner.sampling.logit_rows import (LOGPROB_FLOOR, finite_logprobs,  # noqa: F401
                                                 greedy_ids, scale_by_temperature, tame_logits,
                                                 top_rows)

_MASK64 = (1 << 64) - 1
# Width of the top-k prefix first tried for top-p-only rows (see Sampler._cut_threshold).
_NUCLEUS_PREFIX = 1024


@dataclass
class SamplingState:
    """What the sampler needs to know about one live request (the runner keeps one each)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the runner appends each sampled token after the call
    # Prompt ids as a tensor, built on first use: repetition_penalty needs them every step and
    # the prompt never changes, so convert the (possibly long) list only once.
    _prompt_tensor: torch.Tensor | None = field(default=None, init=False, repr=False,
                                                compare=False)
    # logit_bias as (ids, values) tensors, built on first use for the same reason.
    _bias: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False,
                                                            repr=False, compare=False)
    # Structured output: the request's grammar matcher (runner/sampling/grammar.py), or None.
    grammar: Any = field(default=None, repr=False, compare=False)

    def prompt_ids_on(self, dev: torch.device) -> torch.Tensor:
        """The prompt ids as a long tensor on `dev` (repetition_penalty), converted once."""
        if self._prompt_tensor is None or self._prompt_tensor.device != dev:
            self._prompt_tensor = torch.tensor(self.prompt_token_ids, dtype=torch.long,
                                               device=dev)
        return self._prompt_tensor

    def logit_bias_on(self, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """logit_bias as (ids, values) tensors on `dev`, converted once."""
        if self._bias is None or self._bias[0].device != dev:
            bias = self.params.logit_bias
            self._bias = (torch.tensor(list(bias), dtype=torch.long, device=dev),
                          torch.tensor(list(bias.values()), dtype=torch.float32, device=dev))
        return self._bias

    def record(self, token: int) -> None:
        """A sampled token joins the output (and advances the grammar)."""
        self.output_token_ids.append(token)
        if self.grammar is not None:
            self.grammar.accept(token)


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]  # None where params.logprobs is None
    top_logprobs: list[list[tuple[int, float]] | None]  # top-n, descending; None if not asked


def mix_seed(seed: int, step: int) -> int:
    """64-bit seed for a request's `step`-th output token (splitmix64 finaliser).

    Deterministic across processes (unlike hash() of str), and well spread so that
    (seed, k) and (seed, k + 1) give unrelated streams.
    """
    x = ((seed & _MASK64) ^ (((step + 1) * 0x9E3779B97F4A7C15) & _MASK64)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _adjusts_logits(s: SamplingState) -> bool:
    """Penalties, a logit bias or a grammar: the row's logits change before anything is
    chosen."""
    p = s.params
    return (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
            or p.presence_penalty != 0.0 or bool(p.logit_bias) or s.grammar is not None)


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: list[int]):
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = [int(t) for t in eos_token_ids]

    # ------------------------------------------------------------------ entry point
    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> SampleResult:
        n = len(states)
        if n == 0:
            return SampleResult([], [], [])
        if logits.dim() != 2 or logits.shape[0] != n:
            raise ValueError(f"logits must be [{n}, vocab], got {tuple(logits.shape)}")
        # An lm_head padded past the tokenizer's vocabulary must never yield a padded id.
        if logits.shape[1] > self.vocab_size:
            logits = logits[:, : self.vocab_size]

        params = [s.params for s in states]
        greedy = [p.is_greedy for p in params]
        adjust = [i for i, s in enumerate(states)
                  if _adjusts_logits(s) or self._blocks_eos(s)]
        want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]

        # Hot path (every decode step of a plain greedy batch): a single argmax on the raw
        # logits; argmax of bf16/fp16 equals argmax of their exact float32 upcast.
        if not adjust and not want_lp and all(greedy):
            return SampleResult(greedy_ids(logits), [None] * n, [None] * n)

        if adjust:
            # Copy: the caller's tensor must not be mutated by per-row penalties.
            logits = logits.to(torch.float32, copy=True)
            self._adjust_rows(logits, states, adjust)
        else:
            logits = logits.float()  # read-only below, so no copy needed
        logits = tame_logits(logits)

        tokens = [0] * n
        greedy_rows = [i for i in range(n) if greedy[i]]
        if greedy_rows:
            g = logits if len(greedy_rows) == n else logits[greedy_rows]
            for i, t in zip(greedy_rows, greedy_ids(g)):
                tokens[i] = t
        sample_rows = [i for i in range(n) if not greedy[i]]
        if sample_rows:
            sub = logits if len(sample_rows) == n else logits[sample_rows]
            drawn = self._sample(sub, [states[i] for i in sample_rows])
            for i, t in zip(sample_rows, drawn):
                tokens[i] = t

        logprobs: list[float | None] = [None] * n
        top_logprobs: list[list[tuple[int, float]] | None] = [None] * n
        if want_lp:
            self.fill_logprobs(logits, want_lp, params, tokens, logprobs, top_logprobs)
        return SampleResult(tokens, logprobs, top_logprobs)

    def adjusted(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """float32 logits after penalties and the min_new_tokens mask (steps 1-2), as the
        sampler sees them (tame_logits: no +inf or NaN); a copy when anything changes."""
        if logits.shape[1] > self.vocab_size:
            logits = logits[:, : self.vocab_size]
        adjust = [i for i, s in enumerate(states)
                  if _adjusts_logits(s) or self._blocks_eos(s)]
        if not adjust:
            return tame_logits(logits.float())
        logits = logits.to(torch.float32, copy=True)
        self._adjust_rows(logits, states, adjust)
        return tame_logits(logits)

    # ------------------------------------------------------------------ penalties
    def _blocks_eos(self, s: SamplingState) -> bool:
        return len(s.output_token_ids) < s.params.min_new_tokens

    def _adjust_rows(self, logits: torch.Tensor, states: list[SamplingState],
                     rows: list[int]) -> None:
        fill_masks([states[i].grammar for i in rows])  # the batch's grammars in one call
        for i in rows:
            self._adjust_row(logits[i], states[i])

    def _adjust_row(self, row: torch.Tensor, s: SamplingState) -> None:
        """Applies penalties, logit_bias, the grammar and the min_new_tokens mask in place to
        one float32 row."""
        p, vocab, dev = s.params, row.shape[0], row.device
        if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 \
                or p.presence_penalty != 0.0:
            self._penalise_row(row, s)
        if p.logit_bias:
            ids, vals = s.logit_bias_on(dev)
            keep = ids < vocab  # the API refuses ids outside the vocabulary; LLM() may not
            row[ids[keep]] += vals[keep]
        allowed = s.grammar.allowed() if s.grammar is not None else None
        if allowed is not None:  # (None: inside a thinking section, SGLang's reasoning)
            self._mask_row(row, allowed[:vocab].to(dev))
        if self._blocks_eos(s):
            blocked = [t for t in (*self.eos_token_ids, *p.stop_token_ids) if t < vocab]
            if blocked:
                ids = torch.tensor(blocked, dtype=torch.long, device=dev)
                kept = row[ids]
                row[ids] = float("-inf")
                if allowed is not None and not bool(row.max() > float("-inf")):
                    row[ids] = kept  # a complete grammar allows only these: it ends here

    @staticmethod
    def _mask_row(row: torch.Tensor, allowed: torch.Tensor) -> None:
        """Only the grammar's tokens stay. If none of them has a usable logit (all -inf or
        NaN: a -inf logit_bias, say), they share the row evenly: tame_logits would otherwise
        spread a dead row over the whole vocabulary, grammar or not."""
        n = allowed.shape[0]
        row[n:] = float("-inf")
        head = row[:n]
        head.masked_fill_(allowed.logical_not(), float("-inf"))
        best = head.max()  # NaN when any is: then look closer
        if not bool(best > float("-inf")) and not bool((head > float("-inf")).any()):
            head.copy_(torch.where(allowed, 0.0, float("-inf")))

    @staticmethod
    def _penalise_row(row: torch.Tensor, s: SamplingState) -> None:
        """Repetition, frequency and presence penalties, in place."""
        p, vocab, dev = s.params, row.shape[0], row.device
        out = torch.tensor(s.output_token_ids, dtype=torch.long, device=dev)
        out = out[out < vocab]  # ids the (possibly truncated) logits cannot hold are ignored
        if p.repetition_penalty != 1.0:
            seen = torch.cat([s.prompt_ids_on(dev), out])
            seen = torch.unique(seen[seen < vocab])
            # Each id once, whatever its count: the HF/vLLM penalty is a presence-style scale.
            vals = row[seen]
            r = p.repetition_penalty
            row[seen] = torch.where(vals > 0, vals / r, vals * r)
        if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and out.numel():
            ids, counts = torch.unique(out, return_counts=True)
            row[ids] -= counts.to(row.dtype) * p.frequency_penalty + p.presence_penalty

    # ------------------------------------------------------------------ random sampling
    def _sample(self, logits: torch.Tensor, states: list[SamplingState]) -> list[int]:
        """Draws one token per row of non-greedy requests from float32 `logits`."""
        return self.inverse_cdf(self.sampling_probs(logits, states), self.uniforms(states).to(
            logits.device))

    def sampling_probs(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """The distribution each non-greedy row draws from (temperature, top-k, top-p,
        min-p applied; rows are not renormalised after min-p: draws scale by the total).
        The speculative verifier (runner/spec/verify.py) draws from it too."""
        m, vocab = logits.shape
        dev = logits.device
        ps = [s.params for s in states]
        temps = torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=dev)
        # new tensor: safe to edit, caller's stays as is
        logits = scale_by_temperature(logits, temps)

        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in ps]
        tops = [p.top_p for p in ps]
        rows = [i for i in range(m) if ks[i] < vocab or tops[i] < 1.0]
        if rows:
            sub = logits if len(rows) == m else logits[rows]
            thr = self._cut_threshold(sub, [ks[i] for i in rows], [tops[i] for i in rows])
            sub = sub.masked_fill(sub < thr, float("-inf"))
            if len(rows) == m:
                logits = sub
            else:
                logits[rows] = sub

        probs = torch.softmax(logits, dim=-1)
        min_ps = [p.min_p for p in ps]
        if max(min_ps) > 0.0:
            mp = torch.tensor(min_ps, dtype=torch.float32, device=dev).unsqueeze(1)
            # The max itself always survives (p_max >= min_p * p_max), so no row empties.
            probs = probs.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * mp, 0.0)
        return probs

    @classmethod
    def _cut_threshold(cls, logits: torch.Tensor, ks: list[int], tops: list[float],
                       width: int | None = None) -> torch.Tensor:
        """Per-row logit threshold [r, 1] implementing top-k then top-p; keep logits >= it.

        A value threshold (not "the first k positions of a sort") makes the kept set depend
        only on the row's values: tokens tied at the cut are all kept, and which tied token a
        sort happens to put first can never make a seeded request batch-dependent.
        """
        r, vocab = logits.shape
        dev = logits.device
        if width is None:
            finite = [k for k in ks if k < vocab]
            # Only the kmax largest can survive a top-k. A top-p-only row needs the nucleus,
            # which for real LM outputs nearly always sits in the top ~1k: try that prefix
            # (topk is ~10x cheaper than sorting 150k logits) and verify below.
            width = max(finite) if len(finite) == r else max([_NUCLEUS_PREFIX, *finite])
            width = min(width, vocab)
        if width < vocab:
            vals = logits.topk(width, dim=-1, sorted=True).values
        else:
            vals = logits.sort(dim=-1, descending=True).values
        neg_inf = torch.tensor(float("-inf"), device=dev)
        k_t = torch.tensor([min(k, width) for k in ks], dtype=torch.long, device=dev)
        k_thr = vals.gather(1, (k_t - 1).unsqueeze(1))
        no_k = torch.tensor([k >= vocab for k in ks], device=dev).unsqueeze(1)
        k_thr = torch.where(no_k, neg_inf, k_thr)
        if min(tops) >= 1.0:
            return k_thr

        pos = torch.arange(width, device=dev).unsqueeze(0)
        vals = vals.masked_fill(pos >= k_t.unsqueeze(1), float("-inf"))
        # top-p sees the top-k-renormalised distribution (as SGLang/vLLM do); rows without a
        # top-k are normalised over the whole row, not just the prefix we looked at, and
        # always from the row itself so the prefix width (set by the batch) cannot matter.
        lse = torch.logsumexp(vals, dim=-1, keepdim=True)
        if bool(no_k.any()):
            lse = torch.where(no_k, torch.logsumexp(logits, dim=-1, keepdim=True), lse)
        sp = torch.exp(vals - lse)
        cum = sp.cumsum(dim=-1)
        # Rows with top_p == 1 get an infinite bar: cumsum rounding must not cut their tail.
        p_t = torch.tensor([t if t < 1.0 else float("inf") for t in tops],
                           dtype=torch.float32, device=dev).unsqueeze(1)
        has_p = torch.isfinite(p_t)
        if width < vocab and bool((no_k & has_p & (cum[:, -1:] < p_t)).any()):
            # The nucleus of some top-p-only row spills past the prefix: sort everything.
            return cls._cut_threshold(logits, ks, tops, width=vocab)
        # Keep the smallest prefix whose mass reaches top_p: a token is dropped when the mass
        # strictly before it already does, so the first token always stays.
        # (clamped: with NaN masses the comparison drops every token, and index -1 crashed
        # the scheduler process on a fuzzed request)
        n_keep = ((cum - sp) < p_t).sum(dim=-1, keepdim=True).clamp_(min=1)
        p_thr = torch.where(has_p, vals.gather(1, n_keep - 1), neg_inf)
        return torch.maximum(k_thr, p_thr)

    @staticmethod
    def uniforms(states: list[SamplingState]) -> torch.Tensor:
        """One U[0,1) per row: from (seed, step) alone when seeded, else torch's global RNG
        (shared with the speculative verifier, so a seeded draw is the same either way)."""
        u = torch.empty(len(states), dtype=torch.float32)
        unseeded = [i for i, s in enumerate(states) if s.params.seed is None]
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), dtype=torch.float32)
        for i, s in enumerate(states):
            if s.params.seed is not None:
                # Top 24 bits -> exactly representable float32 in [0, 1).
                bits = mix_seed(s.params.seed, len(s.output_token_ids)) >> 40
                u[i] = bits / float(1 << 24)
        return u

    @staticmethod
    def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> list[int]:
        """Token whose CDF interval (in token-id order) holds u * total mass.

        One uniform per row instead of vocab-sized noise: an O(vocab) cumsum is several
        times cheaper on CPU than drawing vocab exponentials, and the result is a pure
        function of the row's probs and u (so seeded draws ignore the batch).
        """
        cdf = probs.cumsum(dim=-1)
        total = cdf[:, -1:]
        x = u.unsqueeze(1) * total
        # Keep x < total (guards u == 1 and device rounding) so an answer exists; then
        # cdf[i] > x >= cdf[i-1] implies probs[i] > 0: a filtered token is never returned.
        x = torch.minimum(x, torch.nextafter(total, torch.zeros_like(total)))
        idx = torch.searchsorted(cdf, x, right=True)
        # never past the last token, whatever the probs (tame_logits keeps them finite)
        return idx.squeeze(1).clamp_(max=probs.shape[1] - 1).tolist()

    # ------------------------------------------------------------------ logprobs
    @staticmethod
    def fill_logprobs(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                       tokens: list[int], logprobs: list, top_logprobs: list) -> None:
        """Fill logprobs[i] / top_logprobs[i] for each row i in `rows` from its logits and
        chosen token (used by the speculative verifier too)."""
        sub = logits if len(rows) == logits.shape[0] else logits[rows]
        lp = finite_logprobs(torch.log_softmax(sub.float(), dim=-1))
        chosen_ids = torch.tensor([tokens[i] for i in rows], dtype=torch.long,
                                  device=lp.device)
        chosen = lp.gather(1, chosen_ids.unsqueeze(1)).squeeze(1).tolist()
        tops = top_rows(lp, [params[i] for i in rows])
        for j, i in enumerate(rows):
            logprobs[i] = chosen[j]
            top_logprobs[i] = tops[j]
