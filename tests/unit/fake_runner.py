"""A torch-free stand-in for the model runner that *checks* the KV bookkeeping.

It keeps a fake KV pool (slot -> (position, token)) and req_to_token rows exactly as the
scheduler describes them, and its "model" derives the next token from the sequence it reads
back through the row. Any bookkeeping bug (a wrong slot, a page reused while still in use, a
stale row entry) changes the output, so tests compare against `reference_tokens`.
"""
from __future__ import annotations

import random
from collections import deque

from kvstrata.protocol import (RunnerOutput, SchedulerOutput, StorageCancel, StorageProgress,
                               TransferDone, TransferOp, of_type)
from kvstrata.protocol.scheduler_output import RUNNER_DRAFT, TreeDraft
from kvstrata.transfer.storage_jobs import stored_window_end


def next_token(tokens: list[int], vocab: int) -> int:
    h = 0
    for i, t in enumerate(tokens):
        h = (h * 31 + (i + 1) * (t + 7)) % 1_000_003
    return h % vocab


def reference_tokens(prompt: list[int], n: int, vocab: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq, vocab))
    return seq[len(prompt):]


def pattern_drafter(num_draft_tokens: int, seed: int, vocab: int, trees: bool = True):
    """A SpeculativeSide.draft stand-in: drafts of a random length whose first `good`
    tokens are the true continuation (reference_tokens) and the rest wrong, so every accept
    length (0 .. all) happens against a fake runner. `trees` False: chains only (a
    recurrent-state model verifies no trees)."""
    import random

    rng = random.Random(seed)

    def draft(req, limit, max_nodes=None):
        n = min(limit, num_draft_tokens - 1, rng.randint(0, num_draft_tokens))
        if n <= 0:
            return []
        done = len(req.output_ids)
        truth = reference_tokens(req.prompt_ids, done + n, vocab)[done:]
        good = rng.randint(0, n)
        if trees and rng.random() < 0.3:  # a tree (NGRAM's BFS / PROB): up to twice the nodes
            nodes = min(2 * n, num_draft_tokens - 1 if max_nodes is None else max_nodes)
            return tree_draft(truth, good, max(nodes, 1), rng, vocab)
        return truth[:good] + [(t + 1) % vocab for t in truth[good:]]
    return draft


def tree_draft(truth: list[int], good: int, n: int, rng, vocab: int) -> TreeDraft:
    """A random tree of at most n nodes, breadth-first, at most len(truth) deep: the
    first `good` levels of one path hold the true continuation, every other node a wrong
    token (siblings distinct), so the accepted path goes through random branches."""
    tokens: list[int] = []
    parents: list[int] = []
    queue = deque([(0, 0, True)])  # (entry index, depth, on the true path)
    while queue and len(tokens) < n:
        idx, depth, true = queue.popleft()
        if depth >= len(truth):
            continue
        k = rng.randint(1, 3)
        right = rng.randrange(k) if true and depth < good else -1
        for c in range(k):
            if len(tokens) >= n:
                break
            tokens.append(truth[depth] if c == right else (truth[depth] + 1 + c) % vocab)
            parents.append(idx)
            queue.append((len(tokens), depth + 1, c == right))
    return TreeDraft(tokens, parents)


def _fill_page(pool: dict, page: int, P: int, entries: tuple) -> None:
    """Write a stored page (an entry or None per slot) into a fake pool's page."""
    for o, entry in enumerate(entries):
        if entry is None:
            pool.pop(page * P + o, None)
        else:
            pool[page * P + o] = entry


def copy_pages(src: dict, dst: dict, src_pages: list[int], dst_pages: list[int], P: int) -> None:
    """Copy whole pages of a fake pool (slot -> (position, token)); empty slots stay empty."""
    for sp, dp in zip(src_pages, dst_pages):
        for off in range(P):
            if sp * P + off in src:
                dst[dp * P + off] = src[sp * P + off]
            else:
                dst.pop(dp * P + off, None)


class FakeStorage:
    """HiCache L3 for the fake runner: key -> a page's fake KV (tuple of (position, token) or
    None per slot). Jobs ("h2s"/"s2h") take `delay` steps; `fail_set`/`fail_get` are keys whose
    write fails / whose stored record reads as corrupt (a miss after batch_exists said hit);
    `error_every` > 0 makes every n-th job raise a backend error instead; `corrupt_every` > 0
    makes every n-th page read fail its checks."""

    def __init__(self, delay: int = 1, fail_set=(), fail_get=(), error_every: int = 0,
                 corrupt_every: int = 0):
        self.pages: dict[str, tuple] = {}
        self.delay = delay
        self.fail_set, self.fail_get = set(fail_set), set(fail_get)
        self.error_every = error_every
        self.corrupt_every = corrupt_every
        self.reads = 0
        self.jobs_run = 0
        self.stats = {"pages_read": 0, "pages_written": 0}

    def exists(self, keys) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.pages:
            n += 1
        return n


