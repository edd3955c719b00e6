"""Rendering findings: a rich report for people, a JSON document for machines."""

from __future__ import annotations

import os
import re
import signal
from collections import Counter
from collections.abc import Iterable

import msgspec
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..engine import Finding, Kind, Report, Summary
from ..engine.findings import (
    Desync,
    Divergence,
    Failed,
    Hang,
    LinkCorruption,
    MissingRank,
    NanInf,
    OpTally,
    Outage,
    RankDied,
    ReductionError,
    RefusedSender,
    Stopped,
    Straggler,
    Unfinished,
    ValueMismatch,
    Variant,
)
from ..engine.suspects import describe, link_matrix, suspects
from ..wire import SITE_SEP
from ..wire.bypass import causes
from ..wire.faults import describe_recorded, from_counters
from ..wire.private import REFUSED_FILE
from .admission import OPEN
from .admission import PREFIX as REFUSED
from .lateness_table import by_host_rows, lateness_rows
from .lateness_table import table as lateness_table
from .options import DEFAULT_MAX_UNVERIFIED
from .store import RankRow, Store, StoreSummary


def _ranks(rs: list[int]) -> str:
    return ",".join(map(str, rs)) if rs else "—"


def _how_far(f: Finding) -> str:
    d = f.detail
    if isinstance(d, Divergence):  # the gradient probe's: every field, as stored
        return ", ".join(f"{k}={v}" for k, v in msgspec.to_builtins(d).items())
    if isinstance(d, ValueMismatch):
        if f.ambiguous:
            tie = "tie: " + " vs ".join(f"[{_ranks(s.ranks)}]" for s in d.sides)
            return tie + (f" ({d.tie.evidence})" if d.tie is not None else "")
        if d.tie is not None:  # a tie the records settled: what they say
            return f"tie settled by the records: {d.tie.evidence}"
        if d.sum_abs_diff is None:
            return "output bytes differ (hash)"
        return f"sum differs by {d.sum_abs_diff:.6g} (rel {d.sum_rel_diff:.3g})"
    if isinstance(d, LinkCorruption):
        return "links " + ", ".join(f"{a}→{b}" for a, b in d.links)
    if isinstance(d, ReductionError):
        worst = max(d.ranks.values(), key=lambda w: w.abs_err)
        return (f"Σinputs {worst.expected_sum:.6g} vs output {worst.output_sum:.6g} "
                f"(tol {worst.tolerance:.3g})")
    if isinstance(d, Desync):
        variants = " | ".join(
            f"[{_ranks(v.ranks)}] " + " ".join(f"{k}={_shown(v, k)}" for k in d.fields)
            for v in d.variants)
        return f"differ in {', '.join(d.fields)}: {variants}"
    if isinstance(d, MissingRank):
        waited = "" if d.waited_s is None else f" for {d.waited_s:.1f} s"
        lasts = []
        for r, last in d.last.items():
            if last is None:
                lasts.append(f"rank {r} never reported")
            else:
                ago = "" if last.ago_s is None else f", {last.ago_s:.1f} s ago"
                lasts.append(f"rank {r} last in {last.op} {last.at}{ago}")
        later = f"; {_n(d.later_collectives, 'later collective')} missed them too" \
            if d.later_collectives else ""
        return "; ".join([*_entered(d, waited), *lasts]) + later + _then_gone(d.then_gone)
    if isinstance(d, RankDied):
        return _died(d)
    if isinstance(d, Hang):
        return _hung(d)
    if isinstance(d, Straggler):
        return _straggled(d)
    if isinstance(d, NanInf):
        ins = ", ".join(f"rank {r}: {c.nan} NaN {c.inf} Inf" for r, c in d.inputs.items())
        later = d.later_collectives_with_nan_inf
        return f"inputs {ins}" + (f"; {later} later collectives carried it" if later else "")
    return ", ".join(f"{k}={v}" for k, v in msgspec.to_builtins(d).items())


