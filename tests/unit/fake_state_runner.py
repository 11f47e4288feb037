"""The fake runner with a recurrent state pool: checks what ScheduledRequest's state fields
promise (protocol/scheduler_output.py).

Its "state" of a slot is the tuple of token ids the slot's recurrent layers have consumed, so
a state is valid at exactly one position, as a real one. Before the forward it applies
`state_reset` (empty) or `state_copy_from` (the source's tuple; copy-on-write: the source is
never written), then requires the working slot to hold exactly the request's tokens before
start_pos (read back through req_to_token, as the KV); the forward appends the entry's tokens;
after it, `state_snapshot_to` gets a copy. A wrong copy source, a missing reset, a snapshot
filed at the wrong node, a slot freed while in use and handed to another request, or a
snapshot changed after filing all fail here or at `check_state_slots` (every slot the
scheduler says holds a state, compared after every step under KVSTRATA_CHECK_INTEGRITY).
A speculative verify (a chain) leaves the state after its last token and accepted drafts
only, as the real runner's commit does. With HiCache, TransferOps carrying state slot pairs
copy states to / from a host state store (`host_states`) first, in op order, as the HiCache
executor does before the forward; `check_state_slots` compares the host slots too. With L3
(a FakeStorage), an "h2s" of states stores a host slot's tuple under its state key when the
job runs, and an "s2h" with state keys reads the furthest stored state among its hit pages
into its host slot when submitted, cutting the hit there (as StorageJobRunner): a state
stored under the wrong key, or restored onto the wrong node, fails the state checks."""
from __future__ import annotations

from kvstrata.protocol import RunnerOutput, SchedulerOutput, StorageProgress, TransferOp, of_type
from tests.unit.fake_runner import FakeRunner


class FakeStateRunner(FakeRunner):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.states: dict[int, tuple[int, ...]] = {}
        self.host_states: dict[int, tuple[int, ...]] = {}  # HiCache host state slots
        self.states_moved = {"d2h": 0, "h2d": 0}
        self.copies = self.resets = self.snapshots = 0
        self.resumed_tokens = 0  # positions a copied snapshot spared recomputing
        self.state_pages: dict[int, int] = {}  # s2h job -> the page its state was read at

    def _move_states(self, so: SchedulerOutput) -> None:
        for op in of_type(so.ops, TransferOp):
            if not op.state_slots:
                continue
            assert op.sync and not op.device_pages and len(op.state_slots) == len(
                op.host_state_slots), f"a state transfer op {op}"
            for dev, host in zip(op.state_slots, op.host_state_slots):
                if op.kind == "d2h":
                    assert dev in self.states, f"a write of the empty state slot {dev}"
                    self.host_states[host] = self.states[dev]
                else:
                    assert host in self.host_states, f"a load of the empty host slot {host}"
                    self.states[dev] = self.host_states[host]
            self.states_moved[op.kind] += len(op.state_slots)

    # ---- HiCache L3 of states ---------------------------------------------------------
    def _storage_hit(self, op) -> int:
        if not op.state_keys:
            return super()._storage_hit(op)
        if op.kind == "h2s":
            assert not op.keys and len(op.state_keys) == len(op.host_state_slots), op
            return len(op.state_keys)
        st, hit = self.storage, self.storage.exists(op.keys)
        for i in range(hit - 1, -1, -1):  # the furthest stored state, read at once
            if op.state_keys[i] not in st.pages:
                continue
            st.reads += 1
            if st.corrupt_every and st.reads % st.corrupt_every == 0:
                continue  # a corrupt record: the next furthest
            self.host_states[op.host_state_slots[0]] = st.pages[op.state_keys[i]]
            self.state_pages[op.job_id] = i + 1
            return i + 1
        return 0

    def _state_page(self, op) -> int:
        return self.state_pages.get(op.job_id, 0)

    def _run_storage_job(self, op, hit: int, limit: int | None = None) -> StorageProgress:
        if not (op.kind == "h2s" and op.state_keys):
            return super()._run_storage_job(op, hit, limit)
        st = self.storage
        st.jobs_run += 1
        if st.error_every and st.jobs_run % st.error_every == 0:
            return StorageProgress(op.job_id, hit, 0, True, "injected backend error")
        done = 0
        for key, slot in zip(op.state_keys, op.host_state_slots):
            if key in st.fail_set:
                break
            assert slot in self.host_states, f"a backup of the empty host state slot {slot}"
            st.pages.setdefault(key, self.host_states[slot])
            done += 1
        return StorageProgress(op.job_id, hit, done, True)

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        self._move_states(so)
        slots = [s.state_slot for s in so.scheduled]
        assert all(slots), f"an entry without a state slot: {so.scheduled}"
        assert len(set(slots)) == len(slots), f"two entries share a state slot: {slots}"
        sources = {s.state_copy_from for s in so.scheduled} - {0}
        targets = {s.state_snapshot_to for s in so.scheduled} - {0}
        assert not (sources | targets) & set(slots), "a working slot is also a copy's end"
        assert not sources & targets, "a snapshot is read and written in one step"
        for s in so.scheduled:  # before the forward
            if s.state_reset:
                assert not s.state_copy_from, f"{s.rid}: reset and copy at once"
                self.states[s.state_slot] = ()
                self.resets += 1
            elif s.state_copy_from:
                assert s.state_copy_from in self.states, f"{s.rid}: copy of an empty slot"
                self.states[s.state_slot] = self.states[s.state_copy_from]
                self.copies += 1
                self.resumed_tokens += s.start_pos
        out = super().execute(so)  # writes the KV, fills the rows, samples
        produced: dict[str, int] = {}
        for rid in out.rids:
            produced[rid] = produced.get(rid, 0) + 1
        for s in so.scheduled:
            row = self.rows[s.row]
            before = tuple(self.kv[row[p]][1] for p in range(s.start_pos))
            held = self.states.get(s.state_slot)
            assert held == before, (
                f"{s.rid}: state slot {s.state_slot} holds the state after {_n(held)} "
                f"tokens {_tail(held)}, the forward starts at {s.start_pos} after "
                f"{before[-4:]}")
            assert s.draft_parents is None, f"{s.rid}: a draft tree over recurrent state"
            # a verify commits the state after the last token and its accepted drafts only
            ran = s.token_ids[:produced[s.rid]] if s.num_draft else s.token_ids
            self.states[s.state_slot] = before + tuple(ran)
        for s in so.scheduled:  # after the forward (or inside it: state_snapshot_at)
            if s.state_snapshot_to:
                at = s.state_snapshot_at or s.start_pos + len(s.token_ids)
                assert s.start_pos < at <= s.start_pos + len(s.token_ids) and not (
                    s.state_snapshot_at and s.num_draft), f"{s.rid}: snapshot at {at}"
                self.states[s.state_snapshot_to] = self.states[s.state_slot][:at]
                self.snapshots += 1
        return out

    def check_state_slots(self, expected: dict) -> None:
        """`expected`: device slot (or ("host", host slot)) -> tokens it holds the state of."""
        for slot, tokens in expected.items():
            held = (self.host_states.get(slot[1]) if isinstance(slot, tuple)
                    else self.states.get(slot))
            assert held == tokens, (
                f"state slot {slot} holds the state after {_n(held)} tokens, the scheduler "
                f"says {len(tokens)} ({tokens[-4:]} vs {_tail(held)})")


def _n(state):
    return None if state is None else len(state)


def _tail(state):
    return None if state is None else state[-4:]
