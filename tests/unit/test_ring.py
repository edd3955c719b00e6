"""The ring file and the relay's reading of it, in one process: the rank's RingWriter and
the relay's Channel on a real ring file (no relay process, a fake link that keeps what it
was sent)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from commcheck.rank.ring import RingWriter
from commcheck.rank.session import _Ready
from commcheck.relay.channel import Channel
from commcheck.relay.link import dump_path
from commcheck.wire import (
    GOODBYE,
    HELLO,
    RECORDS,
    Chunk,
    Envelope,
    RankStatus,
    WireError,
    decode,
    encode,
    read_frames,
)
from commcheck.wire.relay_settings import RelaySettings
from commcheck.wire.ring import (
    ENTRY,
    HEADER_BYTES,
    MIN_CAPACITY,
    R_ACKED_OFF,
    R_REJECTED,
    R_RELEASED_OFF,
    W_DROPPED,
    W_SIGNAL,
    Identity,
    Ring,
    RingError,
    decode_record,
    decode_rows,
    destination,
    encode_record,
)
from commcheck.wire.salvage import leftover_messages

from ..records import rec


class FakeLink:
    """Keeps what the relay sends; acks only when told."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, payload: bytes) -> bool:
        self.sent.append(payload)
        return True

    def envelopes(self) -> list[Envelope]:
        return [decode(p).env for p in self.sent]


def writer(tmp_path, capacity: int = MIN_CAPACITY, run: str = "ring") -> RingWriter:
    ident = Identity(run=run, rank=0, host="h", world=1, node=-1, pid=os.getpid(),
                     dest=destination("", str(tmp_path / "dump")))
    w = RingWriter.create(str(tmp_path / "rings"), ident, capacity)  # no relay launch
    w.start()
    return w


def put(w: RingWriter, start: int, n: int, callsite: str = "t.py:1 f") -> None:
    for i in range(start, start + n):
        w.submit(_Ready(rec(seq=i, ranks=(0,), callsite=callsite)))


def seqs(envs: list[Envelope]) -> list[int]:
    out = []
    for env in envs:
        if env.kind == RECORDS:
            out += [int(s) for s in decode(encode(env)).records["seq"]]
    return out


def channel(w: RingWriter, link=None, **kw) -> Channel:
    settings = RelaySettings(batch_records=kw.pop("batch_records", 20), flush_interval=0.0, **kw)
    return Channel(Ring.open(w.path), settings, link)


def drain(ch: Channel, rounds: int = 50) -> None:
    for _ in range(rounds):
        ch.poll(time.monotonic())
        ch.pump(time.monotonic())


def close(w: RingWriter, ch: Channel, linger: float = 5.0) -> bool:
    """The rank's close (goodbye, wait for acks) with the relay's channel serving it."""
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            drain(ch, 1)
            time.sleep(0.001)

    t = threading.Thread(target=serve)
    t.start()
    try:
        return w.close(linger)
    finally:
        done.set()
        t.join()


def test_record_entries_round_trip_every_field():
    r = rec(seq=7, ranks=(0, 3), op="all_gather", in_shape=(4, 2), out_shape=(8, 2),
            in_splits=(1, 3), out_splits=(2, 2), redop="SUM", root=3, peer=1, step=9,
            chunks=[Chunk(1, 3, 11, 12, 0.5), Chunk(1, 0, 13, 14, -1.0)], t_done=1.5)
    assert decode_record(encode_record(r)) == r
    with pytest.raises(RingError):
        decode_record(b"\x93\x01\x02\x03")


