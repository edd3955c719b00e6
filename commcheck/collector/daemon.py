"""The head-node daemon: receive batches, feed the engine, persist, show progress, report.

Single-threaded on purpose: one loop owns the socket, the engine and the database, so no
state is shared between threads. Malformed messages are rejected and counted per reason
(DESIGN.md rule 6); the loop never dies on input.
"""

from __future__ import annotations

import logging
import signal
import sqlite3
import sys
import time
from collections import Counter
from itertools import islice
from typing import TYPE_CHECKING

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from ..engine import Engine, Finding, Liveness
from ..engine.stragglers import StragglerRules
from ..wire import GONE, STATUS, STOPPED, Envelope, WireError
from ..wire.bypass import causes
from ..wire.keys import SecurityError, keygen, server_keys
from ..wire.private import announce
from .admission import OPEN, RefusedSenders, refuse_used
from .claims import Claims
from .file_writer import WriteFailed
from .lateness_table import live_line
from .ledger import Ledger
from .options import CollectorOptions
from .pipeline import Pipeline, PipelineBase, tune_process
from .receiver import Receiver
from .report import bypassed, exit_status, load, render
from .store import Store, StoreError, cannot_write

if TYPE_CHECKING:
    from .metrics import Metrics

log = logging.getLogger("commcheck")

COMMIT_SHARE = 20  # commit every >= 20 x what the last commit took (<= 5 % of the time)
MAX_COMMIT_INTERVAL = 1.5
SIGNAL_QUIET_S = 1.0  # after a first SIGTERM/SIGINT: stop once the job is this quiet
SIGNAL_DRAIN_S = 5.0  # or this long after it, whatever still comes


class StartError(Exception):
    """The collector cannot start for a reason of its own options (one line)."""


