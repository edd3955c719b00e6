"""Past one core: a router and K engine processes (``commcheck collect --shards K``).

The router (the collector's own process) receives and validates every message, keeps the
per-rank bookkeeping and the database, and sends each batch's records to the shard that
owns their group: a key's records always meet in one shard, and so does every key of a
group, so per-group state (NaN and divergence onsets, desync, hangs) is exactly the one
engine's. Probe groups (``grad:<name>``, ``param:<name>``) are routed by replica set
rather than name, since their NaN onset is shared by every parameter of a replica set.
Hello/goodbye go to every shard (missing_rank says whether a rank said goodbye).

What differs from one engine: a missing_rank finding's ``last`` entry of a silent rank is
the last one *its shard* saw (the rank's latest collective among that shard's groups).
Shards report findings as they decide them; the router stores them in the one database,
so ``commcheck report`` reads a sharded run like any other. At every commit the router
asks each shard for its engine's snapshot (after the batches routed so far) and commits
them with its own (rank books) and the findings they reported; a collector restarted on the
database hands each shard its part back (:meth:`ShardedPipeline.resume`), so it must run
with the same ``--shards``.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import zlib
from collections import Counter
from collections.abc import Callable

import msgspec
import numpy as np
import zmq

from ..engine import DEFAULT_HANG_TIMEOUT, Engine, Finding, Kind, Liveness
from ..engine.stragglers import StragglerRules
from ..wire import RECORDS, Batch, Decoded, WireError, decode, encode
from . import snapshot
from .pipeline import PipelineBase, tune_process
from .shard_stragglers import ShardStragglers
from .store import Store

_BATCH, _HANGS, _FINISH, _SNAP, _RESUME = b"B", b"H", b"F", b"S", b"U"
SNAPSHOT_TIMEOUT_S = 120.0
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()
PROBE_PREFIXES = ("grad:", "param:")


def shard_of(run: str, name: str, ranks: list[int], k: int) -> int:
    """Stable shard of a group identity (probe groups: of their replica set)."""
    ident = f"{run}\0{ranks}" if name.startswith(PROBE_PREFIXES) else \
        f"{run}\0{name}\0{ranks}"
    return zlib.crc32(ident.encode()) % k


class ShardedPipeline(PipelineBase):
    """The pipeline interface over K shard processes; the local engine only keeps the books
    (ranks, runs, done) and is fed envelopes without records, the shards decide. Every
    method that would feed an engine or ask it for verdicts is this class's own."""

    def __init__(self, k: int, store: Store, world_size: int = 0,
                 hang_timeout: float = DEFAULT_HANG_TIMEOUT,
                 on_finding: Callable[[Finding], None] | None = None,
                 on_reject: Callable[[WireError], None] | None = None, straggler: str = ""):
        """``straggler``: the shards' engines' StragglerRules spec (each judges its own
        groups' windows)."""
        super().__init__(Engine(world_size, hang_timeout), store, on_finding, on_reject)
        self.k = k
        self.shard_counters: list[dict[str, int]] = [{} for _ in range(k)]
        self._snaps: dict[int, bytes] = {}
        self._finished = False  # close_run ended the shard processes
        self._onsets: dict[tuple, Finding] = {}
        self._stragglers = ShardStragglers()  # one finding per episode, whichever shards
        self._routes: dict[tuple[str, str], tuple[list[int], int]] = {}
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)  # a shard gone with messages queued blocks no exit
        self.results = self.ctx.socket(zmq.PULL)
        port = self.results.bind_to_random_port("tcp://127.0.0.1")
        self.outs = []
        spawn = mp.get_context("spawn")
        self.procs = []
        for i in range(k):
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, 64)
            p_in = s.bind_to_random_port("tcp://127.0.0.1")
            self.outs.append(s)
            proc = spawn.Process(target=_shard_main, daemon=True, name=f"commcheck-shard{i}",
                                 args=(i, f"tcp://127.0.0.1:{p_in}",
                                       f"tcp://127.0.0.1:{port}", world_size, hang_timeout,
                                       64, straggler))
            proc.start()
            self.procs.append(proc)

    # -- the pipeline interface ----------------------------------------------------------------

    def feed_decoded(self, items: list[Decoded]) -> list[Finding]:
        for data, batch in items:
            if isinstance(batch, WireError):
                self.reject(batch)
                continue
            self._dispatch(batch, data)
        return self._poll(0)

    def resume(self, parts: list[bytes]) -> None:
        """Continue from the router's and the shards' states committed before a restart."""
        if len(parts) != self.k + 1:
            raise snapshot.SnapshotError(
                f"the database holds the state of {len(parts) - 1 or 1} engine(s); run "
                f"with --shards {len(parts) - 1 or 1}")
        self.engine = self._load(parts[0])
        for s, part in zip(self.outs, parts[1:], strict=True):
            snapshot.load(part)  # refuse here, with one line, what a shard could not load
            s.send_multipart([_RESUME, _enc.encode([part, self.engine.world_size,
                                                    self.engine.hang_timeout])])

    def snapshot_parts(self) -> list[bytes]:
        """The router's engine and each shard's, as of the batches routed so far; the
        findings the shards reported on the way are emitted (stored) before."""
        if not self._finished:  # else the shards sent their last state with their finals
            self._snaps = {}
            for s in self.outs:
                s.send_multipart([_SNAP, _enc.encode(None)])
        deadline = time.monotonic() + SNAPSHOT_TIMEOUT_S
        while len(self._snaps) < self.k:
            if self._finished or time.monotonic() > deadline:
                missing = sorted(set(range(self.k)) - set(self._snaps))
                raise RuntimeError(f"commcheck collect: shards {missing} sent no snapshot "
                                   f"in {SNAPSHOT_TIMEOUT_S:.0f} s")
            self._poll(200, snaps=True)
        return [snapshot.dump(self.engine)] + [self._snaps[i] for i in range(self.k)]

    def _dispatch(self, batch: Batch, data: bytes) -> None:
        self._fed = True
        self.engine.ingest(_control_only(batch))
        if batch.env.kind != RECORDS:
            for s in self.outs:
                s.send_multipart([_BATCH, data])
            return
        n = len(batch.records)
        if not n:
            self._route_drops(batch)
            return
        self.engine.ranks[batch.env.rank].records += n
        self.engine.stats.records += n
        self.store.add_batch(batch, data)
        self._route(batch, data)

    def _route(self, batch: Batch, data: bytes) -> None:
        env = batch.env
        owner = np.array([self._shard(env.run, name, ranks) for name, ranks in env.groups])
        dest = owner[batch.records["group"]]
        first = int(dest[0])
        if (dest == first).all():
            self.outs[first].send_multipart([_BATCH, data], copy=False)
            return
        for s in np.unique(dest).tolist():
            part = msgspec.structs.replace(env, records=batch.records[dest == s].tobytes())
            self.outs[s].send_multipart([_BATCH, encode(part)], copy=False)

    def _route_drops(self, batch: Batch) -> None:
        """Which records a rank dropped: each range to the shard of its group (the shards
        decide missing ranks and count what is not verified)."""
        env = batch.env
        by: dict[int, list] = {}
        for d in env.drops:
            by.setdefault(self._shard(env.run, d.group, d.ranks), []).append(d)
        for s, drops in by.items():
            self.outs[s].send_multipart([_BATCH, encode(msgspec.structs.replace(
                env, drops=drops))], copy=False)

    def _shard(self, run: str, name: str, ranks: list[int]) -> int:
        hit = self._routes.get((run, name))
        if hit is not None and hit[0] == ranks:
            return hit[1]
        s = shard_of(run, name, ranks, self.k)
        self._routes[(run, name)] = (ranks, s)
        return s

    def emit(self, findings: list[Finding]) -> None:
        self.engine.stats.findings += len(findings)  # the shards' engines found them
        super().emit(findings)

    def _poll(self, timeout_ms: int, finals: int = 0, snaps: bool = False) -> list[Finding]:
        """Take shard reports; with ``finals``, wait (up to the timeout) until that many
        final reports arrived; with ``snaps``, until one snapshot arrived."""
        found: list[Finding] = []
        got = 0
        want = finals or int(snaps)
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            wait = 0 if got >= want else max(0, int((deadline - time.monotonic()) * 1000))
            if not self.results.poll(wait):
                if got >= want or time.monotonic() >= deadline:
                    break
                continue
            msg = _dec.decode(self.results.recv())
            if msg.get("snapshot") is not None:
                self._snaps[msg["shard"]] = msg["snapshot"]
                got += snaps
            shard = msg["shard"]
            findings = []
            for f in map(Finding.from_json, msg["findings"]):
                kept = self._stragglers.new(shard, f) if f.kind is Kind.STRAGGLER else f
                if kept is not None:  # else it joined another shard's finding
                    findings.append(kept)
            self.emit(findings)
            found += findings
            self.shard_counters[shard] = msg["counters"]
            for onset in map(Finding.from_json, msg["onsets"]):
                if onset.kind is Kind.STRAGGLER:
                    onset = self._stragglers.update(shard, onset)
                self._onsets[(onset.kind, onset.run, onset.group, onset.seq)] = onset
            got += bool(msg["final"])
        self._sync_stats()
        return found

    def _sync_stats(self) -> None:
        st = self.engine.stats
        for name in ("verified", "open_keys", "nan_folded", "evicted", "late"):
            setattr(st, name, sum(c.get(name, 0) for c in self.shard_counters))

    def check_hangs(self, now: float) -> None:
        for s in self.outs:
            s.send_multipart([_HANGS, _enc.encode(now)])
        self._poll(0)

    def close_run(self, now: float) -> None:
        for s in self.outs:
            s.send_multipart([_FINISH, _enc.encode([now, self.engine.done])])
        self._fed = True
        self._snaps = {}
        self._poll(60_000, finals=self.k)
        self._finished = True

    def observe(self, rank: int, liveness: Liveness, now: float) -> None:
        """Not passed on: deaths and frozen ranks must be decided in one place, and each of
        the K shards sees only its own groups; ``collect --shards`` reports hangs and missing
        ranks without liveness (no rank_died). Its rank table still learns of a death, so
        ``--exit-when-done`` does not wait for a dead rank's goodbye."""
        self.engine.observe(rank, liveness, now)

    def counters(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for c in self.shard_counters:
            out.update({k: v for k, v in c.items() if k != "records" and
                        not k.startswith("stopped.")})
            for k, v in c.items():  # a rank's stop signal, as every shard saw it: not a sum
                if k.startswith("stopped."):
                    out[k] = max(out[k], v)
        out["records"] = self.engine.stats.records
        out["world"] = self.engine.world_size
        out.update({f"rejected.{k}": v for k, v in self.rejected.items()})
        out.setdefault("findings", 0)
        out.setdefault("verified", 0)
        out.setdefault("unmatched", 0)
        return dict(out)

    def persist(self) -> None:
        if self._fed:
            self.store.set_snapshot(self.snapshot_parts())
            self._fed = False
        else:
            self._poll(0)
        self.store.set_ranks(self.engine.ranks)
        self.store.set_counters({k: v for k, v in self.counters().items()
                                 if k != "window_bytes"})
        for f in self._onsets.values():
            self.store.update_finding_detail(f)
        self.store.commit()

    def stop(self) -> None:
        """End the shard processes; the store stays open. After :meth:`close_run` they are
        on their way out; before it (a start-up that failed, a stop meant to be resumed from
        the last snapshot) nothing tells them to end, so they are terminated at once instead
        of waited for (10 s each)."""
        for p in self.procs:
            if not self._finished:
                p.terminate()
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        for s in (*self.outs, self.results):
            s.close(linger=0)
        self.ctx.term()


def _control_only(batch: Batch) -> Batch:
    """The envelope without its records: the router's engine only keeps rank state."""
    return Batch(batch.env, batch.records[:0], batch.chunks[:0], batch.shapes[:0])


def _shard_main(index: int, inbox: str, outbox: str, world: int, hang_timeout: float,
                burst: int = 64, straggler: str = "") -> None:
    """One shard: batches in, findings and counters out, until told to finish."""
    tune_process()
    ctx = zmq.Context()
    rx = ctx.socket(zmq.PULL)
    rx.connect(inbox)
    tx = ctx.socket(zmq.PUSH)
    tx.connect(outbox)
    engine = Engine(world, hang_timeout, stragglers=StragglerRules.parse(straggler))
    rejected: Counter[str] = Counter()
    last_report = time.monotonic()

    def report(findings: list[Finding], final: bool = False, snap: bytes | None = None) -> None:
        st = engine.stats
        counters = {"records": st.records, "verified": st.verified, "findings": st.findings,
                    "unmatched": engine.unmatched(), "nan_folded": st.nan_folded,
                    "open_keys": st.open_keys, "evicted": st.evicted, "late": st.late,
                    "window_bytes": engine.fast.nbytes if engine.fast else 0,
                    **st.op_counters(),
                    **engine.dropped.counters(), **engine.lateness.counters(),
                    **engine.stalls.counters(),
                    **{f"rejected.{k}": v for k, v in rejected.items()}}
        tx.send(_enc.encode({"shard": index, "final": final, "counters": counters,
                             "findings": [f.to_json() for f in findings],
                             "onsets": [o.finding.to_json() for o in engine.onsets.values()]
                             + [f.to_json() for f in engine.stragglers.raised],
                             "snapshot": snap}))

    while True:
        if not rx.poll(500):
            continue
        batches, pending = [], []
        cmd = None
        while len(batches) < burst and rx.poll(0):
            kind, payload = rx.recv_multipart()
            if kind != _BATCH:
                cmd = (kind, _dec.decode(payload))
                break
            try:
                batches.append(decode(payload))
            except WireError as e:
                rejected[e.reason] += 1
        if batches:
            pending += engine.ingest_many(batches)
        if cmd is not None and cmd[0] == _RESUME:
            part, world_size, hang_timeout = cmd[1]
            engine = snapshot.load(part)
            if world_size:
                engine.world_size = engine.stats.world = world_size
            engine.hang_timeout = hang_timeout
        if cmd is not None and cmd[0] == _SNAP:
            report(pending, snap=snapshot.dump(engine))
            pending = []
            last_report = time.monotonic()
            continue
        if cmd is not None and cmd[0] == _HANGS:
            pending += engine.check_hangs(cmd[1])
        if cmd is not None and cmd[0] == _FINISH:
            now, done = cmd[1]
            pending += engine.finish() if done else engine.check_hangs(now)
            report(pending, final=True, snap=snapshot.dump(engine))
            break
        if pending or time.monotonic() - last_report >= 0.5:
            report(pending)
            last_report = time.monotonic()
    tx.close(linger=-1)
    rx.close()
    ctx.term()