def _straggled(d: Straggler) -> str:
    if d.cause == "link":
        link = f"links of {d.link[0]}" if len(d.link) == 1 else f"link {' ↔ '.join(d.link)}"
        what = (f"slow {link} (ranks {_ranks(d.ranks)}): exchanges take "
                f"{d.median_gap_ms:g} ms against {d.baseline_ms:g} ms between other hosts")
    else:
        what = (f"rank {d.rank} arrived last in {100 * d.last_share:.0f} % of {d.window} "
                f"collectives of {', '.join(d.groups)}, {d.median_gap_ms:g} ms behind, "
                f"{d.wall_pct:g} % of the others' time")
    end = f"; ended at step {d.end_step}" if d.ended else "; still on"
    return (f"{what}; cost the others {d.cost_s:g} s ({d.cost_pct:g} % of their time in "
            f"those collectives) since step {d.start_step}{end}")


def _spans(rs: list[int]) -> str:
    """Ascending ranks with runs shortened: [0, 1, 2, 3, 5] -> "0-3,5" (a world of 1024
    in a table cell)."""
    out: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if j == i else f"{rs[i]},{rs[j]}" if j == i + 1 else
                   f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out) if out else "—"


def _who(rs: list[int]) -> str:
    return f"rank{'s' if len(rs) > 1 else ''} {_spans(rs)}"


def _n(k: int, what: str) -> str:
    return f"{k} {what}{'' if k == 1 else 's'}"


_NOT_WAITING = {"died": "entered it, then died", "stopped": "entered it, then stopped",
                "finished": "entered it, then said goodbye",
                "silent": "entered it, no longer reporting"}


def _crashes(crashed: dict[str, str], where: str = "") -> list[str]:
    """E.g. "ranks 0,1 crashed in it: RuntimeError: Connection closed by peer
    [127.0.0.1]:40373": the ranks whose call raised, by error. An error is shown to its
    first sentence (the JSON has it whole); errors that differ only in numbers (each
    rank's peer port) are one, shown as the lowest rank's, "alike" for the others."""
    by_error: dict[str, list[tuple[int, str]]] = {}
    for r, error in crashed.items():
        short = error.split(". ", 1)[0]
        by_error.setdefault(re.sub(r"\d+", "#", short), []).append((int(r), short))
    out = []
    for found in sorted((sorted(v) for v in by_error.values()), key=lambda v: v[0][0]):
        ranks = [r for r, _ in found]
        alike = "" if len({e for _, e in found}) == 1 else \
            f" (rank {ranks[0]}'s; alike for the others)"
        out.append(f"{_who(ranks)} crashed{where}: {found[0][1]}{alike}")
    return out


def _entered(d: MissingRank, waited: str) -> list[str]:
    """What the ranks that entered are doing: "waiting" only for those known alive and
    blocked (``MissingRank.not_waiting`` names the others, ``crashed`` what they raised)."""
    out = []
    waiting = [r for r in d.waiting if str(r) not in d.not_waiting]
    if waiting:
        out.append(f"rank{'s' if len(waiting) > 1 else ''} {_ranks(waiting)} waiting{waited}")
    out.extend(_crashes(d.crashed, " in it"))
    for word, says in _NOT_WAITING.items():
        ranks = sorted(int(r) for r, w in d.not_waiting.items() if w == word)
        if ranks:
            out.append(f"{_who(ranks)} {says}")
    return out


def _died(d: RankDied) -> str:
    """E.g. "killed by signal 9 inside all_reduce 0[0-3] seq 5 (last completed: ... seq 4);
    ranks 0,1,3 wait in all_reduce 0[0-3] seq 5 (and 5 more); 6 collectives left
    waiting"."""
    how = (f"killed by signal {d.signal}" if d.signal is not None else
           f"exited with status {d.exit_code}" if d.exit_code is not None else "gone")
    if d.last_entered is not None:
        how += f" inside {d.last_entered.op} {d.last_entered.at}"
    done = d.last_completed
    how += f" (last completed: {done.op} {done.at})" if done else " (completed none)"
    parts = [how]
    if d.waiting:
        w = d.waiting[0]
        more = f" (and {len(d.waiting) - 1} more)" if len(d.waiting) > 1 else ""
        waiting = [r for r in w.ranks if str(r) not in w.crashed]
        if waiting:
            parts.append(f"{_who(waiting)} wait in {w.op} {w.at}{more}")
        parts.extend(_crashes(w.crashed, f" in {w.op} {w.at}"))
        if not waiting and more:
            parts[-1] += more
    parts.append(f"{_n(d.collectives_left_waiting, 'collective')} left waiting")
    return "; ".join(parts)


