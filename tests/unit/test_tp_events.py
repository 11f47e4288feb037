"""EventMerger (runner/parallel/tp_events.py): under tensor parallelism a device<->host job
ends for the scheduler once it ended on every rank, and a storage job's progress is the
minimum over ranks. Randomised: each rank reports the same jobs at its own pace."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from kvstrata.protocol.scheduler_output import StorageProgress, TransferDone
from kvstrata.runner.parallel.tp_events import EventMerger


@st.composite
def schedules(draw):
    """(size, per-step per-rank events): every rank reports every job once (TransferDone)
    or as a non-decreasing progress run ending finished (StorageProgress)."""
    size = draw(st.integers(2, 4))
    jobs = draw(st.integers(1, 5))
    kinds = [draw(st.sampled_from(["done", "storage"])) for _ in range(jobs)]
    per_rank: list[list[tuple[int, object]]] = []  # (step, event)
    for rank in range(size):
        timeline = []
        for job, kind in enumerate(kinds):
            if kind == "done":
                timeline.append((draw(st.integers(0, 6)),
                                 TransferDone(job, ok=draw(st.booleans()) or rank != 1)))
                continue
            total = draw(st.integers(1, 5))
            steps = sorted(draw(st.lists(st.integers(0, 6), min_size=1, max_size=3)))
            done = sorted(draw(st.integers(0, total)) for _ in steps)
            done[-1] = draw(st.integers(0, total))
            done = sorted(done)
            hits = draw(st.integers(0, total))
            for i, (step, d) in enumerate(zip(steps, done)):
                last = i == len(steps) - 1
                timeline.append((step, StorageProgress(job, hits, min(d, hits), last)))
        per_rank.append(timeline)
    return size, kinds, per_rank


@settings(max_examples=300, deadline=None)
@given(schedules())
def test_merged_events(case):
    size, kinds, per_rank = case
    merger = EventMerger(size)
    seen_done: dict[int, bool] = {}
    last_progress: dict[int, StorageProgress] = {}
    finished: set[int] = set()
    for step in range(7):
        events = [[e for s, e in timeline if s == step] for timeline in per_rank]
        reported_by_all = {job for job in range(len(kinds))
                           if all(any(s <= step and e.job_id == job for s, e in tl)
                                  for tl in per_rank)}
        for e in merger.merge(events):
            if isinstance(e, TransferDone):
                assert e.job_id not in seen_done, "a job ends once"
                assert e.job_id in reported_by_all, "only after every rank reported it"
                oks = [ev.ok for tl in per_rank for s, ev in tl if ev.job_id == e.job_id]
                assert e.ok == all(oks)
                seen_done[e.job_id] = e.ok
            else:
                assert e.job_id not in finished, "nothing after the finished one"
                prev = last_progress.get(e.job_id)
                if prev is not None:
                    assert e.done_pages >= prev.done_pages
                # never ahead of any rank: each rank's newest state so far bounds it
                for tl in per_rank:
                    mine = [ev for s, ev in tl if s <= step and ev.job_id == e.job_id]
                    assert mine and e.done_pages <= mine[-1].done_pages
                    assert e.hit_pages <= mine[-1].hit_pages
                last_progress[e.job_id] = e
                if e.finished:
                    finished.add(e.job_id)
    for job, kind in enumerate(kinds):
        if kind == "done":
            assert job in seen_done
        else:
            assert job in finished, "every storage job finishes once all ranks finished"
    assert merger.pending() == 0


def test_a_storage_prefetch_keeps_the_swa_halves_every_rank_read():
    """Hybrid SWA memory (cache/swa_storage.py): a page's SWA half counts as read only once
    every rank read it, and only below the pages every rank read in full."""
    merger = EventMerger(2)
    out = merger.merge([[StorageProgress(3, 8, 6, False, swa_read=[2, 3, 4, 5])],
                        [StorageProgress(3, 8, 4, False, swa_read=[2, 3])]])
    assert [(e.done_pages, e.swa_read) for e in out] == [(4, [2, 3])]
    out = merger.merge([[StorageProgress(3, 8, 8, True, swa_read=[2, 3, 4, 5, 6, 7])],
                        [StorageProgress(3, 8, 8, True, swa_read=[2, 3, 6, 7])]])
    assert [(e.done_pages, e.finished, e.swa_read) for e in out] == [(8, True, [2, 3, 6, 7])]


def test_a_storage_prefetch_resumes_a_state_only_where_every_rank_read_it():
    """A recurrent model (cache/state_storage.py): each rank reads its heads' share of the
    state record; the merged state_page is theirs when they agree, else 0 (no state read:
    the prefix is not resumed there)."""
    merger = EventMerger(2)
    out = merger.merge([[StorageProgress(5, 6, 6, True, state_page=6)],
                        [StorageProgress(5, 6, 6, True, state_page=6)]])
    assert [(e.hit_pages, e.state_page) for e in out] == [(6, 6)]
    out = merger.merge([[StorageProgress(7, 6, 6, True, state_page=6)],
                        [StorageProgress(7, 4, 4, True, state_page=4)]])
    assert [(e.hit_pages, e.state_page) for e in out] == [(4, 0)]


@st.composite
def room_runs(draw):
    """Per rank, a room's state changes as its executor reports them: forward through
    BOOTSTRAPPING .. SUCCESS, or cut short by FAILED, each at some step."""
    size = draw(st.integers(2, 4))
    runs = []
    for _ in range(size):
        states = draw(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=4,
                               unique=True))
        states.sort()
        if draw(st.booleans()) and states[-1] != 4:
            states.append(0)  # FAILED
        steps = sorted(draw(st.lists(st.integers(0, 6), min_size=len(states),
                                     max_size=len(states))))
        runs.append(list(zip(steps, states)))
    return size, runs


@settings(max_examples=300, deadline=None)
@given(room_runs())
def test_pd_room_state_is_the_minimum_over_ranks(case):
    from kvstrata.protocol.disagg import PDEvent

    size, runs = case
    merger = EventMerger(size)
    emitted = []
    latest: dict[int, int] = {}
    for step in range(7):
        events = []
        for rank, run in enumerate(runs):
            mine = [PDEvent(7, s, error="boom" if s == 0 else None, pages=rank)
                    for t, s in run if t == step]
            for e in mine:
                latest[rank] = e.state
            events.append(mine)
        for e in merger.merge(events):
            assert len(latest) == size, "nothing before every rank reported"
            assert e.state == min(latest.values())
            if e.state == 4:
                assert e.pages == 0  # rank 0's event
            emitted.append(e.state)
    assert all(a < b for a, b in zip(emitted, emitted[1:]) if b != 0), emitted
    finals = [s for s in emitted if s in (0, 4)]
    assert len(finals) <= 1
    last = [run[-1][1] for run in runs]
    if 0 in last or all(s == 4 for s in last):
        assert finals == [min(last)]
    merger.release([7])
    assert merger.pending() == 0


def test_the_lost_rank_exit_status_is_named_by_the_api_process():
    """The runner may not import the frontend: both modules spell the status, and the API
    process's message for it names the lost rank."""
    from kvstrata.frontend.process_utils import TP_RANK_LOST_EXIT_CODE, describe_exit
    from kvstrata.runner.parallel import tp_runner

    assert tp_runner.TP_RANK_LOST_EXIT_CODE == TP_RANK_LOST_EXIT_CODE
    assert "lost a tensor-parallel rank" in describe_exit(TP_RANK_LOST_EXIT_CODE)


def test_a_failed_room_carries_rank_0s_page_count_once_rank_0_ended():
    """PD byte counters: a room's FAILED event carries rank 0's pages moved (the count its
    server reports) when rank 0's room has ended; 0 while rank 0's is still live."""
    from kvstrata.protocol.disagg import KVPoll, PDEvent

    m = EventMerger(2)
    live, failed = KVPoll.TRANSFERRING, KVPoll.FAILED
    assert m.merge([[PDEvent(1, failed, error="x", pages=3), PDEvent(2, live)],
                    [PDEvent(1, failed, error="y", pages=5), PDEvent(2, failed, error="z",
                                                                     pages=4)]]) == [
        PDEvent(1, failed, error="x", pages=3), PDEvent(2, failed, error="z")]