class Collector:
    def __init__(self, opts: CollectorOptions, console: Console | None = None):
        self.opts = opts
        self.console = console or Console(stderr=True)
        if opts.new_keys:
            if not opts.curve_dir:
                raise SecurityError("--new-keys: give the directory for them (--curve-dir)")
            keygen(opts.curve_dir)
        curve = server_keys(opts.curve_dir) if opts.curve_dir else None
        rules = StragglerRules.parse(opts.straggler)
        self.store = Store.create(opts.db, opts.records)
        if opts.shards > 1:
            from .shards import ShardedPipeline

            self.pipeline: PipelineBase = ShardedPipeline(
                opts.shards, self.store, opts.world_size, opts.hang_timeout,
                self._log_finding, self._log_reject, straggler=opts.straggler)
        else:
            self.pipeline = Pipeline(Engine(opts.world_size, opts.hang_timeout,
                                            stragglers=rules), self.store,
                                     self._log_finding, self._log_reject)
        # acked, exactly-once delivery; a restart on the same DB continues from the engine
        # state of its last commit
        self.ledger = Ledger(self.store.conn, bodies=opts.keep_bodies)
        self.refused_senders = RefusedSenders(self.store)
        self.claims = Claims(self.store.conn, self.refused_senders.add)
        self.metrics: Metrics | None = None
        try:
            if opts.fresh:
                refuse_used(self.store)
            if not opts.curve_dir:  # said in the report, as on stderr (cli.collect)
                self.store.set_counters({OPEN: 1})
            self._restart()
            if opts.metrics:  # prometheus_client only when asked for: a shorter start
                from .metrics import Metrics

                self.metrics = Metrics(opts.metrics, self.store, opts.hang_timeout)
            # bound last: nothing to close on the way out if the database cannot be used
            self.receiver = Receiver(opts.bind, curve, self._refused, acked=True)
            self._announce()
        except BaseException:
            if self.metrics is not None:
                self.metrics.close()
            self.pipeline.stop()
            self.store.close()
            raise
        self.engine = self.pipeline.engine
        self.stop_reason = ""
        self._stop = False
        self._signalled_at: float | None = None  # the first SIGTERM/SIGINT (_on_signal)
        self._last_hang_check = self._last_commit = time.monotonic()
        self._commit_every = opts.commit_interval
        self._rate = (time.monotonic(), 0)
        self.rate = 0.0
        self._live = False
        # the relays' latest observation of each rank, by (run, rank)
        self.status: dict[tuple[str, int], dict] = {}
        self._status_changed: set[tuple[str, int]] = set()
        # --exit-when-done: when each rank was last heard of (records, or its relay's word
        # that it is alive), when the first rank finished or the first sender was refused
        self._heard: dict[int, float] = {}
        self._settled_at: float | None = None
        self._started = self._last_done_check = time.monotonic()

    def _refused(self, reason: str, msg: str, who: str) -> None:
        if self._settled_at is None and not self.opts.new_keys:
            self._settled_at = time.monotonic()
        self.refused_senders.add(reason, who)
        self.pipeline.reject(WireError(reason, msg))

    def done(self, now: float) -> str:
        """Why ``--exit-when-done`` may exit now ("" if not): every rank said goodbye or
        died, or the ranks left have been silent for ``done_wait`` s since the others
        finished (or since the first refused sender): a node lost with its relay, or
        refused, never says more."""
        if self.engine.done:
            return "all ranks said goodbye or died"
        if now - self._last_done_check < 1.0:
            return ""
        self._last_done_check = now
        ranks = self.engine.ranks
        world = self.engine.world_size or max(ranks, default=-1) + 1
        # in what was heard of, never range(world): a message may claim a world of millions
        finished = {r for r, s in ranks.items() if r < world and (s.said_goodbye or s.gone)}
        left = world - len(finished)
        if left < world and self._settled_at is None:
            self._settled_at = now
        if self._settled_at is None or not left:
            return ""
        heard = [self._heard.get(r, self._started) for r in {*ranks, *self._heard}
                 if r < world and r not in finished]
        quiet = max([self._settled_at, self._started, *heard])
        if now - quiet < self.opts.done_wait:
            return ""
        first = list(islice((r for r in range(world) if r not in finished), 16))
        named = ",".join(map(str, first)) + ("…" if left > 16 else "")
        return (f"rank{'s' if left > 1 else ''} {named} silent for "
                f"{self.opts.done_wait:g} s (a lost node, or refused)")

    def _restart(self) -> None:
        """Continue from the engine state of the database's last commit (if any); rejection
        counts go on from the committed ones."""
        t0 = time.monotonic()
        self.pipeline.rejected.update(self.store.rejected())
        parts = self.store.snapshot()
        if parts:
            self.pipeline.resume(parts)
            log.info("commcheck collect: resumed from the snapshot in %s in %.1f s",
                     self.opts.db, time.monotonic() - t0)

    @property
    def rejected(self) -> Counter[str]:
        return self.pipeline.rejected

    def _on_signal(self, signum, frame) -> None:
        """A second signal stops at once; the first once nothing has come from the job for
        ``SIGNAL_QUIET_S`` (at most ``SIGNAL_DRAIN_S``): a scheduler (scancel, a time
        limit) signals the ranks, the relays and this collector together, and the ranks'
        goodbyes, saying how they ended, are still on their way."""
        if self._signalled_at is not None:
            self._stop = True
        else:
            self._signalled_at = time.monotonic()
        self.stop_reason = signal.Signals(signum).name

    def _log_reject(self, e: WireError) -> None:
        if sum(self.rejected.values()) <= 10:
            self.console.print(f"[yellow]commcheck collect: rejected a message: "
                               f"{escape(str(e))}[/]", soft_wrap=True)

    def _log_finding(self, f: Finding) -> None:
        if self.metrics is not None:
            self.metrics.finding(f)
        if not self._live:
            self.console.print(f"[red]finding[/] {f.kind} {f.op} {escape(f.group)} seq "
                               f"{f.seq} culprits {f.culprits} at {escape(f.callsite)}",
                               highlight=False, soft_wrap=True)

    def publish_metrics(self) -> None:
        """The exporter's next snapshot, from this collector's counts (explicit: the
        exporter knows nothing of the collector)."""
        if self.metrics is not None:
            self.metrics.publish(self.pipeline.counters(), self.engine.ranks,
                                 self.opts.world_size, self.rejected)

    def view(self) -> Table:
        st = self.engine.stats
        t = Table(title=f"commcheck collect · {self.receiver.endpoint}", show_header=False)
        t.add_column("what", style="bold")
        t.add_column("value")
        connected = sum(s.hello and not s.goodbye for s in self.engine.ranks.values())
        done = sum(s.goodbye for s in self.engine.ranks.values())
        t.add_row("ranks", f"{connected} connected, {done} done of {st.world or '?'}")
        t.add_row("verified", f"{st.verified} collectives ({self.rate:,.0f}/s)")
        t.add_row("records", f"{st.records} ({st.open_keys} awaiting peers)")
        style = "red" if st.findings else "green"
        t.add_row("findings", f"[{style}]{st.findings}[/]")
        if self.pipeline.first is not None:
            f = self.pipeline.first
            t.add_row("first divergence", escape(f"{f.kind} {f.op} {f.group} seq {f.seq} step "
                                                 f"{f.step} ranks {f.culprits} at {f.callsite}"))
        if self.status:
            t.add_row("relays see", self.status_line())
        late = live_line(self.pipeline.counters(), {r: s.host for r, s in
                                                    self.engine.ranks.items()})
        if late:
            t.add_row("lateness", escape(late))
        if self.rejected:
            t.add_row("rejected", ", ".join(f"{k}: {v}" for k, v in self.rejected.items()))
        not_seen = bypassed(s.counters for s in self.engine.ranks.values())
        if not_seen:
            own = bypassed((s.counters for s in self.engine.ranks.values()), "bypassed_ddp:")
            t.add_row("not checked", "[yellow]" + escape(", ".join(
                f"group {g}: {n}" for g, n in not_seen.items()) + " collectives bypassed "
                "the wrappers: " + causes(not_seen, own)) + "[/]")
        return t

    def status_line(self) -> str:
        """The relays' view of the ranks in a line: counts by state, then who is not alive
        (state, exit code or signal, seconds since its last record)."""
        states = Counter(s["state"] for s in self.status.values())
        head = ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
        odd = [s for s in sorted(self.status.values(), key=lambda s: s["rank"])
               if s["state"] in (GONE, STOPPED) and not s["goodbye"]]
        parts = []
        for s in odd[:6]:
            how = f"signal {s['signal']}" if s["signal"] else \
                f"exit {s['exit_code']}" if s["exit_code"] >= 0 else "no goodbye"
            parts.append(f"rank {s['rank']} {s['state']} ({how}, last record "
                         f"{s['idle']:.1f} s before)")
        more = f" … {len(odd) - 6} more" if len(odd) > 6 else ""
        return escape(head + (": " + "; ".join(parts) + more if parts else ""))

    def _tick_rate(self) -> None:
        t0, v0 = self._rate
        now = time.monotonic()
        if now - t0 >= 1.0:
            self.rate = (self.engine.stats.verified - v0) / (now - t0)
            self._rate = (now, self.engine.stats.verified)

    def ingest(self, burst: list[tuple[bytes, bytes]]) -> int:
        """(sender, message) pairs through the ledger (duplicates of delivered messages go,
        each sender's order is restored) into the engine, which decides 64 at a time.
        Relays' ``status`` messages update :attr:`status` instead. Returns how many messages
        were not status messages (activity of the job itself)."""
        fresh = self.claims.screen(self.ledger.admit(burst))
        rest, statuses = [], []
        now = time.monotonic()
        for item in fresh:
            batch = item[1]
            if not isinstance(batch, WireError) and batch.env.kind == STATUS:
                statuses.append(batch.env)
                for s in batch.env.status:
                    if s.state != GONE:
                        self._heard[s.rank] = now
            else:
                rest.append(item)
                if not isinstance(batch, WireError):
                    self._heard[batch.env.rank] = now
        for i in range(0, len(rest), 64):
            self.pipeline.feed_decoded(rest[i:i + 64])
        if self.metrics is not None:
            self.metrics.ingested(rest)
        for env in statuses:  # after the records of the same burst: a death comes last
            self.take_status(env)
        return len(burst) - (len(fresh) - len(rest))

    def take_status(self, env: Envelope) -> None:
        """A relay's observations: the latest per rank wins (by the relay's clock)."""
        for s in env.status:
            key = (env.run, s.rank)
            old = self.status.get(key)
            if old is not None and old["t"] > env.t and old["relay_pid"] == env.pid:
                continue
            self.status[key] = {
                "run": env.run, "rank": s.rank, "pid": s.pid, "host": env.host,
                "node": env.node, "state": s.state, "proc": s.proc, "goodbye": int(s.goodbye),
                "idle": s.idle, "exit_code": s.exit_code, "signal": s.signal,
                "records": s.records, "dropped": s.dropped, "relay_pid": env.pid, "t": env.t,
                "unreachable": s.unreachable, "outages": s.outages, "resent": s.resent}
            self._status_changed.add(key)
            self.pipeline.observe(s.rank, Liveness(
                state=s.state, goodbye=s.goodbye, idle_s=s.idle, exit_code=s.exit_code,
                signal=s.signal, pid=s.pid, seen_t=env.t, host=env.host), time.time())

    def _store_status(self) -> None:
        if self._status_changed:
            rows = [self.status[k] for k in self._status_changed]
            self.store.set_status(rows)
            self.store.set_counters({  # an outage goes into the report (report.outages)
                f"{name}.{row['rank']}": value for row in rows if row["unreachable"] >= 1.0
                for name, value in (("unreachable_ms", int(row["unreachable"] * 1000)),
                                    ("outages", row["outages"]), ("resent", row["resent"]))})
            self._status_changed.clear()
        self.refused_senders.save()

    def maintain(self, now: float) -> None:
        """Periodic work: hang checks while the job is hung, commits, and the acks of what
        is committed (never before)."""
        if now - self._last_hang_check >= 1.0:
            self.pipeline.check_hangs(time.time())
            self._last_hang_check = now
        if now - self._last_commit >= self._commit_every:
            late = self.ledger.admit([])  # held past a gap for too long: feed now
            if late:
                self.pipeline.feed_decoded(late)
            t0 = time.monotonic()
            self._store_status()
            self.pipeline.persist()
            self.ledger.send_acks(self.receiver.ack)
            self._last_commit = now
            # A commit (mostly the engine's snapshot, which grows with the open window)
            # may take ~5 % of the time, up to MAX_COMMIT_INTERVAL: below the ranks' 2 s
            # ack timeout, so acks still come before they re-send.
            spent = time.monotonic() - t0
            self._commit_every = min(max(self.opts.commit_interval, COMMIT_SHARE * spent),
                                     max(self.opts.commit_interval, MAX_COMMIT_INTERVAL))

    def _announce(self) -> None:
        """The bound endpoint, for whoever started us (a test, `commcheck run`)."""
        if not self.opts.ready_file:
            return
        try:
            announce(self.opts.ready_file, self.receiver.endpoint)
        except OSError as e:
            self.receiver.close()
            raise StartError(f"--ready-file {self.opts.ready_file}: {e.strerror}") from None

    def run(self) -> int:
        tune_process()
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        live_on = self.console.is_terminal if self.opts.live is None else self.opts.live
        live = Live(self.view(), console=self.console, refresh_per_second=4) if live_on \
            else None
        self._live = live is not None
        failure: sqlite3.Error | OSError | None = None
        try:  # everything after the bind, so the socket is closed whatever fails
            self._serve(live)
        except (sqlite3.Error, WriteFailed) as e:
            failure = e
        finally:
            if failure is None:
                try:
                    self._finish(live)
                except (sqlite3.Error, WriteFailed) as e:
                    failure = e
            if failure is not None:
                self._abandon(live)
        if failure is not None:
            raise StoreError(cannot_write(self.opts.db, failure) + ": stopped without "
                             "acknowledging what came after the last commit, which the relays "
                             "keep and send again to `commcheck collect` started on the same "
                             "--db once there is room")
        findings, summary = load(self.store)
        self.store.close()
        self.console.print(f"commcheck collect: stopped ({self.stop_reason or 'done'})",
                           highlight=False, soft_wrap=True)
        render(findings, summary, Console(file=sys.stdout), self.opts.max_unverified)
        return exit_status(findings, summary, self.opts.max_unverified)

    def _serve(self, live: Live | None) -> None:
        """Receive, check and commit until stopped, done or idle."""
        last_msg = time.monotonic()
        self.console.print(f"commcheck collect: listening on {self.receiver.endpoint}, "
                           f"db {self.opts.db}", highlight=False, soft_wrap=True)
        if self.metrics is not None:
            self.console.print(f"commcheck collect: metrics on {self.metrics.url}",
                               highlight=False, soft_wrap=True)
        if live:
            live.start()
        while not self._stop:
            got = self.receiver.recv_from(100)
            now = time.monotonic()
            if got is not None:
                burst: list[tuple[bytes, bytes]] = []
                while got is not None and len(burst) < 1000:  # drain, then periodic work
                    burst.append(got)
                    got = self.receiver.recv_from(0) if len(burst) < 1000 else None
                if self.ingest(burst):  # relays' status messages alone are not activity
                    last_msg = now
            self.maintain(now)
            self._tick_rate()
            if self.metrics is not None and self.metrics.due():
                self.publish_metrics()
            if live:
                live.update(self.view())
            if self.opts.exit_when_done and (reason := self.done(now)):
                self.stop_reason = reason
                break
            if self._signalled_at is not None and (
                    self.engine.done or now - last_msg >= SIGNAL_QUIET_S or
                    now - self._signalled_at >= SIGNAL_DRAIN_S):
                break
            if self.opts.idle_timeout and now - last_msg > self.opts.idle_timeout:
                self.stop_reason = f"idle for {self.opts.idle_timeout:g} s"
                break

    def _finish(self, live: Live | None) -> None:
        """The last verdicts, commit and acks; the socket closed."""
        self.pipeline.close_run(time.time())
        if live:
            live.update(self.view())
            live.stop()
        self._store_status()
        self.pipeline.persist()
        self.publish_metrics()
        self.ledger.send_acks(self.receiver.ack)
        self.pipeline.stop()
        self.receiver.close(linger=0.5)

    def _abandon(self, live: Live | None) -> None:
        """The database or the records file cannot be written (a full disk, a file size
        limit): stop without another commit or ack. What was not committed was not
        acknowledged, so the relays keep it and send it again to a collector restarted on
        the same database; committing now could store a snapshot without the delivery rows
        or frame index that SQLite may have rolled back with the failed transaction."""
        if live:
            live.stop()
        self.receiver.close(linger=0)
        self.pipeline.stop()
        self.store.abandon()
