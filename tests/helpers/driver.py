"""A minimal scheduler for driving ModelRunner directly in tests.

It plays the real scheduler's role in the contract: hands out req_to_token rows and KV pages
(in a shuffled order, so a request's pages are not contiguous), sends each request as new
once, schedules prompt chunks then one decode token per step, and frees requests when done.
Requests may arrive at different steps, so prefill chunks and decodes share batches.
With an SWA pool (hybrid SWA memory) it also plays the KV manager's SWA part: an SWA page per
full page (shuffled too), each request's `swa_slots`, and the SWA pages a request's next
query can no longer reach freed at once (for others to reuse; `SWA_STATS` counts them).
With a state pool (SSM / linear-attention models) each request holds a state slot (shuffled
too), reset on its first chunk and freed when it finishes.
"""
from __future__ import annotations

import random

from kvstrata.protocol import (NewRequestData, SamplingParams, ScheduledRequest,
                               SchedulerOutput)


SWA_STATS = {"allocated": 0, "freed_early": 0}


class _Req:
    def __init__(self, rid: str, prompt: list[int], max_new: int, arrival: int):
        self.rid, self.prompt, self.max_new, self.arrival = rid, prompt, max_new, arrival
        self.row = 0
        self.pages: list[int] = []
        self.computed = 0       # positions whose KV is in the pool
        self.output: list[int] = []
        self.sent = False
        self.swa: dict[int, int] = {}  # page index in the request -> its SWA page
        self.state_slot = 0

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new


def greedy_generate(runner, prompts: list[list[int]], max_new: int, chunk: int | None = None,
                    arrivals: list[int] | None = None, seed: int = 0,
                    params: SamplingParams | None = None) -> list[list[int]]:
    p = runner.plan.page_size
    free_pages = list(range(1, runner.plan.num_pages + 1))
    random.Random(seed).shuffle(free_pages)
    swa = getattr(runner, "swa_pool", None) is not None
    free_swa = list(range(1, runner.plan.num_swa_pages + 1))
    random.Random(seed + 1).shuffle(free_swa)
    window = runner.plan.swa_window
    free_rows = list(range(1, runner.plan.num_rows + 1))
    free_states = list(range(1, runner.plan.num_state_slots + 1))
    random.Random(seed + 2).shuffle(free_states)
    arrivals = arrivals or [0] * len(prompts)
    params = params or SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
    reqs = [_Req(f"r{i}", list(pr), max_new, a) for i, (pr, a) in
            enumerate(zip(prompts, arrivals))]
    step, freed = 0, []
    while not all(r.done for r in reqs):
        new, scheduled = [], []
        for r in reqs:
            if r.done or r.arrival > step:
                continue
            if not r.sent:
                r.row = free_rows.pop(0)
                r.state_slot = free_states.pop() if free_states else 0
                new.append(NewRequestData(r.rid, r.prompt, [], params))
                r.sent = True
            if r.computed < len(r.prompt):
                n = len(r.prompt) - r.computed if chunk is None else min(
                    chunk, len(r.prompt) - r.computed)
                tokens = r.prompt[r.computed:r.computed + n]
            else:
                tokens = [r.output[-1]]
            start = r.computed
            while len(r.pages) * p < start + len(tokens):
                r.pages.append(free_pages.pop())
                if swa:
                    r.swa[len(r.pages) - 1] = free_swa.pop()
                    SWA_STATS["allocated"] += 1
            positions = range(start, start + len(tokens))
            slots = [r.pages[q // p] * p + q % p for q in positions]
            sample = start + len(tokens) >= len(r.prompt)
            scheduled.append(ScheduledRequest(r.rid, r.row, start, tokens, start, slots, sample))
            if r.state_slot:
                scheduled[-1].state_slot = r.state_slot
                scheduled[-1].state_reset = start == 0
            if swa:
                scheduled[-1].swa_slots = [r.swa[q // p] * p + q % p if q // p in r.swa else 0
                                           for q in positions]
        out = runner.execute(SchedulerOutput(step, False, new, scheduled, freed))
        freed = []
        by_id = dict(zip(out.rids, out.token_ids))
        for s in scheduled:
            r = next(x for x in reqs if x.rid == s.rid)
            r.computed += len(s.token_ids)
            if swa:  # the next query (position computed) reads computed - window + 1 on
                for k in [k for k in r.swa if (k + 1) * p <= r.computed - window + 1]:
                    free_swa.append(r.swa.pop(k))
                    SWA_STATS["freed_early"] += 1
            if s.sample:
                r.output.append(by_id[s.rid])
                if r.done:
                    freed.append(r.rid)
                    free_rows.append(r.row)
                    if r.state_slot:
                        free_states.append(r.state_slot)
                    free_pages.extend(r.pages)
                    r.pages = []
                    free_swa.extend(r.swa.values())
                    r.swa = {}
        step += 1
    if freed:
        runner.execute(SchedulerOutput(step, False, [], [], freed))
    return [r.output for r in reqs]


def greedy_in_mode(runner, prompts: list[list[int]], max_new: int, batched: bool,
                   chunk: int | None = None, staggered: bool = False) -> list[list[int]]:
    """All prompts in one batch (optionally chunked, arriving 3 steps apart), or each alone."""
    if not batched:
        return [greedy_generate(runner, [p], max_new)[0] for p in prompts]
    arrivals = [i * 3 for i in range(len(prompts))] if staggered else None
    return greedy_generate(runner, prompts, max_new, chunk=chunk, arrivals=arrivals)
