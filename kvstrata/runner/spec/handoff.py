"""PD + EAGLE-family drafts (EAGLE, EAGLE3, NEXTN): the prefill server's draft state crosses
to the decode server and drives its first draft round (SGLang's eagle_disaggregation.py).

Prefill (`prefill_draft_extend`, after the target's forward and sampling): the draft extends
every prompt position a chunk completed (position i reads x_{i+1}: a prompt token, or for the
last position the sampled first token), so the draft KV of each page exists before the page
is sent -- the draft's pool is a registered page buffer like the target's (runner/
executors/disagg.py), so the draft KV travels with the target KV. After the last chunk the
draft's first top-k (`topk_p` / `topk_index`, at most SPEC_TOPK_LIMIT) and its hidden state
at the last prompt position go into the metadata (protocol/disagg.py SpecHandoff); for
NEXTN with IndexShare the seed is the MTP layer's top-k at that position, as request
positions.

Decode (`take_handoff`, the request's first scheduled step): the transferred slots hold
valid draft KV for the prompt (x_1 .. x_n follow them); a first step that drafts starts from
the shipped state instead of re-running the extend (bonus token: the first token, which the
entry holds already).
"""
from __future__ import annotations

import torch

from kvstrata.protocol.disagg import SPEC_TOPK_LIMIT, SpecHandoff


def hidden_to_bytes(hidden: torch.Tensor) -> tuple[bytes, str]:
    h = hidden.detach().to("cpu").contiguous()
    return h.view(torch.uint8).numpy().tobytes(), str(h.dtype).removeprefix("torch.")


def hidden_from_bytes(handoff: SpecHandoff, size: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor | None:
    """[1, size] in `dtype`, or None when the bytes do not fit this draft (never guessed)."""
    want = str(dtype).removeprefix("torch.")
    if handoff.hidden_dtype != want or len(handoff.hidden) != size * dtype.itemsize:
        return None
    raw = torch.frombuffer(bytearray(handoff.hidden), dtype=dtype)
    return raw.view(1, size).to(device)


def start_logits(handoff: SpecHandoff, vocab: int, device: torch.device) -> torch.Tensor:
    """The first draft step's distribution as logits [1, V]: log p on the shipped top-k,
    -inf elsewhere (its argmax is topk_index[0], its top-k the shipped one)."""
    out = torch.full((1, vocab), float("-inf"), device=device)
    idx = torch.tensor(handoff.topk_index, dtype=torch.int64, device=device)
    p = torch.tensor(handoff.topk_p, dtype=torch.float32, device=device)
    out[0, idx] = p.clamp(min=1e-30).log()
    return out


def prefill_draft_extend(draft, reqs, prompt_of, first_tokens: dict[str, int], topk: int
                         ) -> tuple[dict[str, SpecHandoff], dict[str, list[int]]]:
    """After a PD prefill step's forward (features stored) and sampling: extend the draft
    over each request's new prompt positions. Returns, for requests whose last chunk ran,
    their SpecHandoff and (NEXTN + IndexShare) the seed positions."""
    plans, last = [], []
    for r in reqs:
        if r.num_draft:
            continue
        prompt = prompt_of(r.rid)
        end = r.start_pos + len(r.token_ids)
        if end > len(prompt):
            continue  # a decode step (a prefill server never runs one; tests may)
        if end < len(prompt):
            ids = prompt[:end + 1]
        elif r.rid in first_tokens:
            ids = prompt + [first_tokens[r.rid]]
        else:
            continue
        plans.append(draft.catch_up_plan(r.rid, r.row, ids, end + 1))
        last.append(end >= len(prompt))
    if not plans:
        return {}, {}
    with torch.inference_mode():
        logits, carry = draft.extend(plans)
    handoffs: dict[str, SpecHandoff] = {}
    seeds: dict[str, list[int]] = {}
    k = min(topk, SPEC_TOPK_LIMIT)
    for i, (plan, is_last) in enumerate(zip(plans, last)):
        if not is_last:
            continue
        p, idx = torch.softmax(logits[i].float(), dim=-1).topk(k)
        hidden, seed = draft.handoff_rows(carry, i, plan)
        raw, dtype = hidden_to_bytes(hidden)
        handoffs[plan.rid] = SpecHandoff(p.tolist(), idx.tolist(), raw, dtype)
        if seed is not None:
            seeds[plan.rid] = seed
    return handoffs, seeds


__all__ = ["hidden_from_bytes", "hidden_to_bytes", "prefill_draft_extend", "start_logits"]
