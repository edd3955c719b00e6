"""One rank's ring as its relay serves it: read the entries, cut them into messages,
journal each message in the ring *before* sending it, deliver (outbox → collector, spill
file while the collector is away, or the rank's dump file), and turn acknowledgements back
into ring offsets the rank may reuse.

A message is named (run, rank, the rank's pid, seq) exactly as the rank's own sender named
it before there was a relay, so the collector's ledger deduplicates re-sends the same way.
The seq and the ring range of each message are journaled in the ring header, so a relay
that restarts (after SIGKILL, say) re-sends the same messages under the same names and then
continues where the journal ends: nothing lost, nothing stored twice.

Offsets the relay publishes in the ring (see :mod:`commcheck.wire.ring`):

* ``released``: the rank may overwrite what lies before it: acknowledged by the collector,
  or written to the spill file (which keeps it until acknowledged);
* ``acked``: everything before it acknowledged (or, without a collector, in the dump
  file): what a rank's ``Session.stop()`` waits for.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

from ..wire import GONE, RankStatus
from ..wire.relay_settings import RelaySettings
from ..wire.ring import (
    F_DUMP_OPENED,
    F_REFUSED,
    JOURNAL_SLOTS,
    K_GOODBYE,
    K_RECORD,
    R_ACKED_OFF,
    R_ACKED_SEQ,
    R_FLAGS,
    R_NEXT_SEQ,
    R_REJECTED,
    R_RELEASED_OFF,
    R_RELEASED_SEQ,
    R_RESENT,
    R_SPILLED,
    STATE_GOODBYE,
    STATE_RUNNING,
    W_DROPPED,
    W_ENTRIES,
    W_LAST,
    W_RECORDS,
    W_SIGNAL,
    W_WRITE,
    Entry,
    Ring,
    builder_for,
    message,
    pending_messages,
    read_offset,
    records_message,
)
from .folders import run_folder
from .link import FileSink, ZmqLink, dump_path
from .outbox import Outbox
from .spill import Spill, spill_path
from .watch import Owner

log = logging.getLogger("commcheck.relay")

FRONTIER_GRACE = 0.25  # seconds a damaged entry at the write offset may still be in writing
EAGER_BYTES = 64 << 10  # this much unread (or an eighth of the ring): read it now


class Channel:
    def __init__(self, ring: Ring, settings: RelaySettings, link: ZmqLink | None):
        self.ring = ring
        self.ident = ident = ring.identity
        self.pid = ident.pid
        self.settings = settings
        self.link = link
        self.builder = builder_for(ring)
        self.owner = Owner(ident.pid, ident.pid_start)
        self.outbox = Outbox(settings.buffer_bytes, settings.ack_timeout) if link else None
        self.spill: Spill | None = None
        self.sink: FileSink | None = None
        # seq -> [end offset, released, acked], for every message not yet acknowledged
        self.inflight: dict[int, list] = {}
        self.batch: list[bytes] = []  # the payloads of the records read for the next message
        self.batch_start = 0
        self.batch_since = 0.0
        self.extra: dict[str, int] = {}
        self._bad: tuple[int, float] | None = None
        self._number: int | None = None  # the number the next entry has, once known
        self._said_write = False
        self._unread_since: float | None = None  # when the oldest unread entry was seen
        self._forced = False
        self.goodbye = False
        self.closed = False
        self.resent = 0
        self._resume()

    # -- restart ---------------------------------------------------------------------------

    def _resume(self) -> None:
        """Continue from what the ring's journal says (a fresh ring: from the start)."""
        ring, ident = self.ring, self.ident
        self.released_seq = ring.word(R_RELEASED_SEQ)
        self.next_seq = ring.word(R_NEXT_SEQ)
        self.acked_seq = min(ring.word(R_ACKED_SEQ), self.released_seq)
        self.acked_off = ring.word(R_ACKED_OFF)
        self.released_off = ring.word(R_RELEASED_OFF)
        self.read_off = read_offset(ring)
        self._number = 0 if self.read_off == 0 else None
        if self.link is None:
            append = bool(ring.word(R_FLAGS) & F_DUMP_OPENED)
            folder = run_folder(self.settings.dump_dir, ident.run, "dump")
            self.sink = FileSink(folder / dump_path("", ident.run, ident.rank).name,
                                 append=append, pid=ident.pid)
            ring.set_word(R_FLAGS, ring.word(R_FLAGS) | F_DUMP_OPENED)
        else:
            path = ring.spill_path
            if not path and self.settings.spill_dir:
                folder = run_folder(self.settings.spill_dir, ident.run, "spill")
                path = str(folder / spill_path("", ident.run, ident.rank, ident.pid).name)
                ring.spill_path = path
            if path:
                self.spill = Spill(Path(path), self.settings.spill_bytes)
                if self.spill.load():
                    log.info("rank %d: %d message(s) back from %s", ident.rank,
                             self.spill.pending, path)
        for seq in range(self.acked_seq, self.released_seq):  # released: spilled or acked
            slot = ring.slot(seq)
            end = slot[2] if slot is not None else self.acked_off
            spilled = self.spill is not None and (self.pid, seq) in self.spill
            self.inflight[seq] = [end, True, not spilled]
        resend = 0
        for seq, end, payload, n, kind in pending_messages(ring, self.builder):
            if self.sink is not None and seq <= self.sink.last_seq:
                self.inflight[seq] = [end, True, True]  # in the dump file already
            elif self.spill is not None and (self.pid, seq) in self.spill:
                self.inflight[seq] = [end, True, False]
            else:
                self.inflight[seq] = [end, False, False]
                self._deliver(seq, payload, n)
                resend += 1
            if kind == K_GOODBYE:
                self.goodbye = True
        if resend:
            log.info("rank %d: re-sending %d journaled message(s) from seq %d", ident.rank,
                     resend, self.released_seq)
        # where the rank may write again: the journal decides, not a word a crash tore
        slot = ring.slot(self.released_seq) if self.released_seq < self.next_seq else None
        self.released_off = max(slot[1] if slot is not None else self.read_off,
                                ring.word(R_RELEASED_OFF))
        ring.set_word(R_RELEASED_OFF, self.released_off)
        self._advance()

    # -- reading ---------------------------------------------------------------------------

    def paused(self) -> bool:
        """Stop cutting new messages: the outbox is over its bound with nowhere to spill,
        or the journal is full of unacknowledged messages."""
        if self.next_seq - self.released_seq >= JOURNAL_SLOTS - 1:
            return True
        if self._forced and self.outbox is not None:
            if self.outbox.bytes < self.outbox.max_bytes:
                self._forced = False
            return self._forced
        return False

    def poll(self, now: float, owner_gone: bool = False) -> int:
        """Read what the rank wrote since, cut messages; returns entries read."""
        if self.closed:
            return 0
        ring, n = self.ring, 0
        write = self._write_offset()
        if self._gathering(now, write, owner_gone):
            self._relieve()
            return 0
        while self.read_off < write and not self.paused():
            got = self._records(now, write)
            if got:
                n += got
                continue
            e = ring.entry_at(self.read_off, write)
            if e is None:
                break
            if e.error:
                if not owner_gone and (self._bad is None or self._bad[0] != self.read_off):
                    self._bad = (self.read_off, now)  # maybe still in writing: look again
                    break
                if not owner_gone and now - self._bad[1] < FRONTIER_GRACE:
                    break
                damaged = next(iter(ring.entries(self.read_off, write, self._number,
                                                 ring.word(W_ENTRIES))))
                log.warning("rank %d: damaged ring entry at offset %d (%s): %d bytes skipped, "
                            "%d entries lost", self.ident.rank, self.read_off, damaged.error,
                            damaged.end - damaged.off, damaged.lost)
                ring.set_word(R_REJECTED, ring.word(R_REJECTED) + damaged.lost)
                self.read_off = damaged.end
                self._bad = None
                continue
            n += 1
            self._number = e.number + 1
            if e.kind == K_RECORD:
                self._add([e.payload], e.end, now)
                continue
            had = bool(self.batch)
            self._cut(e.off)  # the records before a control message go first
            self._send(e.off if had else self.read_off, e.end, [e], time.time(), 0, e.kind)
            self.read_off = e.end
            if e.kind == K_GOODBYE:
                self.goodbye = True
        if self.batch and (owner_gone or self.goodbye or
                           now - self.batch_since >= self.settings.flush_interval):
            self._cut(self.read_off)
        if self.read_off >= write:
            self._unread_since = None
        self._relieve()
        return n

    def _records(self, now: float, write: int) -> int:
        """Read the records that follow, up to a full batch, in one pass; returns how many
        (0: the next entry is something else, or not there yet: ``entry_at`` reads it)."""
        room = self.settings.batch_records - len(self.batch)
        payloads, end, number = self.ring.records_at(self.read_off, write, max(room, 1))
        if payloads:
            self._number = number + 1
            self._add(payloads, end, now)
        return len(payloads)

    def _add(self, payloads: list[bytes], end: int, now: float) -> None:
        if not self.batch:
            self.batch_start, self.batch_since = self.read_off, (
                now if self._unread_since is None else self._unread_since)
        self.batch += payloads
        self.read_off = end
        if len(self.batch) >= self.settings.batch_records:
            self._cut(self.read_off)

    def _write_offset(self) -> int:
        """The rank's write offset, never more than one ring past what it may overwrite
        (it cannot write further: a larger word is damaged, and reading to it would
        never end)."""
        write, most = self.ring.word(W_WRITE), self.released_off + self.ring.capacity
        if write <= most:
            return write
        if not self._said_write:
            self._said_write = True
            log.warning("rank %d: ring write offset %d is past what the rank may write "
                        "(%d): damaged; read to there", self.ident.rank, write, most)
        return most

    def _gathering(self, now: float, write: int, owner_gone: bool) -> bool:
        """Leave what the rank just wrote in the ring a while (at most the flush interval a
        partial batch waited anyway), so that a stream of calls is read a batch per look,
        not an entry per look (docs/startup.md). Read at once a backlog, a goodbye (the
        rank's state says so) and what a rank that is gone left."""
        if write <= self.read_off:
            return False
        if self._unread_since is None:
            self._unread_since = now
        return not (owner_gone or now - self._unread_since >= self.settings.flush_interval
                    or write - self.read_off >= min(EAGER_BYTES, self.ring.capacity // 8)
                    or self.ring.state() != STATE_RUNNING)

    def _relieve(self) -> None:
        """Over half the ring waits for acknowledgements (the collector is away or slow):
        copy the oldest of those messages from the outbox to the spill file, which frees
        their ring space for the rank (they are still sent from the outbox)."""
        spill, out = self.spill, self.outbox
        if spill is None or out is None or spill.broken:
            return
        half = self.ring.capacity // 2
        seq = self.released_seq
        while self.ring.word(W_WRITE) - self.released_off > half and seq < self.next_seq:
            item = self.inflight.get(seq)
            if item is None:
                break
            if not item[1]:
                entry = out.get(self.pid, seq)
                if entry is None or not spill.put(seq, self.pid, entry.payload, entry.records,
                                                  pending=False):
                    break
                self.ring.set_word(R_SPILLED, self.ring.word(R_SPILLED) + entry.records)
                item[1] = True
                self._advance()
            seq += 1

    def _cut(self, end: int) -> None:
        """Send the records read so far as one message ending at ``end``."""
        if not self.batch:
            return
        items, self.batch = self.batch, []
        self._send(self.batch_start, end, items, time.time(), len(items), K_RECORD)

    def _send(self, start: int, end: int, items: list[bytes] | list[Entry], t: float,
              records: int, kind: int) -> None:
        """Journal and deliver message ``next_seq``: records (``items``: their payloads),
        or one control entry (``items``: that entry)."""
        seq = self.next_seq
        self.ring.journal(seq, start, end, t, records, kind)  # before it leaves: see _resume
        self.next_seq = seq + 1
        before = self.extra.get("rejected", 0)
        if kind == K_RECORD:
            payload, n = records_message(self.ring, self.builder, seq, items, t, self.extra)
        else:
            payload, n, _ = message(self.ring, self.builder, seq, items, t, self.extra)
        if self.extra.get("rejected", 0) != before:
            self.ring.set_word(R_REJECTED, self.ring.word(R_REJECTED) +
                               self.extra["rejected"] - before)
        self.inflight[seq] = [end, False, False]
        self._deliver(seq, payload, n)

    # -- delivery --------------------------------------------------------------------------

    def _deliver(self, seq: int, payload: bytes, n: int) -> None:
        if self.sink is not None:  # a dump file: delivered once written
            self.sink.send(payload)
            self._done(seq, acked=True)
            return
        out, spill = self.outbox, self.spill
        if (spill is None or not spill.pending) and out.add(seq, self.pid, payload, n):
            return
        if spill is not None and spill.put(seq, self.pid, payload, n):
            self.ring.set_word(R_SPILLED, self.ring.word(R_SPILLED) + n)
            self._done(seq, acked=False)
            return
        out.add(seq, self.pid, payload, n, force=True)  # over the bound by one: pause
        self._forced = True

    def _done(self, seq: int, acked: bool) -> None:
        item = self.inflight.get(seq)
        if item is not None:
            item[1] = True
            item[2] = item[2] or acked
            self._advance()

    def acked(self, names: list[tuple[int, int]]) -> None:
        """The collector acknowledged these (pid, seq) of this rank."""
        if self.outbox is not None:
            self.outbox.acked(names)
        if self.spill is not None:
            self.spill.acked(names)
        for _, seq in names:
            item = self.inflight.get(seq)
            if item is not None:
                item[1] = item[2] = True
        self._advance()

    def _advance(self) -> None:
        ring, moved = self.ring, False
        while self.released_seq < self.next_seq:
            item = self.inflight.get(self.released_seq)
            if item is None or not item[1]:
                break
            self.released_off = max(self.released_off, item[0])
            self.released_seq += 1
            moved = True
        if moved:  # the seq first: a restart recomputes the offset from the journal
            ring.set_word(R_RELEASED_SEQ, self.released_seq)
            ring.set_word(R_RELEASED_OFF, self.released_off)
        moved = False
        while self.acked_seq < self.released_seq:
            item = self.inflight.get(self.acked_seq)
            if item is None or not item[2]:
                break
            self.acked_off = max(self.acked_off, item[0])
            del self.inflight[self.acked_seq]
            self.acked_seq += 1
            moved = True
        if moved:
            ring.set_word(R_ACKED_SEQ, self.acked_seq)
            ring.set_word(R_ACKED_OFF, self.acked_off)

    def park(self) -> int:
        """At the relay's exit, the collector not acknowledging: copy every message only
        the ring and the outbox hold to the spill file, so that nothing undelivered is left
        in the ring alone (the rank, or the relay, may then remove it: the spill file is on
        disk, and it is what ``commcheck analyze`` reads). Returns messages copied."""
        spill, out = self.spill, self.outbox
        if spill is None or out is None or spill.broken:
            return 0
        n = 0
        for seq in range(self.released_seq, self.next_seq):
            item = self.inflight.get(seq)
            if item is None or item[1]:
                continue
            entry = out.get(self.pid, seq)
            if entry is None or not spill.put(seq, self.pid, entry.payload, entry.records):
                break
            self.ring.set_word(R_SPILLED, self.ring.word(R_SPILLED) + entry.records)
            item[1] = True
            n += 1
        self._advance()
        return n

    def released_all(self) -> bool:
        """Nothing undelivered lies in the ring alone (acknowledged, or in the spill)."""
        return self.released_seq >= self.next_seq and not self.batch and \
            self.read_off >= self.ring.word(W_WRITE)

    def pump(self, now: float) -> None:
        """Take spilled messages back while the outbox has room, (re)send what is due."""
        out = self.outbox
        if out is None or self.link is None:
            return
        spill = self.spill
        while spill is not None and spill.pending:
            head = spill.peek()
            if head is None or not out.room(head):
                break
            seq, pid, payload, n = spill.take()
            out.add(seq, pid, payload, n, force=True)
        resent = out.send_due(self.link.send, now)
        if resent:
            self.resent += resent
            self.ring.set_word(R_RESENT, self.ring.word(R_RESENT) + resent)

    # -- state -----------------------------------------------------------------------------

    def finished(self, owner_gone: bool) -> bool:
        """Nothing more will come: the rank said goodbye (or is gone) and all it wrote was
        read into messages."""
        said = self.goodbye or self.ring.state() >= STATE_GOODBYE
        return (said or owner_gone) and not self.batch and \
            self.read_off >= self.ring.word(W_WRITE)

    def delivered(self) -> bool:
        return self.acked_seq >= self.next_seq and \
            (self.spill is None or (not self.spill.held and not self.spill.pending))

    def unacked(self) -> tuple[int, int]:
        """(messages, records) not acknowledged yet."""
        msgs = self.next_seq - self.acked_seq
        records = (self.outbox.records() if self.outbox is not None else 0) + \
            (self.spill.records if self.spill is not None else 0)
        return msgs, records

    def status(self, now: float, unreachable: float = 0.0, outages: int = 0) -> RankStatus:
        seen = self.owner.last
        words = self.ring.words
        last = float(self.ring.floats[W_LAST])
        # a zombie's status when the relay caught one; else the stop signal it was sent
        sig = seen.signal or (int(words[W_SIGNAL]) if seen.state == GONE else 0)
        return RankStatus(
            rank=self.ident.rank, pid=self.pid, state=seen.state, proc=seen.proc,
            goodbye=self.goodbye or self.ring.state() >= STATE_GOODBYE,
            idle=round(max(0.0, time.time() - last), 3) if last else 0.0,
            exit_code=seen.exit_code, signal=sig, records=int(words[W_RECORDS]),
            dropped=int(words[W_DROPPED]), unreachable=round(unreachable, 3),
            outages=outages, resent=int(words[R_RESENT]))

    def refused(self, yes: bool) -> None:
        """Tell the rank whether the collector refuses the relay's keys (it says so)."""
        flags = self.ring.word(R_FLAGS)
        want = flags | F_REFUSED if yes else flags & ~F_REFUSED
        if want != flags:
            self.ring.set_word(R_FLAGS, want)

    def close(self, remove: bool) -> None:
        """Stop serving: ``remove`` deletes the ring (its owner is gone and everything in it
        was delivered); a spill file with nothing left in it is deleted, one with
        undelivered messages kept (``commcheck analyze`` reads it)."""
        if self.closed:
            return
        self.closed = True
        if self.spill is not None:
            if self.spill.held or self.spill.pending:
                self.spill.keep()
            else:
                self.spill.discard()
        if self.sink is not None:
            self.sink.close()
        if remove:
            with contextlib.suppress(OSError):
                os.unlink(self.ring.path)
        self.ring.close()
