"""The wire codec: round trip, columnar decode, and rejection of every kind of bad input."""

from __future__ import annotations

import contextlib
import io

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commcheck.wire import (
    DUMP_MAGIC,
    HELLO,
    REC_DTYPE,
    SIDE_OUT,
    WIRE_VERSION,
    BatchBuilder,
    Chunk,
    Envelope,
    WireError,
    decode,
    encode,
    read_frames,
    write_frame,
)

from ..records import rec

pytestmark = pytest.mark.timeout(60)


def batch_bytes(n: int = 3) -> bytes:
    records = [rec(seq=i, in_shape=(2, 3), out_shape=(6,), chunks=[Chunk(SIDE_OUT, 1, 7, 8)])
               for i in range(n)]
    return encode(BatchBuilder("run-1", 1, "node0", 4, node=0).build(records, seq=5))


def test_round_trip_is_columnar_and_lossless():
    b = decode(batch_bytes())
    assert isinstance(b.records, np.ndarray) and b.records.dtype == REC_DTYPE
    assert b.records["seq"].tolist() == [0, 1, 2]
    assert b.strings[b.records["op"][0]] == "all_reduce"
    assert b.env.groups == [("0", [0, 1, 2, 3])]
    assert (b.env.run, b.env.rank, b.env.host, b.env.seq) == ("run-1", 1, "node0", 5)
    row = b.records[1]
    assert b.shape(row, 0) == (2, 3) and b.shape(row, 1) == (6,)
    c = b.chunks[row["chunk_off"]:row["chunk_off"] + row["chunk_n"]]
    assert c["index"].tolist() == [1] and c["h0"].tolist() == [7]
    assert (row["in_h0"], row["out_h0"]) == (5, 1)


def test_strings_are_interned_once_per_batch():
    b = decode(batch_bytes(50))
    assert len(b.strings) < 10


def _env(**kw) -> bytes:
    base = msgspec.structs.asdict(decode(batch_bytes()).env)
    base.update(kw)
    return encode(Envelope(**base))


@pytest.mark.parametrize("data, reason", [
    (b"", "malformed"),
    (b"\xc1garbage", "malformed"),
    (b"\x00", "bad_schema"),
    (msgspec.msgpack.encode({"v": 1}), "bad_schema"),
    (msgspec.msgpack.encode([1, 2, 3]), "bad_schema"),
    (b"x" * (65 << 20), "too_large"),
])
def test_malformed_input_is_rejected_with_a_reason(data, reason):
    with pytest.raises(WireError) as e:
        decode(data)
    assert e.value.reason == reason


@pytest.mark.parametrize("kw, reason", [
    ({"v": WIRE_VERSION + 1}, "bad_version"),
    ({"kind": "bogus"}, "bad_kind"),
    ({"kind": HELLO}, "bad_kind"),
    ({"rank": -1}, "bad_field"),
    ({"rank": 9}, "bad_field"),
    ({"world": (1 << 22) + 1}, "bad_field"),  # a world the collector would wait for
    ({"records": b"\x00" * (REC_DTYPE.itemsize - 1)}, "bad_size"),
    ({"strings": ["", "x"]}, "bad_index"),
    ({"groups": [("0", [0, 2])]}, "bad_group"),
    ({"groups": [("0", [3, 1])]}, "bad_group"),
    ({"chunks": b""}, "bad_index"),
    ({"shapes": b""}, "bad_index"),
    ({"strings": ["y" * 5000] * 8}, "bad_strings"),
])
def test_inconsistent_envelopes_are_rejected(kw, reason):
    with pytest.raises(WireError) as e:
        decode(_env(**kw))
    assert e.value.reason == reason


def test_group_checks_hold_after_a_group_was_seen_valid():
    """Valid rank lists are remembered by (name, size, first, last); a list with the same
    key but other contents, or a rank outside a remembered group, is still refused."""
    base = msgspec.structs.asdict(decode(batch_bytes()).env)
    rank = base["rank"]
    world = list(range(8))
    decode(_env(groups=[("w", world)], world=8))  # remembered
    for groups, what in (([("w", [0, 2, 1, 3, 4, 5, 6, 7])], "unsorted"),
                         ([("w", [0, 1, 1, 3, 4, 5, 6, 7])], "duplicate rank")):
        with pytest.raises(WireError) as e:
            decode(_env(groups=groups, world=8))
        assert e.value.reason == "bad_group", what
    assert rank == 1
    decode(_env(groups=[("tp", [0, 1, 2, 3])], world=8))  # remembered, rank 1 a member
    with pytest.raises(WireError) as e:
        decode(_env(groups=[("tp", [0, 1, 2, 3])], world=8, rank=5))
    assert e.value.reason == "bad_group" and "not a member" in str(e.value)


def test_wrong_type_is_a_schema_error():
    raw = msgspec.msgpack.decode(batch_bytes())
    raw["rank"] = "one"
    with pytest.raises(WireError) as e:
        decode(msgspec.msgpack.encode(raw))
    assert e.value.reason == "bad_schema"


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_truncated_or_bit_flipped_batches_never_crash_the_decoder(data):
    good = bytearray(batch_bytes())
    cut = data.draw(st.integers(0, len(good)))
    flips = data.draw(st.lists(st.integers(0, len(good) * 8 - 1), max_size=4))
    for bit in flips:
        good[bit // 8] ^= 1 << (bit % 8)
    try:
        b = decode(bytes(good[:cut]) if cut < len(good) else bytes(good))
    except WireError:
        return
    assert len(b.records) <= 3


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_are_rejected_not_raised(blob):
    with contextlib.suppress(WireError):
        decode(blob)


def test_dump_frames_round_trip_and_detect_truncation():
    f = io.BytesIO()
    f.write(DUMP_MAGIC)
    write_frame(f, batch_bytes())
    write_frame(f, batch_bytes(1))
    data = f.getvalue()
    frames = list(read_frames(io.BytesIO(data)))
    assert [len(decode(x).records) for x in frames] == [3, 1]
    with pytest.raises(WireError, match="ends inside"):
        list(read_frames(io.BytesIO(data[:-3])))
    with pytest.raises(WireError, match="magic"):
        list(read_frames(io.BytesIO(b"nope" + data)))
