"""Ring files under hostile damage, read as ``commcheck analyze`` reads them (the wire
fuzzer's twin for the ring format, docs/security.md). The contract: the read ends
(bounded by the file), raises nothing but RingError when it opens the file, every message
it makes decodes, records come out once each, in order; and where the damage is in the
entries alone, exactly the entries it touched are lost: read + lost = written."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from commcheck.wire.ring import (
    ENTRY,
    HEADER_BYTES,
    JOURNAL_OFF,
    R_ACKED_OFF,
    R_NEXT_SEQ,
    R_REJECTED,
    R_RELEASED_OFF,
    R_RELEASED_SEQ,
    W_ENTRIES,
    W_RECORDS,
    W_STATE,
    W_WRITE,
    Ring,
    RingError,
)

from ..ringdamage import put, read_back, seqs, write_rings, write_wrapped

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow,
                                       HealthCheck.function_scoped_fixture])
WORDS = (W_WRITE, W_ENTRIES, W_RECORDS, W_STATE, R_RELEASED_OFF, R_RELEASED_SEQ, R_NEXT_SEQ,
         R_ACKED_OFF, R_REJECTED, 2, 3)  # 2, 3: the capacity and the pid
SLOT_WORDS = tuple(range(JOURNAL_OFF // 8, JOURNAL_OFF // 8 + 12))  # the first slots
ABSURD = st.sampled_from([0, 1, 8, 4096, 1 << 32, 1 << 40, 1 << 62, 1 << 63, (1 << 64) - 1]) \
    | st.integers(0, (1 << 64) - 1)


@dataclass(frozen=True)
class Pristine:
    raw: bytes
    spans: tuple[tuple[int, int, int], ...]  # per entry read: file offset, end, number
    seqs: tuple[int, ...]
    read: int


def pristine(path, raw: bytes) -> Pristine:
    put(path, raw)
    ring = Ring.open(str(path), writable=False)
    try:
        start, end, cap = ring.word(R_RELEASED_OFF), ring.word(W_WRITE), ring.capacity
        spans = tuple((HEADER_BYTES + e.off % cap,
                       HEADER_BYTES + e.off % cap + ENTRY.size + len(e.payload), e.number)
                      for e in ring.entries(start, end))
    finally:
        ring.close()
    damage, batches = read_back(path)
    assert damage.lost == 0 and not damage.faults and damage.read == len(spans)
    return Pristine(raw, spans, tuple(seqs(batches)), damage.read)


@pytest.fixture(scope="module")
def rings(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    two = write_rings(folder)
    wrapped, _, _ = write_wrapped(folder)
    return {"two_ranks": pristine(folder / "a.ring", two[1].raw),
            "wrapped": pristine(folder / "b.ring", wrapped)}


def read_under_contract(path, raw: bytes, p: Pristine):
    """Read ``raw`` back; check what holds whatever the damage. None if refused."""
    put(path, raw)
    t0 = time.monotonic()
    try:
        damage, batches = read_back(path)
    except RingError as e:
        assert str(path) in str(e)
        return None
    assert time.monotonic() - t0 < 10
    got = seqs(batches)  # every message decoded (read_back raises otherwise)
    assert got == sorted(set(got)) and set(got) <= set(p.seqs)
    assert damage.read <= p.read
    assert damage.line().startswith(f"{path}: ")
    return damage, got


def lost_entries(p: Pristine, raw: bytes) -> list[int]:
    """Indexes of the entries whose checked bytes ``raw`` changed or cut off."""
    a = np.frombuffer(p.raw, np.uint8)
    b = np.frombuffer(raw, np.uint8)
    diff = np.concatenate([a[:len(b)] != b, np.ones(len(a) - len(b), bool)])
    before = np.concatenate([[0], np.cumsum(diff)])
    return [i for i, (lo, hi, _) in enumerate(p.spans) if before[hi] - before[lo]]


def apply(raw: bytes, ops, cut: int | None) -> bytes:
    out = bytearray(raw)
    for kind, at, arg in ops:
        if kind == "xor":
            for i, x in enumerate(arg[:len(out) - at]):
                out[at + i] ^= x
        else:
            out[at:at + arg] = bytes(len(out[at:at + arg]))
    return bytes(out[:cut] if cut is not None else out)


def ops_in(lo: int, hi: int):
    return st.lists(st.one_of(
        st.tuples(st.just("xor"), st.integers(lo, hi - 1), st.binary(min_size=1, max_size=16)),
        st.tuples(st.just("zero"), st.integers(lo, hi - 1), st.integers(1, 8192))),
        min_size=1, max_size=6)


@pytest.mark.parametrize("which", ["two_ranks", "wrapped"])
def test_damage_in_the_entries_costs_exactly_the_entries_it_touched(rings, tmp_path, which):
    p = rings[which]

    @FUZZ
    @given(ops_in(HEADER_BYTES, len(p.raw)),
           st.none() | st.integers(HEADER_BYTES, len(p.raw)))
    def check(ops, cut) -> None:
        raw = apply(p.raw, ops, cut)
        lost = lost_entries(p, raw)
        assume(which != "wrapped" or 0 not in lost)  # the number it starts at is unknown
        damage, got = read_under_contract(tmp_path / "x.ring", raw, p)
        assert damage.lost == len(lost), (lost, damage.line())
        assert damage.read + damage.lost == p.read

    check()


@pytest.mark.parametrize("which", ["two_ranks", "wrapped"])
def test_absurd_header_words_never_hang_nor_raise(rings, tmp_path, which):
    p = rings[which]

    @FUZZ
    @given(st.lists(st.tuples(st.sampled_from(WORDS + SLOT_WORDS), ABSURD), min_size=1,
                    max_size=4),
           st.lists(st.tuples(st.just("xor"), st.integers(HEADER_BYTES, len(p.raw) - 1),
                              st.binary(min_size=1, max_size=16)), max_size=2))
    def check(words, ops) -> None:
        raw = bytearray(apply(p.raw, ops, None))
        for index, value in words:
            raw[index * 8:index * 8 + 8] = value.to_bytes(8, "little")
        got = read_under_contract(tmp_path / "x.ring", bytes(raw), p)
        if got is not None and not ops:
            damage, _ = got
            assert damage.read == p.read or damage.faults  # entries intact: lost only if said

    check()


@FUZZ
@given(st.lists(st.tuples(st.just("xor"), st.integers(0, 160_000),
                          st.binary(min_size=1, max_size=16)), min_size=1, max_size=8),
       st.none() | st.integers(0, 160_000))
def test_any_bytes_anywhere_keep_the_contract(rings, tmp_path, ops, cut):
    p = rings["two_ranks"]
    ops = [(k, min(at, len(p.raw) - 1), x) for k, at, x in ops]
    read_under_contract(tmp_path / "x.ring", apply(p.raw, ops, cut), p)


def test_a_released_offset_set_back_into_delivered_entries_reads_none_again(rings, tmp_path):
    """Found by the test above: on a ring that went round, the released offset set back to
    where its oldest bytes begin (write − capacity). The entries from there to the
    acknowledged offset are valid and of this lap, but delivered already: read again they
    would reach the collector twice. They are not read, and the fault is named."""
    p = rings["wrapped"]
    put(tmp_path / "w.ring", p.raw)
    ring = Ring.open(str(tmp_path / "w.ring"), writable=False)
    try:
        back, acked = ring.word(W_WRITE) - ring.capacity, ring.word(R_ACKED_OFF)
        assert back < acked == ring.word(R_RELEASED_OFF)
    finally:
        ring.close()
    raw = bytearray(p.raw)
    raw[R_RELEASED_OFF * 8:R_RELEASED_OFF * 8 + 8] = back.to_bytes(8, "little")
    damage, got = read_under_contract(tmp_path / "x.ring", bytes(raw), p)
    assert got == list(p.seqs) and damage.read == p.read
    assert damage.faults == [f"released offset {back} is behind the acknowledged {acked}: "
                             f"read from {acked}"]