def _hung(d: Hang) -> str:
    """E.g. "ranks 0-3 never completed, for 30.0 s: rank 1 frozen in all_reduce 0[0-3]
    seq 5 (idle 30.2 s); ranks 0,2,3 blocked in all_reduce 0[0-3] seq 5"; ranks as spans."""
    waited = "" if d.waited_s is None else f", for {d.waited_s:.1f} s"
    doing = []
    for g in d.doing:
        where = f" in {g.op} {g.at}" if g.at is not None else ""
        idle = f" (idle {g.idle_s:.1f} s)" if g.idle_s is not None else ""
        error = f": {g.error}" if g.error else ""
        doing.append(f"{_who(g.ranks)} {g.condition}{where}{idle}{error}")
    later = f"; {_n(d.later_collectives, 'later hang')} in the group" \
        if d.later_collectives else ""
    return f"{_who(d.not_completed)} never completed{waited}: " + "; ".join(doing) + later + \
        _then_gone(d.then_gone)


def _then_gone(ranks: list[int]) -> str:
    """A stall's teardown: "; then ranks 0-3 gone (the job torn down after it: its
    consequences, no rank_died)"."""
    if not ranks:
        return ""
    return f"; then {_who(ranks)} gone (torn down after it: its consequences)"


_FIELD_SHOWN = {"in_splits": "splits", "out_splits": "splits"}


def _shown(v: Variant, field: str) -> object:
    """The value of a desync's differing field in one variant, written as JSON lists. A
    send/recv pair compares "numel": what the sender sent against what the receiver took."""
    if field == "numel":
        return v.numel_in if v.op == "send" else v.numel_out
    value = getattr(v, _FIELD_SHOWN.get(field, field))
    return list(value) if isinstance(value, tuple) else value


def first_divergence(findings: list[Finding]) -> int | None:
    """The earliest finding by (step, t); a straggler slows a run, it does not diverge."""
    cands = [i for i, f in enumerate(findings) if f.kind is not Kind.STRAGGLER]
    if not cands:
        return None
    return min(cands, key=lambda i: (findings[i].step, findings[i].t))


def bypassed(counters: Iterable[dict[str, int]], prefix: str = "bypassed:") -> dict[str, int]:
    """Per group, the most collectives any member ran past the wrappers (one collective
    counts on every member, so members are not added up); ``counters``: each rank's.
    ``prefix`` "bypassed_ddp:": the part that was DDP's own C++ traffic."""
    out: dict[str, int] = {}
    for c in counters:
        for key, n in c.items():
            if key.startswith(prefix):
                group = key.removeprefix(prefix)
                out[group] = max(out.get(group, 0), n)
    return dict(sorted(out.items()))


def not_checked_reasons(counters: Iterable[dict[str, int]]) -> dict[str, int]:
    """Calls not checked, summed over the ranks, by the reason a rank gave
    (``not_checked:<reason>`` counters)."""
    out: Counter[str] = Counter()
    for c in counters:
        for key, n in c.items():
            if key.startswith("not_checked:"):
                out[key.removeprefix("not_checked:")] += n
    return dict(sorted(out.items()))