def test_the_relay_builds_the_same_batch_from_ring_rows_as_from_records():
    from commcheck.wire import BatchBuilder
    from commcheck.wire.ring import decode_row

    recs = [rec(seq=1, ranks=(0, 3)),
            rec(seq=2, ranks=(0, 1, 2, 3), op="all_to_all_single", in_splits=(1, 2, 3, 4),
                out_splits=(4, 3, 2, 1), in_shape=(10,), out_shape=(10,),
                chunks=[Chunk(0, r, r, r + 1, r / 2) for r in range(4)]),
            rec(seq=3, ranks=(0, 3), callsite="other.py:3 g", phase=1)]
    b = BatchBuilder("r", 0, "h", 4, 1)
    rows = [decode_row(encode_record(r)) for r in recs]
    assert encode(b.build_rows(rows, 5, 1.0, {"x": 1})) == \
        encode(b.build(recs, 5, 1.0, {"x": 1}))
    # the relay's one decode of a whole batch, typed as a record: the same rows
    payloads = [encode_record(r) for r in recs]
    typed = decode_rows(payloads)
    assert all(isinstance(row, tuple) for row in typed)  # typed, not one by one
    assert [list(map(_plain, row)) for row in typed] == [list(map(_plain, row)) for row in rows]
    assert encode(b.build_rows(typed, 5, 1.0)) == encode(b.build(recs, 5, 1.0))
    extra: dict[str, int] = {}  # one payload that is no record: the others, it counted
    assert [row[2] for row in decode_rows([payloads[0], b"\x93\x01\x02\x03", payloads[2]],
                                          extra)] == [1, 3] and extra == {"rejected": 1}


def _plain(value):
    """Tuples as lists, nested: the typed decode gives tuples where msgpack's plain one
    gives lists."""
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def test_wraparound_delivers_every_record_in_order(tmp_path):
    w = writer(tmp_path)
    ch = channel(w, dump_dir=str(tmp_path / "dump"))
    total = 0
    for _ in range(12):  # ~6 times round a 64 KiB ring, read as it goes
        put(w, total, 100, callsite="x" * 150)
        total += 100
        drain(ch, 3)
    assert w._write > 5 * w.ring.capacity
    assert close(w, ch)
    ch.close(remove=False)
    with open(dump_path(str(tmp_path / "dump"), "ring", 0), "rb") as f:
        envs = [decode(p).env for p in read_frames(f)]
    assert envs[0].kind == HELLO and envs[-1].kind == GOODBYE
    assert seqs(envs) == list(range(total))
    assert [e.seq for e in envs] == list(range(len(envs)))  # no gap in the names
    assert envs[-1].counters["dropped"] == 0 and envs[-1].counters["records"] == total


def test_full_ring_drops_and_counts_and_frees_space_only_when_acked(tmp_path):
    w = writer(tmp_path)
    put(w, 0, 2000)  # nobody reads: the 64 KiB ring fills up
    dropped = int(w.ring.word(W_DROPPED))
    written = w._records
    assert dropped > 0 and written + dropped == 2000
    link = FakeLink()
    ch = channel(w, link, buffer_bytes=1 << 20)
    drain(ch)
    put(w, 2000, 10)  # sent, not acknowledged: still no room
    assert int(w.ring.word(W_DROPPED)) == dropped + 10
    ch.acked([(os.getpid(), e.seq) for e in link.envelopes()])
    assert ch.ring.word(R_RELEASED_OFF) == ch.ring.word(R_ACKED_OFF) == w._write
    put(w, 2010, 10)  # acknowledged: room again
    assert int(w.ring.word(W_DROPPED)) == dropped + 10
    drain(ch)
    got = seqs(link.envelopes())
    assert got == list(range(written)) + list(range(2010, 2020))
    assert link.envelopes()[-1].counters["dropped"] == dropped + 10
    ch.close(remove=False)


def test_the_rank_says_which_records_it_dropped_once_the_ring_has_room(tmp_path):
    """Dropped records are named (group, phase, seq range) in a message of their own,
    written before the next record that fits, and again before the goodbye."""
    w = writer(tmp_path)
    put(w, 0, 2000)  # nobody reads: the ring fills up, the rest is dropped
    written = w._records
    link = FakeLink()
    ch = channel(w, link, buffer_bytes=1 << 20)
    drain(ch)
    ch.acked([(os.getpid(), e.seq) for e in link.envelopes()])
    put(w, 2000, 5)
    drain(ch)
    said = [(d.group, d.ranks, d.phase, d.first, d.last)
            for e in link.envelopes() for d in e.drops]
    assert all(not len(decode(encode(e)).records) for e in link.envelopes() if e.drops)
    # a drops entry is smaller than a record: one may fit where the next record did not
    assert said[0][:4] == ("0", [0], 0, written) and said[-1][4] == 1999
    assert all(a[4] + 1 == b[3] for a, b in zip(said, said[1:], strict=False))
    assert seqs(link.envelopes()) == list(range(written)) + list(range(2000, 2005))
    ch.close(remove=False)


