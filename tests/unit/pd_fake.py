"""A torch-free PD pair for tests: two FakeRunners (prefill, decode) and an in-memory transfer
layer between them that applies the scheduler's PDOps, moves the fake KV contents page by
page from the prefill pool to the decode pool, and reports PDEvents.

Decode retraction's BackupOps are applied first in a step by a fake backup store
(pd_fake_backup.py).

The copy happens when the transfer *completes* (after an optional delay), reading the prefill
pool then: a prefill scheduler that frees or reuses a page before SUCCESS, or a decode one
that hands out a page still being written, shows up as wrong tokens (the fake model derives
each token from the KV it reads back). The layer also asserts the op order of
protocol/disagg.py on each side. Failures, delays and a wrong room in the metadata can be
injected per room, and so can the deaths of peers as the real transfer layer reports them
(transfer/disagg/liveness.py): a bootstrap address that refuses ("refused": the decode side
fails after a few ticks, as KVSTRATA_DISAGG_UNREACHABLE_TIMEOUT), a peer that never answers
("never": nobody leaves BOOTSTRAPPING until the bootstrap timeout), and a peer that dies at
some tick of the room's life ("dies": both halves fail, as missed heartbeats do, before or
after the decode reserved its pages).

Pages moved (PDEvent.pages, the servers' disagg_kv_bytes_*_total) as the real backends
count them (transfer/disagg/messages.py): a send's pages past the decode's held prefix
cross when they land in a live decode room (a non-last send at once, the last one at its
done tick); pages landing in a room the decode already ended are not counted; each half's
terminal event reports the link's count at the time it is reported, so a half that ended
before the count was final would disagree with its peer (PDPair.check_drained compares the
two servers' totals). A prefill abort after the last send: the pages still land, the decode
room succeeds, the prefill's fails (as tcp and mooncake do: the Abort follows the pages).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.engine.engine_core import EngineCore
from kvstrata.engine.request import EngineRequest
from kvstrata.engine.scheduler.core import SchedulerConfig
from kvstrata.protocol import SamplingParams
from kvstrata.protocol import of_type
from kvstrata.protocol.disagg import BackupOp, BootstrapAddr, KVPoll, PDEvent, PDOp
from tests.unit.fake_runner import FakeRunner, copy_pages
from tests.unit.pd_fake_backup import FakeBackupStore
from kvstrata.engine.sides.registry import pd_side

TERMINAL = (KVPoll.FAILED, KVPoll.SUCCESS)
PEER_TIMEOUT_TICKS = 400  # a side whose peer never shows up fails (as real backends do)
REFUSED_TICKS = 3  # a refused bootstrap address fails the decode side this soon
PAGE_BYTES = 1000  # bytes per token of a page, for the byte counters


@dataclass
class Half:
    state: int = KVPoll.BOOTSTRAPPING
    error: str | None = None
    reported: int | None = None  # last state reported to the scheduler
    released: bool = False
    created_tick: int = 0


@dataclass
class Link:
    room: int
    sender: Half | None = None
    receiver: Half | None = None
    dst_pages: list[int] | None = None
    prefix_pages: int = 0  # the prompt's first pages the decode holds (its radix cache)
    prefix_swa_pages: int = 0  # ... and the first SWA pages of the last send (hybrid SWA)
    swa_crossed: int = 0  # of `crossed`, SWA pages
    num_pages: int | None = None
    src_pages: list[int] | None = None
    metadata: object = None
    ready_tick: int = 0  # receiver turns WAITING_FOR_INPUT at this tick
    done_tick: int | None = None  # the send completes at this tick
    fail: str | None = None  # None | "bootstrap" | "transfer" | "refused" | "never" | "dies"
    dies_at: int | None = None  # "dies": the tick both peers stop hearing each other
    corrupt: bool = False
    aborted: str | None = None  # side that aborted while the pages were on their way
    sends: int = 0
    crossed: int = 0  # pages written into the decode's reserved pages while it was live
    last_from: int = 0  # prompt page index of the last send's first page
    log: list[str] = field(default_factory=list)


class FakeTransferHub:
    def __init__(self, page_size: int, delay: int = 0):
        self.page_size = page_size
        self.delay = delay  # ticks for bootstrap and for the transfer
        self.links: dict[int, Link] = {}
        self.tick = 0
        self.runners: dict[str, FakeRunner] = {}
        self.inject: dict[int, dict] = {}  # room -> {"fail": ..., "corrupt": ..., "delay": ...}
        self.moved_pages = 0
        self.peer_timeout = PEER_TIMEOUT_TICKS

    def _link(self, room: int) -> Link:
        if room not in self.links:
            opts = self.inject.get(room, {})
            self.links[room] = Link(room, fail=opts.get("fail"), corrupt=opts.get("corrupt", False),
                                    dies_at=self.tick + opts.get("dies_after", 0))
        return self.links[room]

    def _delay(self, room: int) -> int:
        return self.inject.get(room, {}).get("delay", self.delay)

    # ------------------------------------------------------------------ ops
    def apply(self, side: str, op: PDOp) -> None:
        link = self._link(op.room)
        link.log.append(f"{side}:{op.kind}")
        half = link.sender if side == "prefill" else link.receiver
        if op.kind in ("sender_create", "receiver_create"):
            assert (side == "prefill") == (op.kind == "sender_create"), op
            assert half is None or half.released, f"room {op.room} created twice: {link.log}"
            half = Half(created_tick=self.tick)
            if side == "prefill":
                link.sender = half
            else:
                link.receiver = half
                link.ready_tick = self.tick + self._delay(op.room)
            return
        assert half is not None and not half.released, f"{op.kind} on unknown room: {link.log}"
        if op.kind == "abort":
            if link.done_tick is not None and half.state == KVPoll.TRANSFERRING:
                # The pages were already sent: they still land (as posted RDMA writes do);
                # the room reports FAILED only once they have.
                link.aborted = side
            elif half.state not in TERMINAL:
                half.state, half.error = KVPoll.FAILED, "aborted"
                peer = link.receiver if side == "prefill" else link.sender
                if peer is not None and peer.state not in TERMINAL:
                    peer.state, peer.error = KVPoll.FAILED, f"the {side} server aborted"
        elif op.kind == "release":
            assert half.reported in TERMINAL, f"release before the end was reported: {link.log}"
            half.released = True
        elif op.kind == "receiver_init":
            assert side == "decode" and half.reported == KVPoll.WAITING_FOR_INPUT, link.log
            assert op.metadata_index >= 0 and 0 not in op.page_ids, op
            assert op.page_ids or op.prefix_pages, op
            link.dst_pages = list(op.page_ids)
            link.prefix_pages = op.prefix_pages
            link.prefix_swa_pages = op.prefix_swa_pages
            half.state = KVPoll.TRANSFERRING
        elif op.kind == "sender_init":
            assert side == "prefill" and half.reported == KVPoll.WAITING_FOR_INPUT, link.log
            assert op.num_pages == link.prefix_pages + link.prefix_swa_pages + \
                len(link.dst_pages), (op, link)
            assert op.metadata_index >= 0
            link.num_pages = op.num_pages
        elif op.kind == "send":
            # Earlier chunks' pages (last=False), then the rest with the metadata (last=True).
            # The bytes are read when the transfer completes, so every page sent must keep
            # its KV until the room's end.
            assert side == "prefill" and link.num_pages is not None, link.log
            assert link.done_tick is None, f"send after the last send: {link.log}"
            assert op.page_ids and 0 not in op.page_ids, op
            before = len(link.src_pages or [])
            sent = (link.src_pages or []) + list(op.page_ids)
            assert len(sent) <= link.num_pages and len(set(sent)) == len(sent), (op, link)
            link.src_pages = sent
            link.sends += 1
            if not op.last and half.state not in TERMINAL and self._decode_live(link):
                link.crossed += self._past_prefix(link, before, len(sent))
            if op.last:
                link.last_from = before
                assert op.metadata is not None and len(sent) == link.num_pages, (op, link)
                if half.state not in TERMINAL:
                    link.metadata = op.metadata
                    half.state = KVPoll.TRANSFERRING
                    link.done_tick = self.tick + self._delay(op.room)
            else:
                assert op.metadata is None, op
        else:
            raise AssertionError(f"unknown op {op}")

    # ------------------------------------------------------------------ progress
    @staticmethod
    def _decode_live(link: Link) -> bool:
        return link.receiver is not None and link.receiver.state == KVPoll.TRANSFERRING

    @staticmethod
    def _past_prefix(link: Link, start: int, end: int) -> int:
        """Prompt pages start..end that cross (the decode's held prefix does not)."""
        return max(0, end - max(start, link.prefix_pages))

    def _land_last(self, link: Link) -> None:
        link.swa_crossed = self._copy(self._wanted(link), link.dst_pages)
        # the held SWA pages are in the last send (hybrid SWA memory)
        link.crossed += self._past_prefix(link, link.last_from, len(link.src_pages)) \
            - link.prefix_swa_pages

    def _wanted(self, link: Link) -> list[int]:
        """The source pages the decode reserved destinations for: past its held prefix."""
        return link.src_pages[link.prefix_pages:]

    def _fail(self, link: Link, error: str) -> None:
        for half in (link.sender, link.receiver):
            if half is not None and half.state not in TERMINAL:
                half.state, half.error = KVPoll.FAILED, error

    def _advance(self, link: Link) -> None:
        s, r = link.sender, link.receiver
        # A failed side fails its peer (abort message / heartbeat / waiting timeout).
        for a_, b_ in ((s, r), (r, s)):
            if a_ is not None and b_ is not None and a_.state == KVPoll.FAILED \
                    and b_.state not in TERMINAL:
                b_.state, b_.error = KVPoll.FAILED, f"peer failed: {a_.error}"
        if link.fail == "bootstrap" and r is not None:
            self._fail(link, "injected bootstrap failure")
        self._peer_death(link)
        if r is not None and r.state == KVPoll.BOOTSTRAPPING and self.tick >= link.ready_tick \
                and link.fail not in ("refused", "never"):
            r.state = KVPoll.WAITING_FOR_INPUT
        if s is not None and s.state == KVPoll.BOOTSTRAPPING and link.dst_pages is not None:
            s.state = KVPoll.WAITING_FOR_INPUT
        # A side whose peer never shows up (the other server rejected the request) times out,
        # as real backends do. (Only then: a peer that exists but is slow never times out
        # here, so a scheduler that starves a request fails the test instead.)
        for half, peer in ((s, r), (r, s)):
            if half is not None and peer is None and half.state not in TERMINAL \
                    and self.tick - half.created_tick > self.peer_timeout:
                half.state, half.error = KVPoll.FAILED, "timeout: the peer server never came"
        due = link.done_tick is not None and self.tick >= link.done_tick
        if due and s.state == KVPoll.TRANSFERRING:
            if link.aborted == "prefill" and self._decode_live(link):
                # The pages (and metadata) left before the Abort: the decode room succeeds;
                # the prefill's fails once the decode's count is back.
                self._land_last(link)
                r.state = KVPoll.SUCCESS
                s.state, s.error = KVPoll.FAILED, "aborted"
                return
            if link.aborted is not None:  # the decode ended first: the pages land unseen
                self._copy(self._wanted(link), link.dst_pages)
                self._fail(link, f"the {link.aborted} server aborted")
                return
            if link.fail == "transfer":
                self._fail(link, "injected transfer failure")
                return
            assert r is not None and r.state == KVPoll.TRANSFERRING, link.log
            self._land_last(link)
            s.state = r.state = KVPoll.SUCCESS

    def _peer_death(self, link: Link) -> None:
        """The injected peer deaths, with the reasons the real layer gives."""
        s, r = link.sender, link.receiver
        if link.fail == "refused" and r is not None and r.state not in TERMINAL \
                and self.tick - r.created_tick >= REFUSED_TICKS:
            r.state, r.error = KVPoll.FAILED, (
                f"prefill at bootstrap 127.0.0.1:1 unusable: Could not fetch prefill parallel "
                f"info from bootstrap_addr 127.0.0.1:1 after {REFUSED_TICKS} attempts")
        elif link.fail == "never" and r is not None and r.state == KVPoll.BOOTSTRAPPING \
                and self.tick - r.created_tick > self.peer_timeout:
            r.state, r.error = KVPoll.FAILED, "prefill unusable: not ready (bootstrap timeout)"
        elif link.fail == "dies" and self.tick >= link.dies_at:
            for half, why in ((s, "decode server silent (dead?)"),
                              (r, "prefill server did not answer 2 heartbeats")):
                if half is not None and half.state not in TERMINAL:
                    half.state, half.error = KVPoll.FAILED, why

    def _copy(self, src_pages: list[int], dst_pages: list[int]) -> int:
        """What the real backends do (the pages the decode holds already are not sent: the
        caller passes `_wanted`); returns how many were SWA pages (none here)."""
        assert len(src_pages) == len(dst_pages), (src_pages, dst_pages)
        copy_pages(self.runners["prefill"].kv, self.runners["decode"].kv, src_pages, dst_pages,
                   self.page_size)
        self.moved_pages += len(src_pages)
        return 0

    def poll(self, side: str) -> list[PDEvent]:
        self.tick += 1
        events = []
        for room, link in list(self.links.items()):
            self._advance(link)
            half = link.sender if side == "prefill" else link.receiver
            if half is None or half.released or half.state == half.reported:
                continue
            half.reported = half.state
            md = None
            if side == "decode" and half.state == KVPoll.SUCCESS:
                md = link.metadata
                if link.corrupt:
                    md = type(md)(**{**{f: getattr(md, f) for f in md.__struct_fields__},
                                     "room": room + 1})
            events.append(PDEvent(room=room, state=int(half.state),
                                  error=half.error if half.state == KVPoll.FAILED else None,
                                  metadata=md,
                                  pages=link.crossed if half.state in TERMINAL else 0,
                                  swa_pages=link.swa_crossed if half.state in TERMINAL
                                  else 0))
        return events

    def check_drained(self) -> None:
        for link in self.links.values():
            for half in (link.sender, link.receiver):
                assert half is None or half.released, f"room {link.room} never released: {link.log}"

    @property
    def crossed_pages(self) -> int:
        return sum(link.crossed for link in self.links.values())


class PDFakeRunner(FakeRunner):
    def __init__(self, hub: FakeTransferHub, side: str, **kw):
        super().__init__(page_size=hub.page_size, **kw)
        self.hub, self.side = hub, side
        self.backups = FakeBackupStore(self)
        hub.runners[side] = self

    def execute(self, so):
        for op in of_type(so.ops, BackupOp):  # first of all (protocol/disagg.py BackupOp)
            self.backups.apply(op)
        for op in of_type(so.ops, PDOp):  # before the forward, in order
            self.hub.apply(self.side, op)
        out = super().execute(so)
        out.events += self.hub.poll(self.side)
        return out


def kv_bytes(engine, key: str) -> int:
    return pd_side(engine.scheduler).load()[key]


class PDPair:
    """A prefill EngineCore and a decode EngineCore joined by a FakeTransferHub."""

    def __init__(self, page_size=1, prefill_pages=256, decode_pages=256, vocab=1000, delay=0,
                 prefill_cfg=None, decode_cfg=None, eos_token_ids=(), hub_cls=None,
                 runner_cls=None, runner_kw=None):
        # hub_cls / runner_cls / runner_kw: variants (pd_fake_swa.py: hybrid SWA memory)
        self.hub = (hub_cls or FakeTransferHub)(page_size, delay)
        self.vocab = vocab
        runner_cls = runner_cls or PDFakeRunner
        self.prefill_runner = runner_cls(self.hub, "prefill", vocab_size=vocab,
                                         eos_token_ids=eos_token_ids, **(runner_kw or {}))
        self.decode_runner = runner_cls(self.hub, "decode", vocab_size=vocab,
                                        eos_token_ids=eos_token_ids, **(runner_kw or {}))
        self.prefill = EngineCore(self.prefill_runner, SchedulerConfig(
            num_pages=prefill_pages, page_size=page_size, disaggregation_mode="prefill",
            **(prefill_cfg or {})))
        decode_cfg = {"num_reserved_decode_tokens": 8, **(decode_cfg or {})}
        self.decode = EngineCore(self.decode_runner, SchedulerConfig(
            num_pages=decode_pages, page_size=page_size, disaggregation_mode="decode",
            **decode_cfg))
        for engine in (self.prefill, self.decode):  # a pages-only plan has no bytes
            side = pd_side(engine.scheduler)
            side.page_bytes_moved = side.page_bytes_moved or PAGE_BYTES * page_size
        tree = self.decode.scheduler.kv.tree
        self.decode_runner.backups.cached_pages = lambda: {
            p for node in tree.nodes() for p in (node.device_pages or [])}
        self.outputs: dict[str, dict[str, list[int]]] = {"prefill": {}, "decode": {}}
        self.finished: dict[str, dict[str, object]] = {"prefill": {}, "decode": {}}
        self.results: dict[str, dict[str, list]] = {"prefill": {}, "decode": {}}
        self.steps = 0
        self._rooms = 0
        self.rooms: dict[str, int] = {}

    def submit(self, rid, prompt, max_new, room=None, to=("prefill", "decode"), priority=None,
               cache_salt=None, **params):
        if room is None:
            self._rooms += 1
            room = 1000 + self._rooms
        params.setdefault("temperature", 0)
        self.rooms[rid] = room
        addr = BootstrapAddr("127.0.0.1", 8998, room)
        for side in to:
            self.outputs[side][rid] = []
            self.results[side][rid] = []
            getattr(self, side).add_request(EngineRequest(
                rid, list(prompt), SamplingParams(max_new_tokens=max_new, **params),
                bootstrap=addr, priority=priority, cache_salt=cache_salt))
        return room

    def abort(self, rid, side):
        getattr(self, side).abort_request(rid)

    def step(self):
        self.steps += 1
        for side in ("prefill", "decode"):
            for out in getattr(self, side).step():
                self.outputs[side][out.rid] += out.new_token_ids
                self.results[side][out.rid].append(out)
                if out.finished:
                    assert out.rid not in self.finished[side], f"{side} {out.rid} finished twice"
                    self.finished[side][out.rid] = out.finish_reason

    def busy(self) -> bool:
        return self.prefill.has_unfinished_requests() or self.decode.has_unfinished_requests()

    def run(self, max_steps=5000):
        for _ in range(max_steps):
            if not self.busy():
                break
            self.step()
        else:
            raise AssertionError("PD pair not drained:\n" + self.prefill.dump_state() + "\n"
                                 + self.decode.dump_state())
        self.check_drained()

    def check_drained(self):
        self.hub.check_drained()
        self.check_byte_counters()
        for engine in (self.prefill, self.decode):
            engine.check_integrity()
            sched = engine.scheduler
            kv = sched.kv
            assert kv.tree.protected_pages() == 0, "a lock survived the drain"
            assert kv.allocator.available_pages() + kv.tree.cached_pages() == kv.allocator.num_pages
            assert len(sched.free_rows) == sched.num_rows and not sched.live_requests()
            assert not pd_side(sched).rooms and len(pd_side(sched).free_slots) == pd_side(sched).num_slots
        retraction = pd_side(self.decode.scheduler).retraction
        assert not retraction.retracted and not retraction.backups and not retraction.ops
        store = self.decode_runner.backups
        assert not store.cpu and not store.host_held, "a backup outlived its request"
        kv = self.decode.scheduler.kv
        if kv.backup_pool:
            assert not kv.backup_pages(), "host pages of ended backups still counted"
            if not kv.hicache:  # a shared HiCache pool keeps the tree's host pages
                alloc = kv.host_allocator
                assert alloc.available_pages() == alloc.num_pages, "host pages leaked"

    def check_byte_counters(self):
        """Both servers counted the same bytes: the pages that crossed (the hub's count)."""
        sent = kv_bytes(self.prefill, "disagg_kv_bytes_sent_total")
        received = kv_bytes(self.decode, "disagg_kv_bytes_received_total")
        page = pd_side(self.decode.scheduler).page_bytes_moved
        assert sent == received == self.hub.crossed_pages * page, (
            sent, received, self.hub.crossed_pages,
            {r: (link.crossed, link.log) for r, link in self.hub.links.items()})