def build_summary(findings: list[Finding], stored: StoreSummary) -> Summary:
    by_rank: Counter[int] = Counter(r for f in findings for r in f.culprits)
    by_host: Counter[str] = Counter(h for f in findings for h in f.hosts)
    by_kind: Counter[Kind] = Counter(f.kind for f in findings)
    counters, ranks = stored.counters, stored.ranks
    first = first_divergence(findings)
    hosts = {r.rank: r.host for r in ranks}
    return Summary(
        unfired_faults=[t for r in ranks if (t := from_counters(r.rank, r.counters))],
        not_checked_reasons=not_checked_reasons(r.counters for r in ranks),
        suspects=suspects(findings, hosts),
        link_matrix=[(src, dst, n) for (src, dst), n in sorted(link_matrix(findings).items())],
        findings=len(findings),
        records=stored.records,
        verified=counters.get("verified", 0),
        unmatched=counters.get("unmatched", 0),
        rejected={k.removeprefix("rejected."): v for k, v in counters.items()
                  if k.startswith("rejected.")},
        runs=stored.runs,
        ranks=len(ranks),
        ranks_said_goodbye=sum(r.goodbye for r in ranks),
        dropped_on_ranks=sum(r.counters.get("dropped", 0) for r in ranks),
        spilled_on_ranks=sum(r.counters.get("spilled", 0) for r in ranks),
        not_checked_on_ranks=sum(r.counters.get("not_checked", 0) for r in ranks),
        bypassed=bypassed(r.counters for r in ranks),
        bypassed_ddp=bypassed((r.counters for r in ranks), "bypassed_ddp:"),
        by_kind=dict(by_kind),
        by_rank={str(k): v for k, v in sorted(by_rank.items())},
        by_host=dict(sorted(by_host.items())),
        first_divergence=None if first is None else findings[first],
        world=counters.get("world", 0),
        unfinished=unfinished(ranks, counters.get("world", 0)),
        ops=op_tally(counters),
        not_verified=counters.get("not_verified", 0),
        not_verified_by_rank={k.removeprefix("not_verified."): v for k, v in counters.items()
                              if k.startswith("not_verified.")},
        outages=outages(counters, ranks),
        stopped=stopped(counters),
        not_verified_lost=counters.get("not_verified_lost", 0),
        not_verified_lost_by_rank={k.removeprefix("not_verified_lost."): v
                                   for k, v in counters.items()
                                   if k.startswith("not_verified_lost.")},
        refused=refused_senders(counters),
        open_collector=bool(counters.get(OPEN, 0)),
        refused_files=refused_files(ranks),
        failed=failures(ranks),
        thread_errors={str(r.rank): r.ending.thread for r in ranks
                       if r.ending is not None and r.ending.thread},
        **_share(unverified_share(counters.get("verified", 0),
                                  counters.get("not_verified", 0))),
        lateness=(late := lateness_rows(counters, hosts)),
        lateness_by_host=by_host_rows(late, counters),
    )


def refused_senders(counters: dict[str, int]) -> list[RefusedSender]:
    """The ``refused:<reason>:<who>`` counters (admission.py), most refused first."""
    out = []
    for key, n in counters.items():
        if key.startswith(REFUSED):
            reason, _, who = key.removeprefix(REFUSED).partition(":")
            out.append(RefusedSender(reason=reason, who=who, count=n))
    return sorted(out, key=lambda r: (-r.count, r.reason, r.who))


def refused_files(ranks: list[RankRow]) -> dict[str, list[int]]:
    """Another user's files the ranks refused (their ``refused_file:<path: why>`` goodbye
    counters), with the ranks each stood in the way of."""
    out: dict[str, list[int]] = {}
    for r in ranks:
        for key in r.counters:
            if key.startswith(REFUSED_FILE):
                out.setdefault(key.removeprefix(REFUSED_FILE), []).append(r.rank)
    return {k: sorted(v) for k, v in sorted(out.items())}


def _share(share: float) -> dict[str, float]:
    """``unverified_share`` where it is not 0 (msgspec leaves out only the default object)."""
    return {"unverified_share": share} if share else {}


def unverified_share(verified: int, not_verified: int) -> float:
    """The part of the collectives the records reached that went unverified because ranks
    dropped records (0 when nothing was dropped)."""
    return round(not_verified / (verified + not_verified), 4) if not_verified else 0.0


def failures(ranks: list[RankRow]) -> list[Failed]:
    """Ranks whose goodbye said training failed, those alike together (errors that differ
    only in numbers are one: each rank names itself or its peer's port)."""
    by: dict[tuple, list[tuple[int, str]]] = {}
    for r in ranks:
        e = r.ending
        if e is None or not e.failed:
            continue
        key = (e.how, re.sub(r"\d+", "#", e.error), e.code, e.signal)
        by.setdefault(key, []).append((r.rank, e.error))
    out = []
    for (how, _, code, sig), found in by.items():
        found.sort()
        out.append(Failed(ranks=[r for r, _ in found], how=how, error=found[0][1],
                          exit_code=code if code >= 0 else None, signal=sig or None,
                          alike=len({e for _, e in found}) > 1))
    return sorted(out, key=lambda f: f.ranks[0])


