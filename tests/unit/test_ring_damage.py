"""Damaged rings cost only their damaged entries (docs/security.md): real rings of a
two-rank world (each rank's own writer, 208 records), damaged on purpose (16 bytes
flipped, 4 KiB zeroed, cut short, absurd header words), read back as ``commcheck analyze``
reads them, with the exact counts each damage must cost; then through the CLI, and the
relay's reading of a live ring."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from commcheck.cli import main
from commcheck.wire.ring import (
    HEADER_BYTES,
    JOURNAL_OFF,
    R_NEXT_SEQ,
    R_REJECTED,
    R_RELEASED_OFF,
    SLOT,
    W_WRITE,
    RingError,
)

from ..ringdamage import ENTRIES, RECORDS_PER_RANK, put, read_back, said_goodbye, seqs, write_rings
from .test_ring import FakeLink, channel, writer
from .test_ring import put as put_records
from .test_ring import seqs as sent_seqs

pytestmark = pytest.mark.timeout(60)

CAPACITY_OFF = 16  # the static header's capacity field


@pytest.fixture(scope="module")
def rings(tmp_path_factory):
    return write_rings(tmp_path_factory.mktemp("pristine"))


def flip(raw: bytearray, at: int, n: int = 16) -> bytearray:
    for i in range(at, at + n):
        raw[i] ^= 0xA5
    return raw


def word(raw: bytearray, index: int, value: int) -> bytearray:
    struct.pack_into("<Q", raw, index * 8, value)
    return raw


def damaged(tmp_path, w, raw: bytes):
    """Read back a damaged copy of ``w``: (damage, batches), bounded in time."""
    t0 = time.monotonic()
    got = read_back(put(tmp_path / w.name, raw))
    assert time.monotonic() - t0 < 10
    return got


def expect(damage, batches, lost: list[int]) -> None:
    """Exactly the entries ``lost`` are lost, every other one read, in order."""
    assert damage.lost == len(lost), damage.line()
    assert damage.read == ENTRIES - len(lost), damage.line()
    assert damage.read + damage.lost == ENTRIES
    kept = [n - 1 for n in range(1, RECORDS_PER_RANK + 1) if n not in lost]
    assert seqs(batches) == kept  # record seq k is entry k + 1
    assert said_goodbye(batches)  # read, or said from the header when its entry is lost


# -- 16 bytes flipped, 4 KiB zeroed -----------------------------------------------------------

FLIPS = {  # where, as (entry, bytes into it)
    "hello's head": (0, 0),
    "a record's head": (51, 0),
    "a record's payload": (101, 40),
    "across two records": (152, -8),
    "the goodbye's payload": (209, 24),
}


@pytest.mark.parametrize("where", sorted(FLIPS))
def test_16_flipped_bytes_cost_the_entries_they_hit(rings, tmp_path, where):
    w = rings[1]
    entry, into = FLIPS[where]
    at = w.at(entry) + into
    lost = w.hit(at - HEADER_BYTES, at - HEADER_BYTES + 16)
    assert 1 <= len(lost) <= 2
    damage, batches = damaged(tmp_path, w, flip(bytearray(w.raw), at))
    expect(damage, batches, lost)
    assert damage.stretches == 1 and not damage.faults


def test_4k_zeroed_costs_the_entries_inside_and_the_rest_is_read(rings, tmp_path):
    w = rings[1]
    raw = bytearray(w.raw)
    raw[HEADER_BYTES + 8192:HEADER_BYTES + 12288] = bytes(4096)
    lost = w.hit(8192, 12288)
    assert len(lost) == 27  # about 150 bytes a record
    damage, batches = damaged(tmp_path, w, raw)
    expect(damage, batches, lost)


def test_a_flipped_length_reads_as_damage_not_as_a_huge_entry(rings, tmp_path):
    w = rings[1]
    raw = bytearray(w.raw)
    struct.pack_into("<I", raw, w.at(101) + 4, 0xFFFFFFFF)  # the head's payload length
    damage, batches = damaged(tmp_path, w, raw)
    expect(damage, batches, [101])
    assert "bad length" in damage.line()


# -- cut short --------------------------------------------------------------------------------


@pytest.mark.parametrize(("cut", "why"), [
    (100, "too small for a ring (100 bytes)"),
    (50000, "cut short at 50000 bytes, inside its 86016-byte header: none of its 210 "
            "entries are left"),
])
def test_a_ring_cut_inside_its_header_is_refused_with_path_and_reason(rings, tmp_path, cut,
                                                                      why):
    w = rings[1]
    path = put(tmp_path / w.name, w.raw[:cut])
    with pytest.raises(RingError) as e:
        read_back(path)
    assert str(e.value) == f"{path}: {why}"


@pytest.mark.parametrize(("entry", "into"), [(101, 0), (101, 30), (209, 0), (209, 8), (1, 0)])
def test_a_ring_cut_short_keeps_every_entry_before_the_cut(rings, tmp_path, entry, into):
    """At an entry's start, inside its head, before the goodbye, before the first record."""
    w = rings[1]
    damage, batches = damaged(tmp_path, w, w.raw[:w.at(entry) + into])
    expect(damage, batches, list(range(entry, ENTRIES)))
    assert damage.faults == [f"cut short: {w.at(entry) + into - HEADER_BYTES} of its 65536 "
                             f"data bytes left"]