def test_drops_are_said_before_the_goodbye(tmp_path):
    w = writer(tmp_path, run="bye")
    put(w, 0, 3000)  # nobody reads until the rank closes: its drops are said at the end
    written = w._records
    ch = channel(w, dump_dir=str(tmp_path / "dump"))  # delivered once written
    assert close(w, ch)
    ch.close(remove=False)
    with open(dump_path(str(tmp_path / "dump"), "bye", 0), "rb") as f:
        envs = [decode(p).env for p in read_frames(f)]
    assert envs[-1].kind == GOODBYE and [e.kind for e in envs].count(GOODBYE) == 1
    said = [(d.first, d.last) for e in envs for d in e.drops]
    assert said[0][0] == written and said[-1][1] == 2999  # perhaps in two: see above
    assert all(a[1] + 1 == b[0] for a, b in zip(said, said[1:], strict=False))
    assert envs[-1].counters["dropped"] == 3000 - written


def test_relay_spills_when_the_outbox_is_full_and_the_ring_gets_room(tmp_path):
    w = writer(tmp_path)
    link = FakeLink()
    ch = channel(w, link, buffer_bytes=8_000, spill_dir=str(tmp_path / "spill"),
                 spill_bytes=1 << 20)
    for i in range(10):  # 10 x 300 records through a 64 KiB ring, nothing acknowledged
        put(w, i * 300, 300)
        drain(ch, 5)
    assert int(w.ring.word(W_DROPPED)) == 0
    assert ch.spill is not None and ch.spill.pending and ch.outbox.bytes <= 8_000 + 20_000
    assert w.stats()["spilled"] > 0 and ch.spill.path.exists()
    # the collector comes: ack everything sent, repeatedly, until all is delivered
    for _ in range(400):
        ch.acked([(os.getpid(), e.seq) for e in link.envelopes()])
        drain(ch, 1)
        if ch.delivered():
            break
    assert ch.delivered() and sorted(set(seqs(link.envelopes()))) == list(range(3000))
    ch.close(remove=False)
    assert not ch.spill.path.exists()  # everything delivered: the spill file is gone


def test_torn_and_garbage_entries_are_rejected_and_counted(tmp_path):
    w = writer(tmp_path)
    put(w, 0, 3)
    mid = w._write
    put(w, 3, 1)
    put(w, 4, 3)
    mm = w.ring.mm
    mm[HEADER_BYTES + mid + ENTRY.size + 3] ^= 0xFF  # a torn record: bad checksum
    link = FakeLink()
    ch = channel(w, link)
    ch.poll(time.monotonic())
    assert ch.ring.word(R_REJECTED) == 0  # at first maybe still being written: wait
    time.sleep(0.3)
    drain(ch, 2)
    assert ch.ring.word(R_REJECTED) == 1
    assert seqs(link.envelopes()) == [0, 1, 2, 4, 5, 6]
    # garbage where an entry should start (bad magic), and a rank that is gone
    start = w._write
    put(w, 7, 2)
    mm[HEADER_BYTES + start:HEADER_BYTES + start + 8] = b"garbage!"
    ch.poll(time.monotonic(), owner_gone=True)
    ch.pump(time.monotonic())
    assert ch.ring.word(R_REJECTED) == 2 and seqs(link.envelopes())[-1] == 8
    ch.close(remove=False)
    w.close(linger=0)