def op_tally(counters: dict[str, int]) -> list[OpTally]:
    """Per op name, from the collector's ``recorded.op.<op>`` / ``verified.op.<op>``
    counters (most recorded first)."""
    ops: dict[str, list[int]] = {}
    for key, n in counters.items():
        for i, prefix in enumerate(("recorded.op.", "verified.op.")):
            if key.startswith(prefix):
                ops.setdefault(key.removeprefix(prefix), [0, 0])[i] += n
    return [OpTally(op=op, recorded=r, verified=v)
            for op, (r, v) in sorted(ops.items(), key=lambda kv: (-kv[1][0], kv[0]))]


def stopped_line(s: Stopped) -> str:
    return (f"stopped together by {_signal_name(s.signal)}: {_who(s.ranks)} (a cancel or a "
            f"time limit: every rank signalled at once, none failed first, so no rank is "
            f"blamed)")


def stopped(counters: dict[str, int]) -> list[Stopped]:
    """The ranks the engine counted stopped together (counters ``stopped.<rank>``: the
    signal), one entry per signal."""
    by: dict[int, list[int]] = {}
    for k, sig in counters.items():
        if k.startswith("stopped."):
            by.setdefault(sig, []).append(int(k.removeprefix("stopped.")))
    return [Stopped(ranks=sorted(rs), signal=sig) for sig, rs in sorted(by.items())]


def outages(counters: dict[str, int], ranks: list[RankRow]) -> list[Outage]:
    """The relays' outages (counters ``unreachable_ms.<rank>``, ``outages.<rank>``,
    ``resent.<rank>`` the collector keeps from their status messages), ranks that shared
    one (same duration and count: one relay) together."""
    dropped = {r.rank: r.counters.get("dropped", 0) for r in ranks}
    by: dict[tuple[int, int], list[int]] = {}
    for key, ms in counters.items():
        if key.startswith("unreachable_ms.") and ms >= 1000:
            rank = int(key.removeprefix("unreachable_ms."))
            by.setdefault((ms, counters.get(f"outages.{rank}", 0)), []).append(rank)
    return [Outage(ranks=sorted(rs), seconds=round(ms / 1000, 1), outages=n,
                   resent=sum(counters.get(f"resent.{r}", 0) for r in rs),
                   dropped=sum(dropped.get(r, 0) for r in rs))
            for (ms, n), rs in sorted(by.items(), key=lambda kv: min(kv[1]))]


def unfinished(ranks: list[RankRow], world: int) -> list[Unfinished]:
    """Ranks that did not end their run normally: no goodbye, or (``world`` known) nothing
    heard from them at all."""
    out = [Unfinished(rank=r.rank, host=r.host, last=r.last) for r in ranks if not r.goodbye]
    heard = sorted({r.rank for r in ranks if r.rank < world})
    for lo, hi in zip([-1, *heard], [*heard, world], strict=True):  # the gaps between heard ranks
        if hi - lo > 1:
            out.append(Unfinished(rank=lo + 1, never_reported=True,
                                  through=hi - 1 if hi - lo > 2 else None))
    return sorted(out, key=lambda u: u.rank)


def unfinished_count(summary: Summary) -> int:
    return sum(u.count for u in summary.unfinished)


# Exit statuses of `collect`, `report` and `analyze` (2 is a usage or input error, from the
# CLI); docs/report-status.md has the table.
CLEAN, FINDINGS, UNFINISHED, FAILED, UNVERIFIED = 0, 1, 3, 4, 5


def exit_status(findings: list[Finding], summary: Summary,
                max_unverified: float = DEFAULT_MAX_UNVERIFIED) -> int:
    """The first that applies: 3, the run did not finish (a rank never said goodbye or never
    reported); 1, findings; 4, training failed (a goodbye said so: an exception, a non-zero
    exit status, a signal); 3, nothing recorded; 5, more than ``max_unverified`` of the
    collectives unverified; 0, clean. No such run reads clean (DESIGN.md rule 7)."""
    if summary.unfinished:
        return UNFINISHED
    if findings:
        return FINDINGS
    if summary.failed:
        return FAILED
    if not summary.records:
        return UNFINISHED
    if summary.unverified_share > max_unverified:
        return UNVERIFIED
    return CLEAN


