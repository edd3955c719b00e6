"""The Record layout has one source, ``wire.Record``: every other place that spells it out is
checked against it field by field here — the C struct callers fill (``ccapi.h cc_record``),
the order the C writer encodes (``hot.c put_record_struct``), the ring's entry (what
``encode_record`` writes) and the batch's columns (``REC_DTYPE``)."""

from __future__ import annotations

import re
import typing
from dataclasses import fields
from pathlib import Path

import msgspec
import pytest

from commcheck import wire
from commcheck.native import hot
from commcheck.wire import REC_DTYPE, Chunk, Record
from commcheck.wire.ring import FIELD_INDEX, encode_record, layout

NATIVE = Path(__file__).resolve().parents[2] / "commcheck" / "native"
NAMES = [f.name for f in fields(Record)]

# the C type that carries each Python annotation
C_TYPE = {str: "cc_str", tuple[int, ...]: "cc_ints", int: "int64_t", float: "double",
          tuple[int, int]: "uint64_t[2]", tuple[float, float, int, int]: "cc_summary",
          list[Chunk]: "const cc_chunk *"}


def _c_struct(source: str, name: str) -> dict[str, str]:
    """member → C type of ``typedef struct { ... } name;`` (comma lists and arrays
    expanded)."""
    body = re.search(r"typedef struct \{([^}]*)\}\s*" + name + ";", source, re.S)
    assert body, name
    members: dict[str, str] = {}
    for decl in body.group(1).split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        m = re.match(r"((?:const )?\w+(?: \*)?)\s*(.*)", decl)
        ctype, names = m.group(1), m.group(2)
        for n in names.split(","):
            n = n.strip()
            arr = re.match(r"(\w+)\[(\d+)\]", n)
            if arr:
                members[arr.group(1)] = f"{ctype}[{arr.group(2)}]"
            else:
                members[n.lstrip("*")] = ctype + (" *" if n.startswith("*") else "")
    return members


def test_the_c_struct_has_every_field_with_its_type():
    hints = typing.get_type_hints(Record)
    members = _c_struct((NATIVE / "ccapi.h").read_text(), "cc_record")
    assert members.pop("n_chunks") == "size_t"  # the length of chunks
    assert set(members) == set(NAMES)
    for name in NAMES:
        assert members[name] == C_TYPE[hints[name]], name


def test_the_c_writer_encodes_the_fields_in_the_records_order():
    src = (NATIVE / "hot.c").read_text()
    body = re.search(r"static int put_record_struct\(.*?\n\}\n", src, re.S).group(0)
    seen: list[str] = []
    for m in re.finditer(r"r->(\w+)", body):
        name = "chunks" if m.group(1) in ("n_chunks", "chunks") else m.group(1)
        if not seen or seen[-1] != name:
            seen.append(name)
    assert seen == NAMES
    assert re.search(r"put_array\(b, N_FIELDS\)", body)
    assert layout()[list(layout()).index(len(NAMES))] == len(NAMES)
    assert re.search(rf"#define N_FIELDS {len(NAMES)}\b", src)


def test_the_ring_entry_is_the_fields_in_order():
    r = Record("g", (0, 1), 7, "all_reduce", "float32", redop="sum", root=1, algo="xxh3",
               callsite="t.py:1 f", flags=3, numel_in=4, numel_out=5, in_shape=(4,),
               out_shape=(5,), step=2, t_enter=1.5, t_exit=2.5, t_done=3.5, in_hash=(1, 2),
               out_hash=(3, 4), in_summary=(1.0, 2.0, 0, 1), out_summary=(3.0, 4.0, 1, 0),
               chunks=[Chunk(1, 0, 5, 6, 7.0)], phase=0, peer=3, in_splits=(1, 3),
               out_splits=(2, 3))
    values = msgspec.msgpack.decode(encode_record(r))
    assert len(values) == len(NAMES) and list(FIELD_INDEX) == NAMES
    for name, value in zip(NAMES, values, strict=True):
        want = getattr(r, name)
        if name == "chunks":
            want = [[c.side, c.index, c.h0, c.h1, c.sum] for c in want]
        elif isinstance(want, tuple):
            want = list(want)
        assert value == want, name


def test_every_batch_column_comes_from_a_record_field_and_back():
    """Each column of a batch carries one field (or a piece of one: a hash half, a summary
    part, where a variable-length field starts in its own array); together they carry every
    field (group_ranks through the batch's group table)."""
    column_of = {"group": "group_name", "shape_off": ("in_shape", "out_shape"),
                 "in_ndim": "in_shape", "out_ndim": "out_shape",
                 "in_splits_n": "in_splits", "out_splits_n": "out_splits",
                 "in_h0": "in_hash", "in_h1": "in_hash", "out_h0": "out_hash",
                 "out_h1": "out_hash", "chunk_off": "chunks", "chunk_n": "chunks",
                 **{f"{side}_{part}": f"{side}_summary" for side in ("in", "out")
                    for part in ("sum", "absmax", "nan", "inf")}}
    carried: set[str] = {"group_ranks"}
    for col in REC_DTYPE.names:
        field = column_of.get(col, col)
        for f in (field,) if isinstance(field, str) else field:
            assert f in NAMES, col
            carried.add(f)
    assert carried == set(NAMES)
    assert set(column_of) <= set(REC_DTYPE.names)


def test_the_hot_paths_entry_record_is_a_record():
    """The hot path keeps a record as the list of its values; its one builder must give what
    ``Record`` with the same fields gives."""
    from commcheck.rank.hotpath import _entry
    from commcheck.wire import PHASE_ENTRY
    from commcheck.wire.ring import record_values

    class Group:
        name, ranks = "g", (0, 1)

        def take_seq(self) -> int:
            return 41

    got = _entry(Group(), "send", "float32", "sum", 1, "t.py:1 f", 4, 0, (4,), (), 3, 1.5,
                 peer=1)
    want = Record("g", (0, 1), 41, "send", "float32", redop="sum", root=1,
                  callsite="t.py:1 f", numel_in=4, numel_out=0, in_shape=(4,), out_shape=(),
                  step=3, t_enter=1.5, phase=PHASE_ENTRY, peer=1)
    assert list(got) == list(record_values(want))


def test_express_indexes_the_fields_and_flags_as_the_wire_does():
    """native/express.c fills a record's list by index and sets flags and phases by value:
    its names for both, read from the built module, are the wire's."""
    mod = hot.module()
    if mod is None or not hasattr(mod, "Express"):
        pytest.skip("no native per-call path here (or Python < 3.11)")
    assert tuple(NAMES) == mod.RECORD_FIELDS
    assert {name: getattr(wire, name) for name in mod.WIRE} == mod.WIRE
    assert set(mod.WIRE) == {"F_IN_HASH", "F_IN_SUMMARY", "F_OUT_HASH", "F_OUT_SUMMARY",
                             "PHASE_COMPLETE", "PHASE_ENTRY", "NO_ROOT", "SIDE_IN", "SIDE_OUT"}
