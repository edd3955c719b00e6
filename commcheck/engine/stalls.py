"""Runs that stall: ranks that died, members that never entered, collectives nobody leaves.

``Engine.check_hangs`` (every second in the collector, and at the end of a run) asks
:class:`Stalls` what the open keys of both paths and the relays' liveness say, once per
cause (DESIGN.md §3 rule 7):

* ``rank_died`` — a rank the relay saw gone without a goodbye, at the first check after
  (the hang timeout plays no part; one stopped by a signal ``HOLD_S`` later, to tell a run
  stopped together — a cancelled job, nobody's death — from a rank stopped alone). It
  names the rank's last completed call, the one it entered and never completed, and what
  the other members wait in; collectives it leaves waiting are counted into it, not
  reported again.
* ``missing_rank`` — a key some members entered ``hang_timeout`` s ago (from the first
  entry) while others never did; once per (run, group, missing ranks), later keys of the
  group with the same missing ranks folded into it. None when only dead ranks are missing.
* ``hang`` — a key every member entered, not all completed, the last entry
  ``hang_timeout`` s ago; once per (run, group), later ones folded. Culprits: the members
  liveness shows frozen (or dead), else every member that did not complete (ambiguous).
  None when a dead rank is among those that did not complete (its ``rank_died`` says it),
  when the members disagree on the call (``desync`` says it), or when each of them was
  stopped by a signal within ``hang_timeout`` of entering it (Ctrl-C: not verified; the
  same for a ``missing_rank`` whose missing members were stopped by a signal too).

Keys are checked in the order they opened, so the fast and the exact engine report alike.
A reported (or folded, or counted) key is marked and never looked at again.
"""

from __future__ import annotations

import math
import signal
from typing import Protocol

import msgspec

from ..wire import PHASE_COMPLETE, PHASE_ENTRY
from .drops import DROPPED, LATER, LOST, Dropped
from .exact import Onset
from .findings import (
    CallAt,
    Doing,
    Finding,
    Hang,
    Kind,
    LastCall,
    MissingRank,
    RankDied,
    WaitingIn,
)
from .handoff import Pending
from .model import Key, group_label
from .state import ALIVE, GONE, STOPPED, Call, Condition, Liveness, RankCondition, RankState

MAX_WAITING = 16  # collectives a rank_died lists (it counts them all)
CRASHED = "crashed"  # a member whose call of the collective raised (RankState.failed)
_ORDER = {str(c): i for i, c in enumerate((Condition.DEAD, CRASHED, Condition.FROZEN,
                                           Condition.BLOCKED, Condition.PROGRESSING,
                                           Condition.FINISHED))}


class OpenView(Protocol):
    """What the stall checks read of the engine (``core.Engine``)."""

    ranks: dict[int, RankState]
    hang_timeout: float
    dropped: Dropped

    @property
    def onsets(self) -> dict[tuple, Onset]: ...

    def pending(self, now: float, final: bool) -> list[Pending]:
        """Open keys not reported yet, first opened first (see FastPath.hang_candidates)."""

    def involving(self, rank: int, run: str) -> list[Pending]:
        """Open keys of ``run``'s groups that ``rank`` did not complete and another member
        entered, first opened first, reported or not."""

    def condition(self, rank: int, now: float, run: str | None = None) -> RankCondition: ...

    def state(self, run: str, rank: int) -> RankState | None: ...

    def completed_by(self, rank: int, key: Key) -> bool:
        """Whether ``rank`` completed ``key`` (a key no longer open counts as completed)."""


def dead_without_goodbye(state: RankState, liveness: Liveness) -> bool:
    return liveness.state == GONE and not (liveness.goodbye or state.goodbye)