def load(store: Store) -> tuple[list[Finding], Summary]:
    """Findings and summary of a commcheck database."""
    findings = store.findings()
    return findings, build_summary(findings, store.summary())


def to_json(findings: list[Finding], summary: Summary) -> dict:
    """The document ``commcheck report --json`` prints (see engine/findings.py)."""
    return msgspec.to_builtins(Report(findings=findings, summary=summary))


def _short(site: str) -> str:
    """A call site as the ranks wrote it (see rank/callsite.py), one frame a line; an old
    absolute path under the current directory is shortened, never climbing out with ``..``."""
    frames = []
    for frame in site.split(SITE_SEP):
        path, colon, rest = frame.partition(":")
        if os.path.isabs(path):
            here = os.path.join(os.getcwd(), "")
            path = path[len(here):] if path.startswith(here) else path
        frames.append(f"{path}{colon}{rest}")
    return "\n← ".join(frames)


# rejections that are not messages: ring entries and files (commcheck/collector/analyze.py)
_REJECTED_SAID = {
    "damaged": "{n} ring entries lost to damage (not dropped; the warnings name the files)",
    "damaged_file": "{n} ring files damaged (header or size; the warnings name them)",
    "bad_file": "{n} files rejected (bad_file; the warnings name them)",
}


def _ranks_counted(by_rank: dict[str, int]) -> str:
    """"rank 2" or "ranks 0,1 (539 each)" or "ranks 0 (3), 1 (5)"."""
    if not by_rank:
        return "ranks"
    if len(by_rank) == 1:
        return f"rank {next(iter(by_rank))}"
    ranks = sorted(by_rank, key=int)
    if len(set(by_rank.values())) == 1:
        return f"ranks {','.join(ranks)} ({by_rank[ranks[0]]} each)"
    return "ranks " + ", ".join(f"{r} ({by_rank[r]})" for r in ranks)


def _door(summary: Summary) -> list[str]:
    """What the collector refused, by reason and by sender, and whether it ran open."""
    lines = [_REJECTED_SAID.get(reason, "{n} messages rejected ({reason})").format(
        n=n, reason=reason) for reason, n in summary.rejected.items()]
    for r in summary.refused:
        what = "connection attempts" if r.reason.startswith("auth") else "messages"
        lines.append(f"refused {r.who}: {r.count} {what} ({r.reason})")
    if summary.open_collector:
        lines.append("the collector ran open (no CURVE keys): any local process could send "
                     "as the job's ranks")
    return lines


def _head(summary: Summary) -> str:
    """The first line; with the unverified share when records were dropped."""
    head = (f"commcheck report: {summary.records} records from {summary.ranks} ranks, "
            f"{summary.verified} collectives verified")
    if summary.not_verified:
        head += (f", {summary.not_verified} not verified "
                 f"({_percent(summary.unverified_share)} unverified)")
    return head


def _percent(share: float) -> str:
    return f"{share * 100:.3g}%"


def _failed_lines(summary: Summary) -> list[str]:
    """E.g. "training failed on ranks 0-3: RuntimeError: rank 0: bad config (rank 0's;
    alike for the others)"."""
    out = []
    for f in summary.failed:
        if f.error:
            how = f.error + (f" (rank {f.ranks[0]}'s; alike for the others)" if f.alike
                             else "")
        elif f.exit_code is not None and f.exit_code > 0:
            how = f"exit status {f.exit_code}"
        else:
            how = "stopped"
        if f.signal:
            how += f" ({_signal_name(f.signal)})"
        out.append(f"training failed on {_who(f.ranks)}: {how}")
    return out


def _signal_name(sig: int) -> str:
    try:
        return f"{signal.Signals(sig).name}"
    except ValueError:
        return f"signal {sig}"