# -- absurd header words ----------------------------------------------------------------------


@pytest.mark.parametrize(("index", "value", "fault"), [
    (W_WRITE, 1 << 40, "header offsets do not fit (released 0, write 1099511627776"),
    (W_WRITE, (1 << 64) - 1, "header offsets do not fit (released 0, write 18446744073709551615"),
    (R_RELEASED_OFF, 1 << 40, "header offsets do not fit (released 1099511627776"),
    (R_NEXT_SEQ, 1 << 40, "journal words do not fit (released seq 0, next seq 1099511627776)"),
    (CAPACITY_OFF // 8, 1 << 60, "capacity field 1152921504606846976 does not fit the file"),
    (CAPACITY_OFF // 8, 12345, "capacity field 12345 does not fit the file"),
])
def test_absurd_header_words_are_named_and_every_entry_still_read(rings, tmp_path, index,
                                                                  value, fault):
    w = rings[1]
    damage, batches = damaged(tmp_path, w, word(bytearray(w.raw), index, value))
    expect(damage, batches, [])
    assert len(damage.faults) == 1 and damage.faults[0].startswith(fault), damage.faults


def test_16_flipped_header_bytes_over_the_write_offset_and_count(rings, tmp_path):
    w = rings[1]
    raw = flip(bytearray(w.raw), W_WRITE * 8)  # the write offset and the entries written
    raw = flip(raw, w.at(101) + 40)  # and a record
    damage, batches = damaged(tmp_path, w, raw)
    expect(damage, batches, [101])
    assert len(damage.faults) == 1


def test_an_absurd_capacity_in_a_file_cut_short_is_refused(rings, tmp_path):
    w = rings[1]
    raw = word(bytearray(w.raw), CAPACITY_OFF // 8, 1 << 60)[:HEADER_BYTES + 5000]
    with pytest.raises(RingError, match="ring of 1152921504606846976 bytes in a 91016-byte"):
        read_back(put(tmp_path / w.name, bytes(raw)))


# -- through `commcheck analyze` --------------------------------------------------------------


def analyze(capsys, tmp_path, rings, rank1: bytes, text: bool = False):
    for rank, w in rings.items():
        put(tmp_path / "rings" / w.name, rank1 if rank == 1 else w.raw)
    t0 = time.monotonic()
    rc = main(["analyze", str(tmp_path / "rings"), *([] if text else ["--json"])])
    assert time.monotonic() - t0 < 20
    out, err = capsys.readouterr()
    return rc, out if text else json.loads(out)["summary"], err.strip().splitlines()


def test_analyze_says_damaged_not_dropped_and_names_the_file(rings, tmp_path, capsys):
    w = rings[1]
    raw = bytes(flip(bytearray(w.raw), w.at(101) + 40))
    rc, s, err = analyze(capsys, tmp_path, rings, raw)
    assert rc == 0 and s["findings"] == 0
    assert s["records"] == 2 * RECORDS_PER_RANK - 1 and s["verified"] == RECORDS_PER_RANK - 1
    assert s["rejected"] == {"damaged": 1}
    assert s["not_verified"] == s["not_verified_lost"] == 1
    assert s["not_verified_lost_by_rank"] == {"1": 1} and not s.get("not_verified_by_rank")
    path = tmp_path / "rings" / w.name
    assert err == [f"commcheck: warning: {path}: 1 damaged entries skipped, 209 read "
                   f"(offset {w.spans[101][0]}: bad checksum, 1 lost)"]
    rc, out, _ = analyze(capsys, tmp_path, rings, raw, text=True)
    assert "1 collectives not verified: records lost (damaged or rejected, not dropped) on " \
           "rank 1" in out
    assert "1 ring entries lost to damage" in out and "dropped on" not in out


def test_analyze_keeps_what_lies_before_a_cut(rings, tmp_path, capsys):
    """Before: "1 messages rejected (bad_file)", all 208 of rank 1's records lost, a
    missing_rank blaming it."""
    w = rings[1]
    rc, s, err = analyze(capsys, tmp_path, rings, w.raw[:w.at(101) + 30])
    # no finding; 108 of 208 collectives unverified is too little to call it clean
    assert rc == 5 and s["findings"] == 0 and s["unverified_share"] == 0.5192, s
    assert s["records"] == RECORDS_PER_RANK + 100 and s["verified"] == 100
    assert s["rejected"] == {"damaged": 109, "damaged_file": 1}
    assert s["not_verified_lost"] == 108 and s["ranks_said_goodbye"] == 2
    assert len(err) == 1 and str(tmp_path / "rings" / w.name) in err[0]
    assert "109 lost" in err[0] and "cut short" in err[0]


def test_analyze_names_a_ring_it_cannot_read(rings, tmp_path, capsys):
    w = rings[1]
    rc, s, err = analyze(capsys, tmp_path, rings, w.raw[:50000])
    assert s["rejected"] == {"bad_file": 1} and s["records"] == RECORDS_PER_RANK
    assert rc == 3  # rank 1 never reported: its whole ring is gone
    assert err == [f"commcheck: warning: {tmp_path / 'rings' / w.name}: cut short at 50000 "
                   f"bytes, inside its 86016-byte header: none of its 210 entries are left "
                   f"(bad_file)"]


def test_analyze_ends_on_a_write_offset_of_2_to_the_40(rings, tmp_path, capsys):
    """Before: ran forever."""
    w = rings[1]
    rc, s, err = analyze(capsys, tmp_path, rings, bytes(word(bytearray(w.raw), W_WRITE,
                                                             1 << 40)))
    assert rc == 0 and s["records"] == 2 * RECORDS_PER_RANK and s["findings"] == 0
    assert s["rejected"] == {"damaged_file": 1} and len(err) == 1


# -- the relay, reading a live ring -----------------------------------------------------------


def test_the_relay_counts_the_entries_a_stretch_cost(tmp_path):
    w = writer(tmp_path)
    put_records(w, 0, 3)
    start = w._write
    put_records(w, 3, 3)
    end = w._write
    put_records(w, 6, 2)
    w.ring.mm[HEADER_BYTES + start:HEADER_BYTES + end] = bytes(end - start)  # 3 records
    link = FakeLink()
    ch = channel(w, link)
    ch.poll(time.monotonic(), owner_gone=True)
    ch.pump(time.monotonic())
    assert ch.ring.word(R_REJECTED) == 3  # was 1 a stretch
    assert sent_seqs(link.envelopes()) == [0, 1, 2, 6, 7]
    ch.close(remove=False)
    w.close(linger=0)


def test_the_relay_reads_no_further_than_a_ring_past_a_damaged_write_offset(tmp_path):
    w = writer(tmp_path)
    put_records(w, 0, 5)
    w.ring.words[W_WRITE] = 1 << 40
    link = FakeLink()
    ch = channel(w, link)
    t0 = time.monotonic()
    ch.poll(time.monotonic(), owner_gone=True)
    ch.pump(time.monotonic())
    assert time.monotonic() - t0 < 5
    assert sent_seqs(link.envelopes()) == [0, 1, 2, 3, 4]
    assert ch.ring.word(R_REJECTED) == 0  # the space past the last entry was never written
    ch.close(remove=False)
    w.close(linger=0)


def test_a_damaged_journal_slot_costs_its_messages_names_not_their_records(tmp_path):
    """Journaled messages the collector never acknowledged keep their names (a database
    that has them skips them); one whose slot is damaged is read under a new name."""
    w = writer(tmp_path)
    put_records(w, 0, 30)
    ch = channel(w, FakeLink())  # never acknowledges: the messages stay journaled
    ch.poll(time.monotonic(), owner_gone=True)
    journaled = ch.next_seq
    assert journaled == 3  # hello, 20 records, 10 records
    ch.close(remove=False)
    put_records(w, 30, 5)
    w.close(linger=0)
    raw = bytearray(Path(w.path).read_bytes())
    _, clean = read_back(put(tmp_path / "clean.ring", bytes(raw)))
    assert [b.env.seq for b in clean] == [0, 1, 2, 3, 4]  # 3 journaled, then 5 records, bye
    struct.pack_into("<Q", raw, JOURNAL_OFF + SLOT.size, 99)  # slot of message 1: not it
    damage, batches = read_back(put(tmp_path / "slot.ring", bytes(raw)))
    assert seqs(batches) == list(range(35)) and damage.lost == 0
    assert damage.faults == ["1 journal slots unreadable (message 1 the first): their "
                             "entries named anew"]
    assert [b.env.seq for b in batches] == [0, 3, 2, 4, 5]  # message 1's records as 3