def test_a_restarted_relay_resends_the_same_messages_then_carries_on(tmp_path):
    w = writer(tmp_path)
    put(w, 0, 95)
    first = FakeLink()
    a = channel(w, first)
    drain(a)
    a.acked([(os.getpid(), 0), (os.getpid(), 1)])  # the hello and the first batch
    sent_a = first.envelopes()
    assert [e.seq for e in sent_a] == list(range(6))
    # the relay dies (no close, nothing more acknowledged); a new one opens the ring
    second = FakeLink()
    b = channel(w, second)
    b.pump(time.monotonic())
    again = second.envelopes()
    assert [e.seq for e in again] == [2, 3, 4, 5]  # journaled, unacknowledged: re-sent
    for old, new in zip(sent_a[2:], again, strict=True):
        assert (old.pid, old.seq, old.kind, old.records, old.t) == \
            (new.pid, new.seq, new.kind, new.records, new.t)
    put(w, 95, 10)
    drain(b)
    assert [e.seq for e in second.envelopes()][4:] == [6]  # carries on, no name reused
    assert seqs(second.envelopes()) == list(range(20, 105))
    b.acked([(os.getpid(), s) for s in range(2, 7)])
    assert b.delivered() and b.ring.word(R_ACKED_OFF) == w._write
    # what a ring leaves behind, read offline, has the same names
    put(w, 105, 3)
    left = [decode(p).env for p in leftover_messages(Ring.open(w.path, writable=False))]
    assert [e.seq for e in left] == [7] and seqs(left) == [105, 106, 107]
    b.close(remove=False)
    a.ring.close()


def test_a_restarted_relay_appends_to_the_dump_file_without_duplicates(tmp_path):
    w = writer(tmp_path)
    put(w, 0, 50)
    a = channel(w, dump_dir=str(tmp_path / "dump"))
    drain(a)
    # died after writing the dump, before the ring learnt it: the journal says unreleased
    from commcheck.wire.ring import R_ACKED_SEQ, R_RELEASED_SEQ

    a.ring.set_word(R_RELEASED_SEQ, 1)
    a.ring.set_word(R_ACKED_SEQ, 1)
    a.sink.close()
    b = channel(w, dump_dir=str(tmp_path / "dump"))
    put(w, 50, 5)
    drain(b)
    assert close(w, b)
    b.close(remove=False)
    with open(dump_path(str(tmp_path / "dump"), "ring", 0), "rb") as f:
        envs = [decode(p).env for p in read_frames(f)]
    assert [e.seq for e in envs] == list(range(len(envs)))
    assert seqs(envs) == list(range(55))


def test_rings_are_private_and_checked_before_reading(tmp_path):
    w = writer(tmp_path)
    st = os.stat(w.path)
    assert st.st_mode & 0o777 == 0o600
    os.chmod(w.path, 0o644)
    with pytest.raises(RingError, match="mode 644"):
        Ring.open(w.path)
    os.chmod(w.path, 0o600)
    link = tmp_path / "rings" / "link.ring"
    link.symlink_to(w.path)
    with pytest.raises(OSError):
        Ring.open(str(link))
    if os.getuid() == 0:  # another owner: refused even with the right mode
        os.chown(w.path, 65534, 65534)
        with pytest.raises(RingError, match="owned by uid 65534"):
            Ring.open(w.path)
        os.chown(w.path, 0, 0)
    Ring.open(w.path).close()
    garbage = tmp_path / "rings" / "garbage.ring"
    garbage.write_bytes(b"\0" * (HEADER_BYTES + MIN_CAPACITY))
    os.chmod(garbage, 0o600)
    with pytest.raises(RingError, match="bad magic"):
        Ring.open(str(garbage))
    w.close(linger=0)
    assert os.path.exists(w.path)  # nothing acknowledged it: kept for analyze


def test_writes_never_raise_and_stay_cheap(tmp_path):
    w = writer(tmp_path, capacity=4 << 20)
    r = rec(seq=1, ranks=(0,))
    t0 = time.perf_counter()
    for _ in range(2000):
        w.write_record(r)
    per = (time.perf_counter() - t0) / 2000
    assert per < 200e-6  # a few microseconds; generous for a loaded box
    w.submit(object())  # not a record at all: counted, never raised
    assert w.stats()["errors"] == 1
    w.close(linger=0)
    w.submit(_Ready(r))  # after close: nothing happens
    assert w.ring.mm is None and w.final["records"] == 2000


