"""Hand-made records for engine tests, sent through the real wire codec."""

from __future__ import annotations

from commcheck.engine import Engine
from commcheck.wire import (
    F_IN_HASH,
    F_IN_SUMMARY,
    F_OUT_HASH,
    F_OUT_SUMMARY,
    SIDE_IN,
    SIDE_OUT,
    BatchBuilder,
    Chunk,
    Record,
    decode,
    encode,
)

WORLD = (0, 1, 2, 3)


def rec(op: str = "all_reduce", seq: int = 0, out=(1, 1), inp=(5, 5), ranks=WORLD,
        **kw) -> Record:
    base = dict(group_name="0", group_ranks=ranks, seq=seq, op=op, dtype="float32",
                algo="xxh3-128", callsite="train.py:10 main", numel_in=100, numel_out=100,
                in_hash=inp, out_hash=out,
                flags=F_IN_HASH | F_IN_SUMMARY | F_OUT_HASH | F_OUT_SUMMARY)
    base.update(kw)
    return Record(**base)


def feed(engine: Engine, rank: int, records: list[Record], host: str | None = None,
         run: str = "r"):
    b = BatchBuilder(run, rank, host or f"node{rank // 2}", 4)
    return engine.ingest(decode(encode(b.build(records, seq=1))))


def feed_all(records_by_rank: dict[int, list[Record]]):
    engine = Engine(4)
    findings = []
    for rank, recs in records_by_rank.items():
        findings += feed(engine, rank, recs)
    return engine, findings


def gathered(rank: int, sent: dict[int, tuple[int, int]], recv: dict[int, tuple[int, int]],
             op: str = "all_gather", seq: int = 0) -> Record:
    chunks = [Chunk(SIDE_OUT, src, *h) for src, h in sorted(recv.items())]
    return rec(op=op, seq=seq, inp=sent[rank], out=(hash(tuple(recv.items())) & 0xFFFF, 0),
               chunks=chunks)


def scattered(rank: int, in_sums: list[float], out_sum: float, seq: int = 0) -> Record:
    chunks = [Chunk(SIDE_IN, dst, dst, rank, s) for dst, s in enumerate(in_sums)]
    return rec(op="reduce_scatter_single", seq=seq, redop="SUM", chunks=chunks,
               in_summary=(sum(in_sums), 1.0, 0, 0), out_summary=(out_sum, 1.0, 0, 0),
               out=(rank, 0))
