"""``commcheck bench collector``: how many records per second one collector checks.

Synthetic traffic shaped like a real job's: each rank sends entry + completion records of
all_reduce (SUM, summarised, hashed) and broadcast calls on the world group, and every
fourth call on its tensor-parallel group of 8, in batches of ``--batch`` records. Batches
are built with numpy and encoded *before* timing, in ``--senders`` processes that then
push them over ZeroMQ (loopback TCP) to a collector process running the collector's own
ingest path: ROUTER → delivery ledger (dedup, order, the ``delivered`` table) → decode →
Engine → Store → acks. With ``--mismatch P`` a fraction P of collectives has
one rank with a different output hash, so the exact path decides (and reports) them.
Each figure says what else used the CPU meanwhile: the senders' own CPU seconds (sending
pre-built bytes: ~0.07 s per million records, against the collector's ~1-2 s) and the box's
load average before and after (docs/ingest.md).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..wire import (
    CHUNK_DTYPE,
    F_IN_HASH,
    F_IN_SUMMARY,
    F_OUT_HASH,
    F_OUT_SUMMARY,
    GOODBYE,
    HELLO,
    PHASE_ENTRY,
    REC_DTYPE,
    RECORDS,
    SIDE_IN,
    SIDE_OUT,
    WIRE_VERSION,
    Envelope,
    combine_hashes,
    encode,
)

RUN = "bench"
TP, DP_STRIDE = 8, 32  # tensor-parallel groups of 8 neighbours; data-parallel every 32nd
STRINGS = ["", "all_reduce", "broadcast", "float32", "SUM", "xxh3-128", "train.py:42 step",
           "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"]
_OP_AR, _OP_BC, _DT, _SUM, _ALGO, _SITE, _OP_AG, _OP_RS, _OP_A2A = 1, 2, 3, 4, 5, 6, 7, 8, 9
NUMEL = 4096
FLAGS = F_IN_HASH | F_IN_SUMMARY | F_OUT_HASH | F_OUT_SUMMARY
# Per call of an 8-call cycle: which group it runs on (0 world, 1 TP, 2 DP).
CYCLE = np.array([1, 1, 2, 1, 1, 2, 1, 0])


@dataclass
class Plan:
    ranks: int = 1024
    records: int = 5_000_000
    batch: int = 512
    mismatch: float = 0.0
    seed: int = 0
    t0: float = 0.0  # entry times start here (the collector's hang check uses wall time)
    fsdp: bool = False  # TP-group calls alternate all_gather_into_tensor and
    # reduce_scatter_tensor (FSDP-like), not all_reduce: completion records carry one chunk
    # per member (output chunks of a gather, input chunks with their sums of a scatter)
    moe: bool = False  # TP-group calls are all_to_all_single (expert-parallel exchange):
    # one input and one output chunk per member

    @property
    def calls(self) -> int:
        """Collectives per rank (two records each: entry and completion)."""
        return max(1, self.records // (2 * self.ranks))

    @property
    def parallel(self) -> bool:
        """TP and DP groups exist (the world divides into them)."""
        return self.ranks % DP_STRIDE == 0 and self.ranks > DP_STRIDE


def _calls(plan: Plan) -> dict[str, np.ndarray]:
    """What every rank calls, in order: group kind, seq in that group, op, value."""
    k = np.arange(plan.calls)
    kind = CYCLE[k % len(CYCLE)] if plan.parallel else np.zeros(plan.calls, np.int64)
    seq = np.zeros(plan.calls, np.int64)
    for g in range(3):
        m = kind == g
        seq[m] = np.arange(int(m.sum()))
    op = np.where((kind == 0) & (seq % 2 == 1), _OP_BC, _OP_AR)
    if plan.fsdp:
        op = np.where(kind == 1, np.where(seq % 2 == 0, _OP_AG, _OP_RS), op)
    if plan.moe:
        op = np.where(kind == 1, _OP_A2A, op)
    rng = np.random.default_rng(plan.seed)
    return {"kind": kind, "seq": seq, "op": op, "value": (k % 97) / 64.0,
            "bad": rng.random(plan.calls) < plan.mismatch,
            "culprit": rng.integers(0, 1 << 30, plan.calls)}


def groups_of(plan: Plan, rank: int) -> list[tuple[str, list[int]]]:
    world = [("0", list(range(plan.ranks)))]
    if not plan.parallel:
        return world
    lo = rank // TP * TP
    return world + [(f"tp{lo // TP}", list(range(lo, lo + TP))),
                    (f"dp{rank % DP_STRIDE}", list(range(rank % DP_STRIDE, plan.ranks,
                                                         DP_STRIDE)))]


def _completions(r: np.ndarray, rank: int, calls: dict[str, np.ndarray], size: np.ndarray,
                 member: np.ndarray, gid: np.ndarray, skew: np.ndarray) -> None:
    """The completion records' fingerprints: hashes, sums and chunks as a job of this
    shape would give them, a corrupted output on ``calls["bad"]`` rows' culprit."""
    seq, op = calls["seq"], calls["op"]
    r["algo"] = _ALGO
    r["t_exit"] = r["t_done"] = r["t_enter"] + 1e-4
    r["flags"] = np.where((op == _OP_BC) & (rank != 0),
                          FLAGS & ~(F_IN_HASH | F_IN_SUMMARY), FLAGS)
    h = (seq.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ gid
    bad = calls["bad"] & (calls["culprit"] % size == member)
    r["out_h0"] = h ^ bad.astype(np.uint64)
    r["out_h1"] = h >> np.uint64(7)
    r["in_h0"] = rank
    v = calls["value"] + ((rank % 16) - 7.5) / 1024
    r["in_sum"] = v
    r["in_absmax"] = 1.0
    r["out_sum"] = np.where(op == _OP_AR, calls["value"] * size + skew, v)
    r["out_absmax"] = 1.0
    ag = op == _OP_AG
    if ag.any():  # the output is the members' inputs in group order, one chunk each
        lo = rank // TP * TP
        out_h = combine_hashes([(src, 0) for src in range(lo, lo + TP)])
        r["flags"] = np.where(ag, F_IN_HASH | F_OUT_HASH, r["flags"])
        r["out_h0"] = np.where(ag, np.uint64(out_h[0]) ^ bad.astype(np.uint64),
                               r["out_h0"])
        r["out_h1"] = np.where(ag, np.uint64(out_h[1]), r["out_h1"])
    rs = op == _OP_RS
    if rs.any():  # rank p sends (p % 16 - 7.5) / 1024 + k / 256 to the k-th member
        lo, k = rank // TP * TP, rank % TP
        sent = TP * ((rank % 16) - 7.5) / 1024 + TP * (TP - 1) / 2 / 256
        got = sum((p % 16) - 7.5 for p in range(lo, lo + TP)) / 1024 + TP * k / 256
        r["flags"] = np.where(rs, F_IN_SUMMARY | F_OUT_HASH | F_OUT_SUMMARY, r["flags"])
        r["in_sum"] = np.where(rs, sent, r["in_sum"])
        r["out_sum"] = np.where(rs, got + bad, r["out_sum"])
    a2a = op == _OP_A2A
    if a2a.any():  # rank p sends (p << 16 | d, 0) to d
        lo = rank // TP * TP
        group = range(lo, lo + TP)
        in_h = combine_hashes([(rank << 16 | d, 0) for d in group])
        out_h = combine_hashes([(s << 16 | rank, 0) for s in group])
        r["flags"] = np.where(a2a, F_IN_HASH | F_OUT_HASH, r["flags"])
        r["in_h0"] = np.where(a2a, np.uint64(in_h[0]), r["in_h0"])
        r["in_h1"] = np.where(a2a, np.uint64(in_h[1]), r["in_h1"])
        r["out_h0"] = np.where(a2a, np.uint64(out_h[0]), r["out_h0"])
        r["out_h1"] = np.where(a2a, np.uint64(out_h[1]), r["out_h1"])


def _rows(plan: Plan, rank: int, calls: dict[str, np.ndarray]) -> np.ndarray:
    """The rank's records, entry and completion of each call, as a job would write them."""
    n, t0 = plan.calls, plan.t0
    kind, seq, op = calls["kind"], calls["seq"], calls["op"]
    size = np.array([plan.ranks, TP, plan.ranks // DP_STRIDE])[kind]
    member = np.array([rank, rank % TP, rank // DP_STRIDE])[kind]
    gid = np.array([0, 1 + rank // TP, 1 << 20 | rank % DP_STRIDE], np.uint64)[kind]
    # Dyadic values: every member's sum and the reduced sum are exact in float64.
    skew = np.array([0.0, -32.0 if (rank // TP) % 2 == 0 else 32.0,
                     plan.ranks // DP_STRIDE * ((rank % 16) - 7.5)])[kind] / 1024
    rec = np.zeros(2 * n, REC_DTYPE)
    for phase, sl in ((PHASE_ENTRY, slice(0, None, 2)), (0, slice(1, None, 2))):
        r = rec[sl]
        r["group"] = kind
        r["seq"] = seq
        r["op"] = op
        r["dtype"] = _DT
        r["redop"] = np.where((op == _OP_AR) | (op == _OP_RS), _SUM, 0)
        r["callsite"] = _SITE
        r["root"] = np.where(op == _OP_BC, 0, -1)
        r["numel_in"] = np.where(op == _OP_RS, NUMEL * TP, NUMEL)
        r["numel_out"] = np.where(op == _OP_AG, NUMEL * TP, NUMEL)
        r["phase"] = phase
        r["peer"] = -1
        r["in_ndim"] = r["out_ndim"] = 1
        r["step"] = np.arange(n) // 64
        r["t_enter"] = t0 + np.arange(n) * 1e-3 + rank * 1e-7
        if phase != PHASE_ENTRY:
            _completions(r, rank, calls, size, member, gid, skew)
    return rec


def rank_batches(plan: Plan, rank: int, calls: dict[str, np.ndarray]) -> list[bytes]:
    """Hello, the rank's record batches, goodbye — encoded."""
    n, t0 = plan.calls, plan.t0
    rec = _rows(plan, rank, calls)
    rec["shape_off"] = 2 * (np.arange(2 * n) % plan.batch)
    chunked = np.isin(rec["op"], [_OP_AG, _OP_RS, _OP_A2A]) & (rec["phase"] != PHASE_ENTRY)
    lo = rank // TP * TP
    chunk_rows = np.zeros((2, TP), CHUNK_DTYPE)  # an all_gather's, a reduce_scatter's
    chunk_rows["side"] = [[SIDE_OUT], [SIDE_IN]]
    chunk_rows["index"] = np.arange(lo, lo + TP)
    chunk_rows["h0"][0] = np.arange(lo, lo + TP)
    chunk_rows["sum"][1] = ((rank % 16) - 7.5) / 1024 + np.arange(TP) / 256
    a2a_rows = np.zeros(2 * TP, CHUNK_DTYPE)  # an all_to_all's: inputs, then outputs
    a2a_rows["side"] = [SIDE_IN] * TP + [SIDE_OUT] * TP
    a2a_rows["index"] = np.tile(np.arange(lo, lo + TP), 2)
    a2a_rows["h0"] = [rank << 16 | d for d in range(lo, lo + TP)] + \
        [s << 16 | rank for s in range(lo, lo + TP)]
    groups = groups_of(plan, rank)
    host = f"node{rank // 8}"

    def env(kind: str, seq: int, **kw) -> bytes:
        return encode(Envelope(v=WIRE_VERSION, kind=kind, run=RUN, rank=rank, host=host,
                               seq=seq, world=plan.ranks, t=t0 + seq, **kw))

    out = [env(HELLO, 0)]
    for b, i in enumerate(range(0, len(rec), plan.batch)):
        part = rec[i:i + plan.batch].copy()
        shapes = np.full(2 * len(part), NUMEL, "<i8")
        g = chunked[i:i + plan.batch]
        if plan.moe:
            part["chunk_n"] = np.where(g, 2 * TP, 0)
            part["chunk_off"] = np.where(g, (np.cumsum(g) - 1) * 2 * TP, 0)
            chunks = np.tile(a2a_rows, int(g.sum()))
        else:
            part["chunk_n"] = np.where(g, TP, 0)
            part["chunk_off"] = np.where(g, (np.cumsum(g) - 1) * TP, 0)
            chunks = chunk_rows[(part["op"][g] == _OP_RS).astype(np.int64)].reshape(-1)
        out.append(env(RECORDS, b + 1, strings=STRINGS, groups=groups,
                       records=part.tobytes(), shapes=shapes.tobytes(),
                       chunks=chunks.tobytes(),
                       counters={"records": i + len(part), "dropped": 0}))
    out.append(env(GOODBYE, len(out), counters={"records": len(rec), "dropped": 0}))
    return out


def interleave(per_rank: list[list[bytes]]) -> list[bytes]:
    """Round-robin over ranks, one batch each: ranks advance in lockstep, as in a job."""
    out = []
    for i in range(max(map(len, per_rank), default=0)):
        out.extend(p[i] for p in per_rank if i < len(p))
    return out


def build(plan: Plan, ranks: list[int]) -> list[bytes]:
    calls = _calls(plan)
    return interleave([rank_batches(plan, r, calls) for r in ranks])


def expected_records(plan: Plan) -> int:
    return plan.ranks * plan.calls * 2


# -- processes ----------------------------------------------------------------------------------


@dataclass
class Result:
    mode: str
    records: int
    seconds: float
    rate: float
    rss_mib: float
    window_mib: float
    verified: int
    findings: int
    unmatched: int
    cpu_rate: float = 0.0  # records per CPU-second of the collector (less noisy on a
    extra: dict = field(default_factory=dict)  # shared box than the wall-clock rate)
    thread_rate: float = 0.0  # per CPU-second of its main thread (libzmq's I/O thread and
    # the shards are other threads and processes)

    def line(self) -> str:
        box = self.extra.get("box")
        return (f"{self.mode}: {self.records:,} records in {self.seconds:.2f} s = "
                f"{self.rate:,.0f} records/s ({self.cpu_rate:,.0f} per CPU-second"
                + (f", {self.thread_rate:,.0f} per main-thread CPU-second"
                   if self.thread_rate else "") + "); "
                f"peak RSS {self.rss_mib:,.0f} MiB (open window "
                f"{self.window_mib:,.1f} MiB); {self.verified:,} collectives verified, "
                f"{self.findings:,} findings, {self.unmatched:,} unmatched"
                + (f"; {box}" if box else ""))


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _sender(plan: Plan, ranks: list[int], endpoint: str, ready, go) -> None:
    """A DEALER like a rank's: it closes once the collector acknowledged every message (a
    socket closed with acks unread resets the connection, and the peer's kernel discards
    what it had not read yet). Nothing is resent: the bench measures the collector."""
    import zmq

    from ..wire.acks import decode_acks

    msgs = build(plan, ranks)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 256)
    sock.connect(endpoint)
    ready.put(len(msgs))
    go.wait()
    cpu0 = time.process_time()
    acked = 0
    for m in msgs:
        sock.send(m, copy=False)
        while sock.poll(0):
            acked += len(decode_acks(sock.recv()))
    deadline = time.monotonic() + 120
    while acked < len(msgs) and time.monotonic() < deadline:
        if sock.poll(200):
            acked += len(decode_acks(sock.recv()))
    ready.put(time.process_time() - cpu0)  # its sending's CPU, libzmq's I/O thread included
    sock.close(linger=-1)
    ctx.term()


def _collector(plan: Plan, records_mode: str, db: str, shards: int, endpoint_q, result_q,
               burst: int, straggler: str = "") -> None:
    """The collector's own ingest path (ROUTER socket, delivery ledger, engine, store, acks)
    behind a real socket; timed from the first to the last batch."""
    import io

    import zmq
    from rich.console import Console

    from .daemon import Collector, CollectorOptions
    from .pipeline import tune_process

    tune_process()  # as Collector.run does
    col = Collector(CollectorOptions(bind="tcp://127.0.0.1:*", world_size=plan.ranks, db=db,
                                     records=records_mode, shards=shards, live=False,
                                     hang_timeout=3600.0, straggler=straggler),
                    console=Console(file=io.StringIO()))
    rx, pipe = col.receiver, col.pipeline
    # Queue at most a few hundred batches per sender in this process: the Receiver's bound
    # (10,000 messages per connection) would let the senders park ~1 GiB of pushed-ahead
    # batches here and swamp the RSS figure. The bound applies to pipes created after it is
    # set, so rebind before any sender connects.
    rx.sock.unbind(rx.endpoint)
    rx.sock.setsockopt(zmq.RCVHWM, 256)
    for _ in range(200):  # unbinding completes asynchronously in libzmq's I/O thread
        try:
            rx.sock.bind(rx.endpoint)
            break
        except zmq.ZMQError:
            time.sleep(0.01)
    else:
        rx.sock.bind(rx.endpoint)
    endpoint_q.put(rx.endpoint)
    t_first = t_last = cpu_first = cpu_last = th_first = th_last = 0.0
    while True:
        got = rx.recv_from(200)
        if got is None:
            if pipe.engine.done:
                break
            continue
        msgs = [got]
        while len(msgs) < burst and (got := rx.recv_from(0)) is not None:
            msgs.append(got)
        if not t_first:
            t_first, cpu_first = time.perf_counter(), time.process_time()
            th_first = time.thread_time()
        col.ingest(msgs)
        t_last, cpu_last, th_last = time.perf_counter(), time.process_time(), time.thread_time()
        col.maintain(time.monotonic())
        if pipe.engine.done:
            break
    t0 = time.perf_counter()
    pipe.close_run(time.time())
    pipe.persist()
    t_close = time.perf_counter() - t0
    col.ledger.send_acks(rx.ack)
    counters = pipe.counters()
    fast = pipe.engine.fast
    window = counters.pop("window_bytes", fast.nbytes if fast else 0) / 2**20
    pipe.stop()
    pipe.store.close()
    rx.close(linger=5.0)
    secs = max(t_last - t_first, 1e-9)
    result_q.put(Result(
        f"collector (zmq, {shards} shard{'s' * (shards > 1)}, records={records_mode})",
        counters["records"], secs, counters["records"] / secs, _rss_mib(), window,
        counters["verified"], counters["findings"], counters["unmatched"],
        counters["records"] / max(cpu_last - cpu_first, 1e-9), {"close_s": round(t_close, 3)},
        counters["records"] / max(th_last - th_first, 1e-9)))


def run_collector(plan: Plan, senders: int = 2, records_mode: str = "file",
                  shards: int = 1, burst: int = 64, db: str = "",
                  straggler: str = "") -> Result:
    """Spawned sender processes push pre-encoded batches to a spawned collector
    (``straggler``: its StragglerRules spec, "off" to time no arrivals)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="commcheck-bench-") as tmp:
        path = db or str(Path(tmp) / "bench.db")
        endpoint_q, result_q = ctx.Queue(), ctx.Queue()
        col = ctx.Process(target=_collector, args=(plan, records_mode, path, shards,
                                                   endpoint_q, result_q, burst, straggler))
        col.start()
        endpoint = endpoint_q.get(timeout=60)
        ready, go = ctx.Queue(), ctx.Event()
        parts = [list(range(plan.ranks))[k::senders] for k in range(senders)]
        procs = [ctx.Process(target=_sender, args=(plan, p, endpoint, ready, go))
                 for p in parts if p]
        for p in procs:
            p.start()
        for _ in procs:
            ready.get(timeout=600)
        load0 = os.getloadavg()[0]
        go.set()
        result = result_q.get(timeout=3600)
        senders_cpu = sum(ready.get(timeout=120) for _ in procs)
        for p in (*procs, col):
            p.join(timeout=60)
        # What else ran: the senders only send pre-built bytes (their CPU, against the
        # collector's), and the box's 1-minute load before and after (other processes).
        result.extra["box"] = (f"senders {senders_cpu:.2f} CPU-s; load "
                               f"{load0:.2f} -> {os.getloadavg()[0]:.2f}")
        return result


def run_in_process(plan: Plan, records_mode: str = "none", burst: int = 64,
                   fast: bool = True) -> Result:
    """Decode + engine + store on pre-encoded batches, no sockets: the pipeline's ceiling."""
    from ..engine import Engine
    from .pipeline import Pipeline
    from .store import Store

    msgs = build(plan, list(range(plan.ranks)))
    with tempfile.TemporaryDirectory(prefix="commcheck-bench-") as tmp:
        pipe = Pipeline(Engine(plan.ranks, fast=fast),
                        Store.create(Path(tmp) / "bench.db", records_mode))
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(0, len(msgs), burst):
            pipe.feed_many(msgs[i:i + burst])
        secs, cpu = time.perf_counter() - t0, time.process_time() - c0
        pipe.close_run(time.time())
        counters = pipe.counters()
        e = pipe.engine
        window = e.fast.nbytes / 2**20 if e.fast else 0.0
        pipe.store.close()
    return Result(f"in-process ({'fast' if fast else 'exact'} engine, records={records_mode})",
                  counters["records"], secs, counters["records"] / secs, _rss_mib(), window,
                  counters["verified"], counters["findings"], counters["unmatched"],
                  counters["records"] / cpu)


def summary(results: list[Result]) -> str:
    rates = [r.rate for r in results]
    return (f"median {statistics.median(rates):,.0f} records/s over {len(rates)} runs "
            f"(min {min(rates):,.0f}, max {max(rates):,.0f})")
