"""How much of each running request's remaining max_new_tokens the prefill admission reserves.

SGLang's estimator: start at min(0.7 x conservativeness, 1), decay linearly to 0.14 of that
over 600 decode steps, and re-estimate from the surviving batch after each retraction.
"""
from __future__ import annotations

import logging

logger = logging.getLogger("kvstrata.engine.scheduler.core")

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20
CLIP_MAX_NEW_TOKENS_ESTIMATION = 4096


class NewTokenRatio:
    def __init__(self, schedule_conservativeness: float = 1.0):
        self.init = min(INIT_NEW_TOKEN_RATIO * schedule_conservativeness, 1.0)
        self.min = min(self.init * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.decay = (self.init - self.min) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.value = self.init

    def on_decode_step(self) -> None:
        self.value = max(self.value - self.decay, self.min)

    def on_retract(self, remaining: list) -> float:
        """Re-estimate from the requests still running (each has output_ids and params)."""
        generated = sum(len(r.output_ids) for r in remaining)
        budget = sum(r.params.max_new_tokens for r in remaining)
        self.value = min(1.0, (generated + RETRACT_DECODE_STEPS * len(remaining)) / (budget + 1))
        return self.value

    def after_retraction(self, num_retracted: int, remaining: list) -> None:
        """Re-estimate once a retraction left `remaining` running, with SGLang's log line."""
        if num_retracted and remaining:
            old = self.value
            new = self.on_retract(remaining)
            logger.warning("KV cache pool is full. Retract requests. #retracted_reqs: %d, "
                           "#new_token_ratio: %.4f -> %.4f", num_retracted, old, new)

    def reserved_tokens(self, req) -> int:
        """Future decode tokens a running request is expected to still need."""
        return int(min(req.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS_ESTIMATION) * self.value)