def _extras(summary: Summary) -> list[str]:
    """The "!" lines under the first: what went unchecked, lost, rejected or unreachable."""
    extras = []
    if summary.unmatched:
        extras.append(f"{summary.unmatched} collectives not reported by every member")
    if summary.dropped_on_ranks:
        extras.append(f"{summary.dropped_on_ranks} records dropped on ranks")
    lost = getattr(summary, "not_verified_lost", 0)
    if summary.not_verified > lost:
        extras.append(f"{summary.not_verified - lost} collectives not verified: records "
                      f"dropped on {_ranks_counted(summary.not_verified_by_rank)}")
    if lost:
        extras.append(f"{lost} collectives not verified: records lost (damaged or rejected, "
                      f"not dropped) on {_ranks_counted(summary.not_verified_lost_by_rank)}")
    if summary.spilled_on_ranks:
        extras.append(f"{summary.spilled_on_ranks} records spilled to disk on ranks "
                      f"(collector away or slow)")
    if summary.not_checked_on_ranks:
        why = getattr(summary, "not_checked_reasons", {})
        extras.append(f"{summary.not_checked_on_ranks} calls not checked" + (
            " (" + ", ".join(f"{r}: {n}" for r, n in why.items()) + ")" if why else ""))
    if summary.bypassed:
        per = ", ".join(f"group {g}: {n}" for g, n in summary.bypassed.items())
        total = sum(summary.bypassed.values())
        extras.append(f"{total} collectives bypassed commcheck and were not checked ({per}): "
                      f"{causes(summary.bypassed, summary.bypassed_ddp)}")
    extras += _door(summary)
    for o in summary.outages:
        who = f"rank {o.ranks[0]}" if len(o.ranks) == 1 else \
            f"ranks {','.join(map(str, o.ranks))}"
        times = f" ({o.outages} outages)" if o.outages > 1 else ""
        lost = f"{o.dropped} records dropped" if o.dropped else "nothing lost"
        extras.append(f"{who} could not reach the collector for {o.seconds:g} s{times}; "
                      f"{o.resent} batches re-sent; {lost}")
    for what, ranks in getattr(summary, "refused_files", {}).items():
        extras.append(f"{_who(ranks)} refused a file that is not the job's own and recorded "
                      f"in a private place instead: {what}")
    for r, error in summary.thread_errors.items():
        extras.append(f"rank {r}: a thread ended by an exception, the process went on: "
                      f"{error}")
    return extras


def render(findings: list[Finding], summary: Summary, console: Console | None = None,
           max_unverified: float = DEFAULT_MAX_UNVERIFIED) -> None:
    console = console or Console()
    if not console.is_terminal:
        console.width = max(console.width, 160)
    console.print(Text(_head(summary), style="bold"))
    for line in _extras(summary):
        console.print(Text.assemble(("  ! ", "yellow"), line))
    _render_unfinished(summary, console)
    for line in _failed_lines(summary):
        console.print(Text(line, style="bold red"))
    if summary.ops:
        console.print(_op_table(summary.ops))
    _render_unfired(summary, console)
    if summary.lateness:
        console.print(lateness_table(summary.lateness),
                      lateness_table(summary.lateness_by_host, per_host=True))
    if not summary.records and not findings:
        console.print(Text(_empty_cause(summary), style="yellow"))
        return
    if not findings:
        _render_no_findings(summary, console, max_unverified)
        return
    for s in summary.suspects:
        console.print(Text(describe(s), style="bold red"))
    first = first_divergence(findings)
    table = Table(title=f"{len(findings)} findings", show_lines=False)
    sites = [_short(f.callsite) for f in findings]
    for col in ("#", "kind", "op", "group", "seq", "step", "culprits", "hosts", "call site",
                "how far apart"):
        wide = max((len(x) for s in sites for x in s.split("\n")), default=0) \
            if col == "call site" else None
        table.add_column(col, overflow="fold", min_width=min(wide, 40) if wide else None)
    for i, f in enumerate(findings):
        style = "bold red" if i == first else None
        kind = f"{f.kind}" + (" (ambiguous)" if f.ambiguous else "") + \
            (" (injected)" if f.injected else "")
        mark = f"{i + 1}{' FIRST' if i == first else ''}"
        cells = (mark, kind, f.op, f.group, str(f.seq), str(f.step), _ranks(f.culprits),
                 ",".join(f.hosts), sites[i], _how_far(f))
        table.add_row(*(Text(c) for c in cells), style=style)
    console.print(table)
    tally = Table(title="culprit tally")
    tally.add_column("rank")
    tally.add_column("findings")
    for r, n in summary.by_rank.items():
        tally.add_row(Text(r), str(n))
    host_tally = Table(title="host tally")
    host_tally.add_column("host")
    host_tally.add_column("findings")
    for h, n in summary.by_host.items():
        host_tally.add_row(Text(h), str(n))
    console.print(tally, host_tally)
    if summary.link_matrix:
        console.print(_matrix(summary.link_matrix))