class FakeRunner:
    def __init__(self, page_size: int = 1, vocab_size: int = 1000, max_context_len: int = 4096,
                 eos_token_ids: tuple[int, ...] = (), storage: FakeStorage | None = None):
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.draft_rng = random.Random(0)  # STANDALONE stand-in's accept pattern
        self.max_context_len = max_context_len
        self.eos_token_ids = list(eos_token_ids)
        self.kv: dict[int, tuple[int, int]] = {}
        self.rows: dict[int, dict[int, int]] = {}
        self.known: dict[str, object] = {}
        self.steps: list[SchedulerOutput] = []
        self.host: dict[int, tuple[int, int]] = {}  # host slot -> (position, token)
        self.async_ops: list = []  # background d2h writes, completed one step later
        self.moved_pages = {"d2h": 0, "h2d": 0}
        self.storage = storage
        self.storage_jobs: dict[int, list] = {}  # job id -> [op, steps left, hit pages]
        self.computed_tokens = 0  # tokens the "model" ran (a prefix hit skips them)
        self.verified_drafts = 0  # speculative drafts the "model" accepted

    # ---- HiCache L3 -------------------------------------------------------------------
    def _run_storage_job(self, op, hit: int, limit: int | None = None) -> StorageProgress:
        st, P = self.storage, self.page_size
        st.jobs_run += 1
        if st.error_every and st.jobs_run % st.error_every == 0:
            return StorageProgress(op.job_id, hit, 0, True, "injected backend error",
                                   state_page=self._state_page(op))
        done, swa_read = 0, []
        n = hit if limit is None else min(hit, limit)
        for i in range(n):
            key, page = op.keys[i], op.host_pages[i]
            if op.kind == "h2s":
                if key in st.fail_set:
                    break
                st.pages.setdefault(key, tuple(self.host.get(page * P + o) for o in range(P)))
                st.stats["pages_written"] += 1
                if op.swa_keys:  # the SWA half's record (FakeSWARunner's host SWA pool)
                    st.pages.setdefault(op.swa_keys[i], self._host_swa_page(page))
            else:
                st.reads += 1
                if key in st.fail_get or (st.corrupt_every and st.reads % st.corrupt_every == 0):
                    break
                _fill_page(self.host, page, P, st.pages[key])
                st.stats["pages_read"] += 1
            done += 1
        if op.kind == "s2h" and op.swa_keys:  # one window, as StorageJobRunner (one batch)
            stop = stored_window_end([k in st.pages for k in op.swa_keys[:done]],
                                     op.swa_window_pages)
            for i in range(max(stop - op.swa_window_pages, 0), stop):
                self._set_host_swa_page(op.host_pages[i], st.pages[op.swa_keys[i]])
                swa_read.append(i)
        return StorageProgress(op.job_id, hit, done, True, swa_read=swa_read,
                               state_page=self._state_page(op))

    def _storage_hit(self, op) -> int:
        """The job's hit pages, known when it is submitted (an s2h reports it at once)."""
        return len(op.keys) if op.kind == "h2s" else self.storage.exists(op.keys)

    def _state_page(self, op) -> int:
        """StorageProgress.state_page of the job (FakeStateRunner's storage reads states)."""
        return 0

    def _host_swa_page(self, page: int) -> tuple:
        raise AssertionError("SWA storage keys without an SWA pool")

    def _set_host_swa_page(self, page: int, entries: tuple) -> None:
        raise AssertionError("SWA storage keys without an SWA pool")

    def _storage_step(self, so: SchedulerOutput) -> list[StorageProgress]:
        progress = []
        for job, entry in list(self.storage_jobs.items()):
            entry[1] -= 1
            if entry[1] <= 0:
                del self.storage_jobs[job]
                progress.append(self._run_storage_job(entry[0], entry[2]))
        for op in of_type(so.ops, TransferOp):
            if op.kind in ("h2s", "s2h"):
                assert not op.sync and not op.device_pages and len(op.keys) == len(op.host_pages)
                hit = self._storage_hit(op)
                self.storage_jobs[op.job_id] = [op, self.storage.delay, hit]
                if op.kind == "s2h":  # the hit query answers before any page is read
                    progress.append(StorageProgress(op.job_id, hit, 0, False,
                                                    state_page=self._state_page(op)))
        # Cancels after submits: a job may be cancelled in the output that starts it. A
        # cancelled job stops at once and reports its final progress in this output.
        for job in [c.job_id for c in of_type(so.ops, StorageCancel)]:
            entry = self.storage_jobs.pop(job, None)
            if entry is not None:
                progress.append(self._run_storage_job(entry[0], entry[2], limit=0))
        return progress

    def _copy(self, op) -> None:
        P = self.page_size
        src, dst = (self.kv, self.host) if op.kind == "d2h" else (self.host, self.kv)
        src_pages, dst_pages = ((op.device_pages, op.host_pages) if op.kind == "d2h"
                                else (op.host_pages, op.device_pages))
        copy_pages(src, dst, src_pages, dst_pages, P)
        self.moved_pages[op.kind] += len(src_pages)

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        self.steps.append(so)
        finished = [op.job_id for op in self.async_ops]
        for op in self.async_ops:
            self._copy(op)
        self.async_ops = []
        storage_progress = self._storage_step(so) if self.storage is not None else []
        for op in of_type(so.ops, TransferOp):
            if op.kind in ("h2s", "s2h"):
                continue
            if op.sync:
                self._copy(op)
                finished.append(op.job_id)
            else:
                self.async_ops.append(op)
        for rid in so.freed_rids:
            del self.known[rid]
        for nr in so.new_requests:
            assert nr.rid not in self.known, f"{nr.rid} registered twice"
            self.known[nr.rid] = nr
        ids, toks = [], []
        for s in so.scheduled:
            assert s.rid in self.known, f"{s.rid} scheduled but unknown to the runner"
            assert s.row != 0, "row 0 is the padding sink"
            row = self.rows.setdefault(s.row, {})
            for i, slot in enumerate(s.slots):
                row[s.slot_write_start + i] = slot
            if s.num_draft and RUNNER_DRAFT in s.token_ids:
                s.token_ids = self._fill_runner_drafts(s, row)
            self.computed_tokens += len(s.token_ids)
            for j, t in enumerate(s.token_ids):
                slot = row[s.start_pos + j]
                assert slot >= self.page_size, "page 0 is the padding sink"
                self.kv[slot] = (s.start_pos + j, t)
        for s in so.scheduled:
            if not s.sample:
                continue
            row = self.rows[s.row]
            if s.draft_parents is not None:
                self._verify_tree(s, row, ids, toks)
                continue
            seq = []
            for p in range(s.start_pos + len(s.token_ids)):
                pos, tok = self.kv[row[p]]
                assert pos == p, f"{s.rid}: slot {row[p]} holds position {pos}, expected {p}"
                seq.append(tok)
            # A verify entry: the "model" predicts after every prefix that ends in the last
            # token or a draft; drafts are accepted while they equal its prediction.
            committed = len(seq) - s.num_draft
            for j in range(s.num_draft + 1):
                token = next_token(seq[:committed + j], self.vocab_size)
                ids.append(s.rid)
                toks.append(token)
                self.verified_drafts += j < s.num_draft and seq[committed + j] == token
                if j == s.num_draft or seq[committed + j] != token:
                    break
        n = len(ids)
        return RunnerOutput(ids, toks, [None] * n, [None] * n,
                            events=[TransferDone(job) for job in finished] + storage_progress)

    def _verify_tree(self, s, row: dict, ids: list, toks: list) -> None:
        """A tree verify entry: walk from the last token through the child holding the
        "model's" next token, then move the accepted nodes' KV to the committed positions
        (as the runner does, runner/spec/verify.py)."""
        seq = []
        for p in range(s.start_pos + 1):
            pos, tok = self.kv[row[p]]
            assert pos == p, f"{s.rid}: slot {row[p]} holds position {pos}, expected {p}"
            seq.append(tok)
        kids: dict[int, list[int]] = {}
        for j, parent in enumerate(s.draft_parents):
            kids.setdefault(parent, []).append(j + 1)
        node, path = 0, []
        while True:
            token = next_token(seq, self.vocab_size)
            ids.append(s.rid)
            toks.append(token)
            nxt = next((c for c in kids.get(node, ()) if s.token_ids[c] == token), None)
            if nxt is None:
                break
            self.verified_drafts += 1
            seq.append(token)
            path.append(nxt)
            node = nxt
        for j, n in enumerate(path, 1):
            self.kv[row[s.start_pos + j]] = (s.start_pos + j, s.token_ids[n])

    def _fill_runner_drafts(self, s, row: dict) -> list[int]:
        """A STANDALONE draft model stand-in: the entry's RUNNER_DRAFT tokens become the
        true continuation for a random number of them, then wrong tokens."""
        assert s.token_ids[1:] == [RUNNER_DRAFT] * s.num_draft, s.token_ids
        seq = [self.kv[row[p]][1] for p in range(s.start_pos)] + [s.token_ids[0]]
        truth = []
        for _ in range(s.num_draft):
            truth.append(next_token(seq + truth, self.vocab_size))
        good = self.draft_rng.randint(0, s.num_draft)
        return [s.token_ids[0]] + truth[:good] + [(t + 1) % self.vocab_size
                                                   for t in truth[good:]]

    def check_req_to_token(self, expected: dict[int, list[int]], swa_expected=None) -> None:
        for row, slots in expected.items():
            got = [self.rows.get(row, {}).get(i) for i in range(len(slots))]
            assert got == list(slots), f"row {row}: {got} != {slots}"