def test_status_messages_decode_and_malformed_ones_are_rejected():
    ok = Envelope(v=1, kind="status", run="r", rank=0, host="h", seq=3, world=4, pid=9,
                  status=[RankStatus(rank=2, pid=77, state="gone", signal=9, idle=1.5)])
    got = decode(encode(ok)).env
    assert got.status[0].state == "gone" and got.status[0].signal == 9
    bad = [
        Envelope(v=1, kind="status", run="r", rank=0, host="h", seq=0, world=4, pid=9),
        Envelope(v=1, kind="status", run="r", rank=0, host="h", seq=0, world=4, pid=9,
                 status=[RankStatus(rank=4, pid=7, state="alive")]),
        Envelope(v=1, kind="status", run="r", rank=0, host="h", seq=0, world=4, pid=9,
                 status=[RankStatus(rank=1, pid=7, state="asleep")]),
        Envelope(v=1, kind="status", run="r", rank=0, host="h", seq=0, world=4, pid=9,
                 status=[RankStatus(rank=1, pid=7, state="alive", idle=float("nan"))]),
        Envelope(v=1, kind="records", run="r", rank=0, host="h", seq=0, world=4, pid=9,
                 status=[RankStatus(rank=1, pid=7, state="alive")]),
    ]
    for env in bad:
        with pytest.raises(WireError) as e:
            decode(encode(env))
        assert e.value.reason in ("bad_status", "bad_kind")


def test_analyze_reads_what_a_ring_left_behind(tmp_path, capsys):
    """A rank whose relay never came: its ring stays, and `commcheck analyze` reads it."""
    from commcheck.cli import main

    w = writer(tmp_path, run="left")
    put(w, 0, 30)
    assert not w.close(linger=0)  # nothing acknowledged: the ring stays
    rc = main(["analyze", str(tmp_path / "rings"), "--json"])
    import json

    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["summary"]["records"] == 30
    assert doc["summary"]["ranks_said_goodbye"] == 1


class Later:
    """A completion whose device fingerprints land ``after`` seconds from now."""

    def __init__(self, r, after: float):
        self.r, self.at = r, time.monotonic() + after

    def ready(self) -> bool:
        return time.monotonic() >= self.at

    def finalize(self):
        return self.r


def test_pending_device_work_is_written_by_the_resolver_thread(tmp_path):
    w = writer(tmp_path)
    w.queue_records = 2
    w.submit(Later(rec(seq=0, ranks=(0,)), 0.1))
    w.submit(_Ready(rec(seq=1, ranks=(0,))))  # ready: written at once, no waiting in line
    assert w._records == 1
    deadline = time.monotonic() + 5
    while w._records < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w._records == 2  # the resolver thread wrote it once its event fired
    w.submit(Later(rec(seq=2, ranks=(0,)), 60))
    w.submit(Later(rec(seq=3, ranks=(0,)), 60))
    w.submit(Later(rec(seq=4, ranks=(0,)), 60))  # beyond queue_records: dropped, counted
    assert w.stats()["dropped"] == 1
    link = FakeLink()
    ch = channel(w, link)
    close(w, ch, linger=0.3)  # device work that never finishes: dropped at exit, counted
    drain(ch, 3)
    assert w.final["dropped"] == 3 and w.final["records"] == 2
    assert seqs(link.envelopes()) == [1, 0]
    assert link.envelopes()[-1].kind == GOODBYE
    assert link.envelopes()[-1].counters["dropped"] == 3
    ch.close(remove=False)


def _dead_pid() -> int:
    with open("/proc/sys/kernel/pid_max") as f:
        pid = int(f.read()) - 1
    while os.path.exists(f"/proc/{pid}"):
        pid -= 1
    return pid


class SlowCollector:
    """A ROUTER in a thread that acknowledges each message ``delay`` seconds after it came
    (as a collector does after its commit), and keeps the decoded messages."""

    def __init__(self, delay: float):
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.delay, self.got, self.done = delay, [], threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        from commcheck.wire.acks import encode_acks

        owed: list[tuple[float, bytes, tuple[int, int]]] = []
        while not self.done.is_set():
            if self.sock.poll(10):
                ident, data = self.sock.recv_multipart()
                env = decode(data).env
                self.got.append(env)
                if env.kind != "status":
                    owed.append((time.monotonic() + self.delay, ident, (env.pid, env.seq)))
            now = time.monotonic()
            while owed and owed[0][0] <= now:
                _, ident, name = owed.pop(0)
                self.sock.send_multipart([ident, encode_acks([name])])

    def close(self) -> None:
        self.done.set()
        self.thread.join()
        self.sock.close()
        self.ctx.term()