def _render_no_findings(summary: Summary, console: Console, max_unverified: float) -> None:
    """The verdict of a run without findings: clean only when nothing says otherwise."""
    said = False
    if summary.failed:
        console.print(Text("no findings in the verified collectives, but training failed "
                           "(above)", style="bold yellow"))
        said = True
    if summary.unverified_share > max_unverified:
        console.print(Text(
            f"too little verified to call it clean: {_percent(summary.unverified_share)} of "
            f"the collectives not verified (records dropped; the limit is "
            f"{_percent(max_unverified)}, --max-unverified)", style="bold yellow"))
        said = True
    if not said:
        console.print("[green]no findings: every verified collective was consistent[/]")


def _render_unfinished(summary: Summary, console: Console) -> None:
    if not summary.unfinished:
        return
    console.print(Text(f"the run did not finish: {unfinished_count(summary)} of "
                       f"{summary.world or summary.ranks} ranks never said goodbye",
                       style="bold red"))
    for s in summary.stopped:
        console.print(Text(f"  {stopped_line(s)}"))
    for u in summary.unfinished[:32]:
        if u.never_reported:
            what = ("never reported (did it start? was commcheck.patch() called? a rank that "
                    "could not make its record ring says why on its stderr)")
        elif u.last is None:
            what = "connected, entered no collective"
        else:
            site = _short(u.last.callsite).replace("\n", " ")
            what = f"last entered {u.last.op} {u.last.at} at {site}"
        host = f" ({u.host})" if u.host else ""
        console.print(Text(f"  {u.label}{host}: {what}"))
    if len(summary.unfinished) > 32:
        more = sum(u.count for u in summary.unfinished[32:])
        console.print(Text(f"  ... and {_n(more, 'more rank')}"))


def _render_unfired(summary: Summary, console: Console) -> None:
    """Injected faults that never fired, with what their rank recorded instead."""
    tallies = summary.unfired_faults
    if not tallies:
        return
    n = sum(len(t.unfired) for t in tallies)
    console.print(Text(f"{_n(n, 'injected fault')} never fired (COMMCHECK_INJECT names ops "
                       f"as recorded; see the README's fault injection)", style="bold yellow"))
    for t in tallies:
        own = [f for f in t.unfired if f"rank={t.rank}," in f]
        if own:
            console.print(Text(f"  rank {t.rank}: {'; '.join(own)}: it recorded "
                               f"{describe_recorded(t.recorded)}"))
        for f in t.unfired:
            if f not in own:
                console.print(Text(f"  {f}: no such rank in the world"))


def _empty_cause(summary: Summary) -> str:
    """An empty database names its likely cause."""
    if not summary.ranks:
        return ("empty database: no rank ever connected. Was commcheck.patch() called in the "
                "training script before init_process_group (or the script started with "
                "`commcheck run`)? Is COMMCHECK_COLLECTOR set on every rank and this "
                "collector's address reachable from them?")
    return (f"empty database: {_n(summary.ranks, 'rank')} connected but recorded no "
            f"collective: the job ended or died before its first collective")


def _op_table(ops: list[OpTally]) -> Table:
    """What was recorded and verified, per op name as recorded (the names fault injection
    and the README use)."""
    t = Table(title="per op")
    for col in ("op", "calls recorded (all ranks)", "collectives verified"):
        t.add_column(col, justify="left" if col == "op" else "right")
    for o in ops:
        t.add_row(o.op, str(o.recorded), str(o.verified))
    return t


def _matrix(cells: list[tuple[int, int, int]]) -> Table:
    """Corrupted chunks, sources down, destinations across."""
    srcs = sorted({c[0] for c in cells})
    dsts = sorted({c[1] for c in cells})
    count = {(s, d): n for s, d, n in cells}
    t = Table(title="corrupted chunks, src → dst")
    t.add_column("src \\ dst")
    for d in dsts:
        t.add_column(str(d), justify="right")
    for s in srcs:
        t.add_row(str(s), *(str(count.get((s, d), "")) for d in dsts))
    return t