class Stalls:
    """The deaths seen and reported; the folded missing ranks and hangs are onsets."""

    def __init__(self) -> None:
        # (run, rank) -> its rank_died finding, whose collectives_left_waiting keeps counting
        self.deaths: dict[tuple[str, int], Finding] = {}
        # (run, rank) -> the latest liveness of a rank seen gone without a goodbye, not yet
        # reported (a goodbye that arrives before the next check cancels it)
        self.dying: dict[tuple[str, int], Liveness] = {}
        # (run, rank) seen stopped (SIGSTOP, a debugger): a frozen rank waited for nobody
        self.frozen: set[tuple[str, int]] = set()
        # run -> its hang and missing_rank findings with their keys, as reported: a
        # launcher's teardown while one is unresolved is its consequence (docs/report-status.md)
        self.stalled: dict[str, list[tuple[Key, Finding]]] = {}
        # (run, rank) -> when the collector first saw it gone without a goodbye (its clock)
        self.held: dict[tuple[str, int], float] = {}
        # (run, rank) -> the stop signal, for the ranks of a run stopped together (a
        # cancelled job, a time limit): dead for the keys they keep open, and no finding
        self.stopped: dict[tuple[str, int], int] = {}

    def __setstate__(self, d: dict) -> None:
        """Stalls pickled before stopped runs were told apart start with none."""
        self.__dict__.update({"held": {}, "stopped": {}, **d})

    def observe(self, run: str, rank: int, state: RankState, now: float = 0.0) -> None:
        """``state.liveness`` was just set (at ``now``, the collector's clock): remember a
        death until the next check, and a rank seen stopped."""
        if state.liveness.state == STOPPED:
            self.frozen.add((run, rank))
        elif state.liveness.state == ALIVE:  # continued (SIGCONT, a debugger let go)
            self.frozen.discard((run, rank))
        key = (run, rank)
        if key not in self.deaths and key not in self.stopped and \
                dead_without_goodbye(state, state.liveness):
            first = self.dying.get(key)  # seen again while held: it went when first seen
            self.dying[key] = state.liveness if first is None else \
                msgspec.structs.replace(state.liveness, seen_t=first.seen_t)
            self.held.setdefault(key, now)

    def counters(self) -> dict[str, int]:
        """``stopped.<rank>``: the stop signal of each rank of a run stopped together."""
        return {f"stopped.{rank}": sig for (_, rank), sig in self.stopped.items()}

    def check(self, e: OpenView, now: float, final: bool) -> list[Finding]:
        found = self._report_deaths(e, now, final)
        dead: dict[str, set[int]] = {}
        for run, rank in [*self.deaths, *self.stopped]:
            dead.setdefault(run, set()).add(rank)
        lost = _Lost(e)
        for p in e.pending(now, final):
            if not p.ranks_in:
                continue
            run, _, granks, _ = p.key
            dead_here = dead.get(run, set())
            missing = [r for r in granks if r not in p.ranks_in]
            if missing:
                if not final and now - p.t_first < e.hang_timeout:
                    continue
                p.mark()
                why = {r: lost(p.key, r) for r in missing}
                excused = [r for r in missing if why[r]]
                if excused:  # dropped is never missing: not verified, counted
                    missing = [r for r in missing if r not in excused]
                    if all(r in dead_here for r in missing):  # counted at the death
                        e.dropped.count(p.key, excused, _not_said(why))
                        continue
                if all(r in dead_here for r in missing):  # their rank_died says it
                    self._left_waiting(run, missing)
                    continue
                if _ended_around(e, p, [r for r in p.ranks_in if r not in p.done], missing):
                    continue  # not verified (unmatched), no finding
                onset_key: tuple = (Kind.MISSING_RANK, *p.key[:3], tuple(missing))
                if not _folded(e, onset_key):
                    found.append(_missing(e, p, missing, now))
                    e.onsets[onset_key] = Onset(found[-1])
                    self.stalled.setdefault(run, []).append((p.key, found[-1]))
                continue
            stuck = [r for r in granks if r not in p.done]
            if not stuck or p.desynced:  # a desync is its own finding (and likely the cause)
                continue
            if not final and now - p.t_last < e.hang_timeout:
                continue
            p.mark()
            why = {r: lost(p.key, r) for r in stuck}
            excused = [r for r in stuck if why[r]]
            if excused:
                stuck = [r for r in stuck if r not in excused]
                if all(r in dead_here for r in stuck):  # counted at the death
                    e.dropped.count(p.key, excused, _not_said(why))
                    continue
            dead_stuck = [r for r in stuck if r in dead_here]
            if dead_stuck:  # their rank_died says it
                self._left_waiting(run, dead_stuck)
                continue
            if _ended_around(e, p, stuck):  # not verified (unmatched), no finding
                continue
            onset_key = (Kind.HANG, *p.key[:3])
            if not _folded(e, onset_key):
                found.append(_hang(e, p, stuck, now))
                e.onsets[onset_key] = Onset(found[-1])
                self.stalled.setdefault(run, []).append((p.key, found[-1]))
        return found

    def _stopped_together(self, e: OpenView, dying: list[tuple[str, int, Liveness]],
                          now: float, final: bool) -> list[tuple[str, int, Liveness]]:
        """The deaths that are not a whole run stopped together. A scheduler's cancel or
        time limit signals every rank at once; their relays report at different moments, so
        a run whose deaths are all by stop signals waits ``HOLD_S`` from the first (until the
        next check after, or the end). Then, if every rank of the run was stopped by a
        signal within ``STOP_WINDOW_S`` of the others (or said goodbye ending by one), none
        froze, none failed first and no stall was reported, the run was stopped: those
        ranks are dead for the keys they keep open (not verified) and no finding names
        them. Otherwise they go on as deaths (each its own, or a failure's consequence)."""
        runs: dict[str, list[tuple[str, int, Liveness]]] = {}
        for item in dying:
            runs.setdefault(item[0], []).append(item)
        rest = []
        for run, items in runs.items():
            if any(lv.signal not in STOP_SIGNALS or (run, r) in self.frozen
                   for _, r, lv in items) or self.stalled.get(run) or \
                    any(rn == run and f.culprits == [r] for (rn, r), f in self.deaths.items()):
                rest += items  # a failure, a frozen rank, a stall or a death came first
                continue
            first = min(self.held.get((run, r), now) for _, r, _ in items)
            if not final and now - first < HOLD_S:
                self.dying.update({(run, r): lv for _, r, lv in items})  # the next check
                continue
            seen = [lv.seen_t for _, _, lv in items]
            gone = {r for _, r, _ in items}
            members = {r for r, state in e.ranks.items() if state.run == run}
            if max(seen) - min(seen) > STOP_WINDOW_S or \
                    not all(_ended_by_stop(e.state(run, r)) for r in members - gone):
                rest += items
                continue
            for _, r, lv in items:
                self.stopped[(run, r)] = lv.signal
            dead = {r for rn, r in self.stopped if rn == run}
            for r in gone:
                for p in e.involving(r, run):
                    if _explained(p, dead):
                        p.mark()
        return rest

    def _first_causes(self, dying: list[tuple[str, int, Liveness]],
                      waited: dict[tuple[str, int], int | None]
                      ) -> dict[str, tuple[tuple[float, int] | None, tuple[float, int] | None]]:
        """Per run, the first (seen time, rank) of the deaths that are causes: one that no
        stop signal explains, and one stopped by a signal (see :func:`_stopped_for`)."""
        first: dict[str, list] = {}
        roots = [(rn, f.t, r, _stop_signal(f)) for (rn, r), f in self.deaths.items()
                 if f.culprits == [r] and isinstance(f.detail, RankDied)]
        roots += [(rn, lv.seen_t, r, lv.signal in STOP_SIGNALS) for rn, r, lv in dying
                  if waited[(rn, r)] is None]
        for run, t, r, stopped in roots:
            slot = first.setdefault(run, [None, None])
            if slot[stopped] is None or (t, r) < slot[stopped]:
                slot[stopped] = (t, r)
        return {run: (failed, stopped) for run, (failed, stopped) in first.items()}

    def _torn_down(self, e: OpenView, dying: list[tuple[str, int, Liveness]],
                   dead: dict[str, set[int]]) -> list[tuple[str, int, Liveness]]:
        """The deaths that are no stall's teardown. While a hang or missing_rank reported
        earlier is unresolved (a member never completed its collective), a rank of it that
        died (stuck in it, then killed), or any rank stopped by a signal (a launcher
        cancelling the hung job), is that stall's consequence: named in its ``then_gone``,
        not reported (docs/report-status.md, part 3)."""
        rest = []
        for run, rank, lv in dying:
            stalls = [f for key, f in self.stalled.get(run, [])  # those still unresolved
                      if not all(e.completed_by(r, key) for r in key[2])]
            mine = [f for f in stalls if rank in _stall_ranks(f)]
            cause = mine[0] if mine else stalls[0] if stalls and \
                lv.signal in STOP_SIGNALS else None
            if cause is None:
                rest.append((run, rank, lv))
                continue
            self._consequence(e, run, rank, cause, dead[run])
        return rest

    def _consequence(self, e: OpenView, run: str, rank: int, cause: Finding,
                     dead: set[int]) -> None:
        """``rank``'s death is ``cause``'s: named in its ``then_gone``, not reported, and the
        keys the dead explain marked."""
        cause.detail.then_gone = sorted({*cause.detail.then_gone, rank})
        self.deaths[(run, rank)] = cause
        for p in e.involving(rank, run):
            if _explained(p, dead):
                p.mark()

    def _left_waiting(self, run: str, ranks: list[int]) -> None:
        """A key that only dead ranks keep open counts into each one's rank_died (a rank of
        a run stopped together has none: the key is not verified, and that is all)."""
        for r in ranks:
            if (run, r) not in self.deaths:
                continue
            detail = self.deaths[(run, r)].detail
            if isinstance(detail, RankDied):  # not a stall's teardown (then_gone of a hang)
                detail.collectives_left_waiting += 1

    def _report_deaths(self, e: OpenView, now: float, final: bool) -> list[Finding]:
        """rank_died for each death seen since the last check, unless the rank's goodbye
        arrived meanwhile. All of them count as dead for the keys each one explains. A rank
        that died while waiting for another dead rank (torchrun stops the others once one
        rank failed) is that death's consequence: named in its ``then_gone``, not reported.
        A run stopped together is nobody's death (:meth:`_stopped_together`)."""
        dying = [(run, rank, lv) for (run, rank), lv in sorted(self.dying.items())
                 if not (e.ranks[rank].run == run and e.ranks[rank].goodbye)]
        self.dying.clear()
        dying = self._stopped_together(e, dying, now, final)
        dead: dict[str, set[int]] = {}
        for run, rank in [*self.deaths, *((run, rank) for run, rank, _ in dying)]:
            dead.setdefault(run, set()).add(rank)
        dying = self._torn_down(e, dying, dead)
        seen_t = {key: f.t for key, f in self.deaths.items()}
        seen_t.update({(run, rank): lv.seen_t for run, rank, lv in dying})
        stops = {(run, rank): lv.seen_t for run, rank, lv in dying
                 if lv.signal in STOP_SIGNALS}
        stops.update({key: f.t for key, f in self.deaths.items() if _stop_signal(f)})
        waited = {(run, rank): None if (run, rank) in self.frozen else
                  _waited_for(e, run, rank, dead[run], seen_t, stops)
                  for run, rank, _ in dying}
        first = self._first_causes(dying, waited)
        for run, rank, lv in dying:
            if waited[(run, rank)] is None and lv.signal in STOP_SIGNALS:
                waited[(run, rank)] = _stopped_for(*first[run], lv.seen_t)
        found = []
        for run, rank, lv in dying:
            if _root(waited, run, rank) is None:
                f = self.deaths[(run, rank)] = _died(e, run, rank, lv, dead[run])
                found.append(f)
        for run, rank, _ in dying:
            root = _root(waited, run, rank)
            if root is not None:
                self._consequence(e, run, rank, self.deaths[(run, root)], dead[run])
        return found


