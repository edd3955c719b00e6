"""Hostile wire messages (hypothesis strategies) and the decoder's contract, shared by the
fuzz tests and ``launch/tools/fuzz_wire.py``.

The contract: :func:`commcheck.wire.decode` either raises :class:`WireError` (with a short
reason) or returns a batch whose every index points inside its tables. Nothing else.
"""

from __future__ import annotations

import struct

import msgspec
from hypothesis import strategies as st

from commcheck.wire import (
    GOODBYE,
    HELLO,
    MAX_STRINGS,
    REC_DTYPE,
    SIDE_IN,
    SIDE_OUT,
    WIRE_VERSION,
    Batch,
    BatchBuilder,
    Chunk,
    Envelope,
    WireError,
    decode,
    encode,
)

from .records import rec

MUTANT_RUN = "fuzz-mutant"
_FIELDS = tuple(Envelope.__struct_fields__)


def templates() -> list[bytes]:
    """Valid messages to mutate: control messages and batches with chunks, shapes, splits."""
    b = BatchBuilder(MUTANT_RUN, 1, "node0", 4, node=0)
    sub = (0, 1, 3)
    records = [
        rec(seq=0),
        rec(op="all_gather", seq=1, in_shape=(2, 3), out_shape=(8, 3),
            chunks=[Chunk(SIDE_OUT, r, r, r + 1) for r in range(4)]),
        rec(op="all_to_all_single", seq=2, ranks=sub, group_name="sub",
            in_splits=(1, 2, 3), out_splits=(3, 2, 1),
            chunks=[Chunk(SIDE_IN, r, 1, 2, 0.5) for r in sub]),
        rec(op="broadcast", seq=3, root=0, callsite="x" * 200),
    ]
    return [encode(b.build(records, seq=7, t=1.0, counters={"dropped": 2})),
            encode(b.build(records[:1], seq=8)),
            encode(b.control(HELLO, 0, 1.0, 42)),
            encode(b.control(GOODBYE, 9, 2.0, 42, counters={"records": 4}))]


TEMPLATES = templates()


@st.composite
def truncated(draw: st.DrawFn) -> bytes:
    t = draw(st.sampled_from(TEMPLATES))
    return t[:draw(st.integers(0, len(t) - 1))]


@st.composite
def bit_flipped(draw: st.DrawFn) -> bytes:
    t = bytearray(draw(st.sampled_from(TEMPLATES)))
    for bit in draw(st.lists(st.integers(0, len(t) * 8 - 1), min_size=1, max_size=8)):
        t[bit // 8] ^= 1 << (bit % 8)
    return bytes(t)


@st.composite
def wrong_version(draw: st.DrawFn) -> bytes:
    env = msgspec.msgpack.decode(draw(st.sampled_from(TEMPLATES)))
    env["v"] = draw(st.one_of(st.integers(-(2**63), 2**64 - 1).filter(lambda v: v != WIRE_VERSION),
                              st.text(max_size=4), st.none()))
    return msgspec.msgpack.encode(env)


_MSGPACK_HUGE = [  # headers that promise far more than follows
    b"\xdf\xff\xff\xff\xff",  # map32
    b"\xdd\xff\xff\xff\xff",  # array32
    b"\xc6\xff\xff\xff\xff",  # bin32
    b"\xdb\xff\xff\xff\xff",  # str32
    b"\xc9\xff\xff\xff\xff\x01",  # ext32
]


@st.composite
def huge_lengths(draw: st.DrawFn) -> bytes:
    """Length fields that lie, at the top level or inside a valid envelope."""
    which = draw(st.integers(0, 3))
    if which == 0:
        return draw(st.sampled_from(_MSGPACK_HUGE)) + draw(st.binary(max_size=64))
    env = msgspec.msgpack.decode(TEMPLATES[0])
    if which == 1:
        blob = draw(st.sampled_from(_MSGPACK_HUGE))
        head = msgspec.msgpack.encode({**env, "records": b""})
        cut = head.index(b"\xa7records") + len(b"\xa7records")
        return head[:cut] + blob + head[cut + 1:]
    if which == 2:
        env["strings"] = [""] * (MAX_STRINGS + 1)
        return msgspec.msgpack.encode(env)
    field = draw(st.sampled_from(["group", "op", "callsite", "shape_off", "chunk_off",
                                  "chunk_n"]))  # all little-endian u4
    row = draw(st.integers(0, len(env["records"]) // REC_DTYPE.itemsize - 1))
    raw = bytearray(env["records"])
    struct.pack_into("<I", raw, row * REC_DTYPE.itemsize + REC_DTYPE.fields[field][1],
                     0xFFFFFFFF)
    env["records"] = bytes(raw)
    return msgspec.msgpack.encode(env)


_ANY = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)


@st.composite
def wrong_types(draw: st.DrawFn) -> bytes:
    """Envelope fields holding values of the wrong type, or not a map at all."""
    if draw(st.booleans()):
        return msgspec.msgpack.encode(draw(_ANY))
    env = msgspec.msgpack.decode(draw(st.sampled_from(TEMPLATES)))
    for key in draw(st.lists(st.sampled_from(_FIELDS), min_size=1, max_size=3)):
        env[key] = draw(_ANY)
    return msgspec.msgpack.encode(env)


HOSTILE = {
    "random": st.binary(max_size=512),
    "truncated": truncated(),
    "bit_flipped": bit_flipped(),
    "wrong_version": wrong_version(),
    "huge_lengths": huge_lengths(),
    "wrong_types": wrong_types(),
}
hostile = st.one_of(*HOSTILE.values())


def check_batch(b: Batch) -> None:
    """Every index a decoded batch holds points inside its tables."""
    strings, groups = b.strings, b.env.groups
    for row in b.records:
        for col in ("op", "dtype", "redop", "algo", "callsite"):
            assert int(row[col]) < len(strings)
        assert int(row["group"]) < len(groups)
        assert int(row["chunk_off"]) + int(row["chunk_n"]) <= len(b.chunks)
        n = sum(int(row[c]) for c in ("in_ndim", "out_ndim", "in_splits_n", "out_splits_n"))
        assert len(b.shapes[int(row["shape_off"]):]) >= n
        b.ints(row)


def classify(data: bytes) -> Batch | WireError:
    """Decode under the contract: a WireError, or a self-consistent batch."""
    try:
        batch = decode(data)
    except WireError as e:
        assert e.reason and " " not in e.reason, e.reason
        return e
    check_batch(batch)
    return batch
