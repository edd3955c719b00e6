"""The relay lets a stream of entries gather in the ring (at most the flush interval) and
then reads it whole; a goodbye and a large backlog it reads at the first look
(docs/startup.md). Times are handed to ``poll``, so nothing here waits."""

from __future__ import annotations

from commcheck.relay.channel import Channel
from commcheck.wire import GOODBYE, HELLO, RECORDS
from commcheck.wire.relay_settings import RelaySettings
from commcheck.wire.ring import Ring

from .test_ring import FakeLink, put, seqs, writer


def serve(w, flush_interval: float) -> tuple[Channel, FakeLink]:
    link = FakeLink()
    settings = RelaySettings(batch_records=512, flush_interval=flush_interval)
    return Channel(Ring.open(w.path), settings, link), link


def test_a_stream_gathers_for_the_flush_interval_then_goes_in_one_message(tmp_path):
    w = writer(tmp_path, capacity=1 << 20)
    ch, link = serve(w, flush_interval=10.0)
    put(w, 0, 5)
    assert ch.poll(100.0) == 0 and ch.poll(109.9) == 0  # hello and 5 records gather
    assert ch.poll(110.0) == 6  # then all of them, and the batch is cut at once
    ch.pump(110.0)
    envs = link.envelopes()
    assert [e.kind for e in envs] == [HELLO, RECORDS] and seqs(envs) == list(range(5))
    put(w, 5, 2)  # the next stream gathers from when it is first seen
    assert ch.poll(200.0) == 0 and ch.poll(210.0) == 2
    ch.pump(210.0)  # (the first message, unacknowledged for 100 s, is sent again)
    assert sorted(set(seqs(link.envelopes()))) == list(range(7))
    ch.close(remove=False)
    w.close(linger=0)


def test_a_backlog_and_a_goodbye_are_read_at_the_first_look(tmp_path):
    w = writer(tmp_path, capacity=1 << 20)
    ch, link = serve(w, flush_interval=3600.0)
    put(w, 0, 2000)  # well over 64 KiB unread
    assert ch.poll(0.0) > 0
    w.close(linger=0)  # the goodbye: the rank's state word leaves "running"
    ch.poll(0.0)
    ch.pump(0.0)
    assert ch.goodbye and link.envelopes()[-1].kind == GOODBYE
    assert seqs(link.envelopes()) == list(range(2000))
    ch.close(remove=True)