# what a launcher, a terminal or a lost session stops ranks with (a SIGKILL is a failure:
# the OOM killer's, or a launcher's only after its grace period)
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


def _stop_signal(f: Finding) -> bool:
    return isinstance(f.detail, RankDied) and f.detail.signal in STOP_SIGNALS


# Ranks stopped by a signal within this many seconds of each other (as their relays saw
# them gone) were signalled together: one launcher's teardown, never each other's cause.
# A relay reports a change within ~0.1 s; a pod evicted before the teardown is earlier.
STOP_WINDOW_S = 0.5


# How long a death by a stop signal waits (collector clock) for the rest of its run's, to
# tell a run stopped together from a rank stopped alone (relays report changes within ~0.1 s).
HOLD_S = 1.5


def _ended_by_stop(state: RankState | None) -> bool:
    """Whether ``state``'s goodbye says its process ended by a stop signal (Ctrl-C)."""
    return state is not None and state.said_goodbye and state.ending is not None and \
        state.ending[2] in STOP_SIGNALS


def _stopped_for(failed: tuple[float, int] | None, stopped: tuple[float, int] | None,
                 seen_t: float) -> int | None:
    """The death a launcher stopped a rank seen at ``seen_t`` for (torchrun, srun and
    Kubernetes SIGTERM the other ranks once one failed): the first death of its run, seen no
    later, that no stop signal explains; else the first one stopped by a signal, seen more
    than ``STOP_WINDOW_S`` earlier (a pod evicted: the rank stopped first is the cause).
    None if there is none: ranks stopped together (a cancelled job) are each their own
    finding."""
    if failed is not None and failed[0] <= seen_t:
        return failed[1]
    if stopped is not None and stopped[0] < seen_t - STOP_WINDOW_S:
        return stopped[1]
    return None