def test_the_relay_delivers_a_dead_ranks_ring_that_came_late_then_exits(tmp_path):
    """The relay's own loop (in this process): a ring appears after the relay waited with
    nothing to do for longer than its linger, its rank already dead (no goodbye). The relay
    must still deliver it in full (acks come late), remove it, and exit."""
    import signal

    from commcheck.relay.relay import Relay

    rings = tmp_path / "rings"
    rings.mkdir(mode=0o700)
    col = SlowCollector(delay=0.3)

    def rank_that_dies() -> None:
        time.sleep(2.0)
        ident = Identity(run="late", rank=0, host="h", world=1, node=-1, pid=_dead_pid(),
                         dest=col.endpoint)
        w = RingWriter.create(str(rings), ident, MIN_CAPACITY)
        w.start()
        put(w, 0, 10)  # and then it is gone: no goodbye, no close

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    threading.Thread(target=rank_that_dies).start()
    t0 = time.monotonic()
    try:
        rc = Relay(RelaySettings(run="late", ring_dir=str(rings), collector=col.endpoint,
                                 linger=1.0, idle_exit=20, flush_interval=0.01)).run()
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        col.close()
    assert rc == 0 and time.monotonic() - t0 < 10
    sent = [e for e in col.got if e.kind != "status"]
    assert sent[0].kind == HELLO and seqs(sent) == list(range(10))
    status = [e for e in col.got if e.kind == "status"][-1].status
    assert status[0].state == "gone" and not status[0].goodbye and status[0].records == 10
    assert not list(rings.glob("*.ring")) and not list(rings.glob("*.lock"))
    assert not list(rings.glob("*.log"))  # a clean exit leaves no log


def test_a_restarted_relay_whose_outbox_is_too_small_spills_the_re_sends(tmp_path):
    w = writer(tmp_path)
    put(w, 0, 95)
    first = FakeLink()
    drain(channel(w, first))  # journaled and sent, never acknowledged; the relay dies
    second = FakeLink()
    b = channel(w, second, buffer_bytes=3_000, spill_dir=str(tmp_path / "spill"))
    assert b.spill is not None and b.spill.pending  # the re-sends beyond the bound
    assert w.stats()["spilled"] > 0
    for _ in range(100):
        b.acked([(os.getpid(), e.seq) for e in second.envelopes()])
        drain(b, 1)
        if b.delivered():
            break
    assert b.delivered() and sorted(set(seqs(second.envelopes()))) == list(range(95))
    assert [e.seq for e in first.envelopes()] == sorted({e.seq for e in second.envelopes()})
    b.close(remove=False)


def _native_and_python_writers(tmp_path, monkeypatch) -> tuple[RingWriter, RingWriter]:
    from commcheck.native import hot

    if hot.module() is None:
        pytest.skip("the native per-call path cannot be built here")
    for side in ("native", "python"):
        (tmp_path / side).mkdir()
    with monkeypatch.context() as m:
        m.setattr(time, "time", lambda: 1.0)  # the same hello entry
        native = writer(tmp_path / "native", capacity=MIN_CAPACITY)
        m.setattr(hot, "module", lambda: None)
        python = writer(tmp_path / "python", capacity=MIN_CAPACITY)
    assert native._hot is not None and python._hot is None
    return native, python


def test_the_native_writer_writes_the_python_writers_bytes(tmp_path, monkeypatch):
    """Same records, same entries: every field kind (big hashes, negative ints, chunks,
    long strings, splits), across a wrap of the ring with its pad entry."""
    native, python = _native_and_python_writers(tmp_path, monkeypatch)
    records = [rec(seq=i, ranks=tuple(range(40)), callsite="x" * (i * 37 % 300),
                   out=(2**64 - 1 - i, i), root=-1 if i % 2 else 3, peer=-5, t_enter=1.5 + i,
                   in_summary=(-1e300, float("inf"), 2**40, 0), in_splits=(1, 2, 300),
                   chunks=[Chunk(1, j, 2**63 + j, j, -0.5) for j in range(i % 5)])
               for i in range(40)]
    link = FakeLink()
    ch = channel(native, link)
    for w in (native, python):
        for r in records:
            assert w.write_record(r)
    drain(ch)
    assert seqs(link.envelopes()) == list(range(40))
    for w in (native, python):  # as if the relay released it all: the next ones wrap
        for _ in range(3):
            w.ring.words[R_RELEASED_OFF] = w._write
            for r in records:
                assert w.write_record(r)
    assert native._write == python._write > native.ring.capacity
    assert native._records == python._records == 160 and native._number == python._number
    data = slice(HEADER_BYTES, HEADER_BYTES + native.ring.capacity)
    assert bytes(native._mm[data]) == bytes(python._mm[data])
    for w in (native, python):
        w.close(0.0)


