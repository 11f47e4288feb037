"""One answer's accumulated outputs (Acc) and SGLang's meta_info of it: /generate's, and a
chat choice's with return_meta_info."""
from __future__ import annotations

import time

from kvstrata.entrypoints.api import serving_openai as so
from kvstrata.frontend import ipc
from kvstrata.protocol.sampling_params import split_top_logprobs


class Acc:
    """Everything one choice produced so far."""

    def __init__(self, choice: so.Choice):
        self.choice = choice
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.top_logprobs: list = []
        self.prompt_logprobs: list[float] | None = None
        self.prompt_top_logprobs: list | None = None
        self.last: ipc.TextOutput | None = None

    def add(self, out: ipc.TextOutput) -> None:
        self.text += out.text
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs or []
        self.top_logprobs += out.new_top_logprobs or []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
            self.prompt_top_logprobs = out.prompt_top_logprobs
        self.last = out


def meta_info(out: ipc.TextOutput, acc: Acc, rid: str, start: float, want_lp: bool,
              input_lp: bool, tt: so.TokenText | None) -> dict:
    """SGLang's meta_info; logprob entries are [logprob, token_id, text], the text filled
    only with return_text_in_logprobs (`tt` given)."""
    def text(token_id: int) -> str | None:
        return tt(token_id) if tt is not None else None

    if out.finish_type == "length":
        reason = {"type": "length", "length": out.completion_tokens}
    elif out.finish_type:
        reason = {"type": out.finish_type, "matched": out.matched_stop}
        if out.error_message:
            reason["message"] = out.error_message
    else:
        reason = None
    meta = {"id": rid, "finish_reason": reason, "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens, "cached_tokens": out.cached_tokens,
            "e2e_latency": time.perf_counter() - start}
    if out.spec is not None:
        meta.update(out.spec.meta_info(out.completion_tokens))
    if want_lp:
        meta.update(_logprob_meta(acc, input_lp, text))
    return meta


def _logprob_meta(acc: Acc, input_lp: bool, text) -> dict:
    """SGLang's output_/input_ token_logprobs, top_logprobs and token_ids_logprobs. Each
    reported position's top list holds the top-n, then the token_ids_logprob ids."""
    params = acc.choice.req.sampling_params

    def entries(row) -> list:
        return [[t.logprob, t.token_id, text(t.token_id)] for t in row]

    def split(rows) -> tuple[list, list]:
        parts = [split_top_logprobs(row, params) for row in rows]
        return [entries(top) for top, _ in parts], [entries(asked) for _, asked in parts]

    meta = {"output_token_logprobs": [[lp, t, text(t)] for lp, t in
                                      zip(acc.logprobs, acc.token_ids)]}
    tops, asked = split(acc.top_logprobs)
    meta["output_top_logprobs"] = tops if acc.top_logprobs else None
    if params.token_ids_logprob:
        meta["output_token_ids_logprobs"] = asked
    if input_lp:
        ids = acc.choice.req.prompt_ids
        lps = [None] + list(acc.prompt_logprobs or [])
        meta["input_token_logprobs"] = [[lp, t, text(t)] for lp, t in zip(lps, ids)]
        tops, asked = split(acc.prompt_top_logprobs or [])
        if params.logprobs:  # the first prompt token has no logprob
            meta["input_top_logprobs"] = [None] + tops
        if params.token_ids_logprob:
            meta["input_token_ids_logprobs"] = [None] + asked
    return meta