def _waited_for(e: OpenView, run: str, rank: int, dead: set[int],
                seen_t: dict[tuple[str, int], float],
                stops: dict[tuple[str, int], float]) -> int | None:
    """The dead rank that ``rank`` was waiting for when it died: one missing from a
    collective ``rank`` entered and did not complete, or stuck in it too and seen dead
    earlier. None: it waited for no dead rank (its own death is a cause). Two ranks stopped
    by signals within ``STOP_WINDOW_S`` (``stops``: when each was seen) were signalled
    together: neither waited for the other."""
    mine = seen_t[(run, rank)]
    my_stop = stops.get((run, rank))
    for p in e.involving(rank, run):
        if rank not in p.ranks_in:
            continue
        for other in sorted(dead - {rank}):
            other_stop = stops.get((run, other))
            if my_stop is not None and other_stop is not None and \
                    abs(my_stop - other_stop) <= STOP_WINDOW_S:
                continue
            if other not in p.ranks_in:
                return other
            if other not in p.done and seen_t.get((run, other), mine) < mine:
                return other
    return None


def _stall_ranks(f: Finding) -> set[int]:
    """The ranks a hang or missing_rank concerns: those that did not complete it, those
    missing from it and those that waited."""
    d = f.detail
    if isinstance(d, Hang):
        return {*d.not_completed, *f.culprits}
    if isinstance(d, MissingRank):
        return {*f.culprits, *d.waiting}
    return set(f.culprits)


