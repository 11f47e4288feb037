"""What the engine core reports per request per step (crosses the scheduler -> detokenizer
socket, so it is a msgspec struct)."""
from __future__ import annotations

import msgspec

from kvstrata.protocol.logprobs import TopLogprob


class FinishReason(msgspec.Struct, omit_defaults=True):
    # "stop" (EOS, stop token or stop string), "length" (max_new_tokens or context), "abort"
    type: str
    # The stop string or stop token id that matched (type == "stop"); None for EOS-less stops.
    matched: str | int | None = None
    message: str | None = None  # abort reason
    status_code: int | None = None  # abort: the HTTP status it maps to (400, 500, 503)

    @property
    def by_token(self) -> bool:
        """Stopped at a stop token (EOS or one of stop_token_ids): SGLang leaves it out of
        the text unless no_stop_trim (skip_special_tokens hides an EOS anyway; it shows
        with false). Its id stays in the output ids."""
        return self.type == "stop" and isinstance(self.matched, int) \
            and not isinstance(self.matched, bool)


class SpecCounts(msgspec.Struct, array_like=True):
    """A request's speculative decoding so far: decode steps (each one verify pass), draft
    tokens proposed, drafts accepted."""
    verify_ct: int
    draft_tokens: int
    accepted_drafts: int

    def meta_info(self, completion_tokens: int) -> dict:
        """SGLang's meta_info keys (accept length = completion tokens per verify pass)."""
        return {"spec_verify_ct": self.verify_ct,
                "spec_accept_length": (completion_tokens / self.verify_ct
                                       if self.verify_ct else 0.0),
                "spec_draft_token_num": self.draft_tokens,
                "spec_accept_token_num": self.accepted_drafts,
                "spec_accept_rate": (self.accepted_drafts / self.draft_tokens
                                     if self.draft_tokens else 0.0)}


class RequestOutput(msgspec.Struct):
    rid: str
    # Tokens produced since the previous RequestOutput for this request.
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Parallel to new_token_ids, only when sampling_params.logprobs is not None.
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[list[TopLogprob]] | None = None
    # Logprobs of prompt tokens 1..n-1 (echo scoring), sent once, with the first output.
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[TopLogprob]] | None = None
    # Speculative decoding counters (None when the server does not speculate).
    spec: SpecCounts | None = None