def test_the_native_writer_drops_and_says_so_like_the_python_one(tmp_path, monkeypatch):
    native, python = _native_and_python_writers(tmp_path, monkeypatch)
    for w in (native, python):
        put(w, 0, 2000)  # far beyond the ring: nobody releases space
        assert w._dropped > 0 and w._drops.n > 0
        assert int(w.ring.words[W_DROPPED]) == w._dropped
    assert native._dropped == python._dropped and native._records == python._records
    for w in (native, python):
        w.close(0.0)


def test_a_stop_signal_is_written_into_the_ring_and_the_old_handler_still_runs(tmp_path):
    """SIGINT: the native writer's handler writes 2 into the ring's W_SIGNAL, then Python's
    own handler raises KeyboardInterrupt as before. The relay reports the signal only once
    the rank is gone (this one is alive)."""
    from commcheck.native import hot

    if hot.module() is None:
        pytest.skip("the native per-call path cannot be built here")
    # Python's own handler, whatever this run inherited (a test run started in the
    # background by a shell without job control has SIGINT ignored)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _stop_signal_written_and_chained(tmp_path)
    finally:
        signal.signal(signal.SIGINT, old)


def _stop_signal_written_and_chained(tmp_path) -> None:
    w = writer(tmp_path)
    ch = channel(w, dump_dir=str(tmp_path / "dump"))
    assert ch.ring.word(W_SIGNAL) == 0
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    assert ch.ring.word(W_SIGNAL) == signal.SIGINT
    assert ch.status(time.time()).signal == 0
    assert close(w, ch)
    with pytest.raises(KeyboardInterrupt):  # closed: nothing written, still chained
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)


def test_the_resolver_puts_the_mark_back_in_front_of_a_later_handler(tmp_path, monkeypatch):
    """A framework's SIGTERM handler installed after patch() (Lightning's signal connector)
    is chained within one watch interval of the resolver thread, without any call."""
    from commcheck.native import hot
    from commcheck.rank import ring as rank_ring

    if hot.module() is None:
        pytest.skip("the native per-call path cannot be built here")
    monkeypatch.setattr(rank_ring, "WATCH_INTERVAL", 0.02)
    w = writer(tmp_path)
    ch = channel(w, dump_dir=str(tmp_path / "dump"))
    got: list[int] = []
    prev = signal.signal(signal.SIGHUP, lambda s, f: got.append(s))
    try:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.01)
        assert got == [signal.SIGHUP] and ch.ring.word(W_SIGNAL) == signal.SIGHUP
    finally:
        signal.signal(signal.SIGHUP, prev)
        assert close(w, ch)


def test_a_handler_set_after_the_ring_is_chained_once_the_mark_is_put_back(tmp_path,
                                                                            monkeypatch):
    """A Python handler installed later (the gradient probe's drain, a framework's) replaces
    the C one; ``remark_stops`` puts it back in front, and both run."""
    from commcheck.native import hot
    from commcheck.rank import ring as rank_ring

    if hot.module() is None:
        pytest.skip("the native per-call path cannot be built here")
    monkeypatch.setattr(rank_ring, "WATCH_INTERVAL", 3600.0)  # the resolver's re-mark: not now
    w = writer(tmp_path)
    ch = channel(w, dump_dir=str(tmp_path / "dump"))
    got: list[int] = []
    prev = signal.signal(signal.SIGHUP, lambda s, f: got.append(s))
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.01)
        assert got == [signal.SIGHUP] and ch.ring.word(W_SIGNAL) == 0  # replaced
        assert hot.remark_stops()
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.01)
        assert got == [signal.SIGHUP] * 2 and ch.ring.word(W_SIGNAL) == signal.SIGHUP
    finally:
        signal.signal(signal.SIGHUP, prev)
        assert close(w, ch)