def _root(waited: dict[tuple[str, int], int | None], run: str, rank: int) -> int | None:
    """The first death a chain of waits leads to from ``rank`` (None: ``rank`` is one, or
    the chain loops, and then every death in it is reported)."""
    seen = {rank}
    cause = waited.get((run, rank))
    while cause is not None:
        if cause in seen:
            return None
        seen.add(cause)
        nxt = waited.get((run, cause))
        if nxt is None:
            return cause
        cause = nxt
    return None


class _Lost:
    """Whether a member's absence from a collective is explained by records it lost, not
    by the member: it said it dropped them (either phase), its later records of the group
    arrived (it went past this seq), or it said goodbye with records counted lost
    (damaged in its ring, or failed to encode)."""

    def __init__(self, e: OpenView):
        self.e = e

    def __call__(self, key: Key, rank: int) -> str:
        """Why (DROPPED: the rank said so; LATER, LOST: its records were lost), or ""."""
        e = self.e
        if e.dropped.dropped(key, rank, PHASE_ENTRY) or \
                e.dropped.dropped(key, rank, PHASE_COMPLETE):
            return DROPPED
        state = e.ranks.get(rank)
        if state is None:
            return ""
        for call in (state.last, state.last_done):
            if call is not None and call.key[:3] == key[:3] and call.key[3] > key[3]:
                return LATER
        c = state.counters
        lost = state.said_goodbye and c.get("errors", 0) + c.get("rejected_entries", 0) > 0
        return LOST if lost else ""


def _not_said(why: dict[int, str]) -> list[int]:
    """The ranks whose records were lost, not dropped (no rank said so)."""
    return [r for r, w in why.items() if w and w != DROPPED]


def _folded(e: OpenView, onset_key: tuple) -> bool:
    """Count into the onset of ``onset_key``, if there is one."""
    onset = e.onsets.get(onset_key)
    if onset is None:
        return False
    onset.fold()
    return True


# -- building the findings ----------------------------------------------------------------------


def _call_at(call: Call | None) -> CallAt | None:
    if call is None:
        return None
    return CallAt(op=call.meta.op, at=call.at, callsite=call.meta.callsite)


def _at(key: Key) -> str:
    return f"{group_label(key[1], key[2])} seq {key[3]}"


def _explained(p: Pending, dead: set[int]) -> bool:
    """Whether dead ranks alone keep ``p`` open: they are all its missing members, or, when
    every member entered, one of those that did not complete."""
    granks = p.key[2]
    missing = [r for r in granks if r not in p.ranks_in]
    if missing:
        return all(r in dead for r in missing)
    return any(r in dead for r in granks if r not in p.done)


def _died(e: OpenView, run: str, rank: int, lv: Liveness, dead: set[int]) -> Finding:
    """The rank_died of ``rank``; marks the keys that only dead ranks keep open."""
    state = e.state(run, rank) or e.ranks[rank]
    last = state.last if state.last is not None and state.last.key[0] == run else None
    done = state.last_done if state.last_done is not None and state.last_done.key[0] == run \
        else None
    stuck_in = last if last is not None and not e.completed_by(rank, last.key) else None
    waiting: list[WaitingIn] = []
    left = 0
    for p in e.involving(rank, run):
        left += 1
        ranks = sorted(r for r in p.ranks_in if r != rank and r not in p.done)
        if ranks and len(waiting) < MAX_WAITING:
            m = p.entered[ranks[0]]
            waiting.append(WaitingIn(op=m.op, at=_at(p.key), callsite=m.callsite, ranks=ranks,
                                     crashed=_crashed(e, p.key, ranks)))
        if _explained(p, dead):
            p.mark()
    where = last or done
    detail = RankDied(
        pid=lv.pid, exit_code=lv.exit_code if lv.exit_code >= 0 else None,
        signal=lv.signal or None, last_completed=_call_at(done),
        last_entered=_call_at(stuck_in), waiting=waiting, collectives_left_waiting=left)
    return Finding(
        kind=Kind.RANK_DIED, run=run, op=where.meta.op if where else "",
        group=group_label(where.key[1], where.key[2]) if where else "",
        seq=where.key[3] if where else -1, step=where.meta.step if where else 0,
        culprits=[rank], hosts=[state.host] if state.host else [],
        callsite=where.meta.callsite if where else "", detail=detail, t=lv.seen_t)


def _missing(e: OpenView, p: Pending, missing: list[int], now: float) -> Finding:
    run, gname, granks, seq = p.key
    last: dict[str, LastCall | None] = {}
    for r in missing:
        state = e.state(run, r)
        call = state.last if state is not None else None
        if call is None:
            last[str(r)] = None
            continue
        last[str(r)] = LastCall(
            op=call.meta.op, at=call.at, callsite=call.meta.callsite,
            ago_s=round(now - call.meta.t_enter, 3) if math.isfinite(now) else None,
            said_goodbye=state.goodbye)
    entered = p.entered
    waiting = sorted(entered)
    any_meta = entered[waiting[0]]
    return Finding(
        kind=Kind.MISSING_RANK, run=run, op=any_meta.op, group=group_label(gname, granks),
        seq=seq, step=min(m.step for m in entered.values()), culprits=missing,
        hosts=sorted({e.ranks[r].host for r in missing if r in e.ranks}),
        callsite=any_meta.callsite,
        detail=MissingRank(waiting=waiting, waited_s=round(now - p.t_first, 3)
                           if math.isfinite(now) else None, last=last,
                           not_waiting=_not_waiting(e, p.key, waiting, now),
                           crashed=_crashed(e, p.key, waiting)),
        t=p.t_first)


def _crashed(e: OpenView, key: Key, ranks: list[int]) -> dict[str, str]:
    """The errors ``ranks`` said their call of ``key`` raised, by rank."""
    out = {}
    for r in ranks:
        state = e.state(key[0], r)
        error = state.failed.get(key) if state is not None else None
        if error is not None:
            out[str(r)] = error
    return out


def _not_waiting(e: OpenView, key: Key, entered: list[int], now: float) -> dict[str, str]:
    """The ranks that entered and are not known to wait (see ``MissingRank.not_waiting``)."""
    out = {}
    run = key[0]
    for r in entered:
        state = e.state(run, r)
        if state is None:
            continue
        if key in state.failed:
            out[str(r)] = CRASHED
            continue
        cond = e.condition(r, now, run).condition
        word = {Condition.DEAD: "died", Condition.FINISHED: "finished"}.get(cond)
        if word is None and state.liveness is not None and state.liveness.state == STOPPED:
            word = "stopped"
        if word is None and state.liveness is None and math.isfinite(now) \
                and now - state.last_t >= e.hang_timeout:
            word = "silent"
        if word is not None:
            out[str(r)] = word
    return out


def _ended_around(e: OpenView, p: Pending, stuck: list[int], missing: tuple | list = ()
                  ) -> bool:
    """The run was stopped around this call, nobody hung in it (Ctrl-C, a cancelled job):
    every member that entered and did not complete, and every member that never entered,
    said goodbye ending by a stop signal (SIGINT, SIGTERM, SIGHUP), and each of the former
    less than ``hang_timeout`` s after it entered (by its own clock), without its call
    raising. The call is then not verified (unmatched), no finding. A member that sat in it
    for longer first, whose call raised (a timeout, a peer gone), or that ended otherwise
    (an exception of its own: the others were torn down for it) keeps the finding."""
    run = p.key[0]
    if not stuck:
        return False
    for r in (*stuck, *missing):
        state = e.state(run, r)
        if state is None or not state.said_goodbye or state.ending is None or \
                state.ending[2] not in STOP_SIGNALS:
            return False
    for r in stuck:
        state = e.state(run, r)
        if p.key in state.failed or state.last_t - p.entered[r].t_enter >= e.hang_timeout:
            return False
    return True


def _hang(e: OpenView, p: Pending, stuck: list[int], now: float) -> Finding:
    run, gname, granks, seq = p.key
    conds = {r: e.condition(r, now, run) for r in granks}
    bad = [r for r in granks if conds[r].condition in (Condition.DEAD, Condition.FROZEN)]
    culprits, ambiguous = (bad, False) if bad else (stuck, True)
    entered = p.entered
    first = entered[culprits[0]]
    return Finding(
        kind=Kind.HANG, run=run, op=first.op, group=group_label(gname, granks), seq=seq,
        step=min(m.step for m in entered.values()), culprits=culprits,
        hosts=sorted({e.ranks[r].host for r in culprits if r in e.ranks}),
        callsite=first.callsite,
        detail=Hang(not_completed=stuck,
                    waited_s=round(now - p.t_last, 3) if math.isfinite(now) else None,
                    doing=_doing(conds, _crashed(e, p.key, stuck))),
        ambiguous=ambiguous, t=p.t_last)


def _doing(conds: dict[int, RankCondition], crashed: dict[str, str]) -> list[Doing]:
    """Members grouped by condition and last entered call: dead, crashed and frozen first.
    A member whose call raised is "crashed" with its error, whatever its process does."""
    groups: dict[tuple, tuple[list[int], list[float]]] = {}
    for r, c in conds.items():
        last = c.last
        error = crashed.get(str(r))
        k = (str(c.condition) if error is None else CRASHED, last.meta.op if last else None,
             last.at if last else None, last.meta.callsite if last else None, error)
        ranks, idle = groups.setdefault(k, ([], []))
        ranks.append(r)
        if c.idle_s is not None:
            idle.append(c.idle_s)
    out = [Doing(ranks=sorted(ranks), condition=cond, op=op, at=at, callsite=callsite,
                 idle_s=round(max(idle), 3) if idle else None, error=error)
           for (cond, op, at, callsite, error), (ranks, idle) in groups.items()]
    out.sort(key=lambda d: (_ORDER[d.condition], d.ranks[0]))
    return out
