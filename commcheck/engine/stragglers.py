"""Stragglers named live: the rank, or the node pair's link, that makes the others wait.

Fed the finished collectives of :mod:`.lateness`, this module keeps each group's last
``window`` collectives and raises a ``straggler`` finding once per rank (or host pair, or
node) and episode (docs/stragglers.md):

* **a slow rank**: at least ``majority`` of the others' waiting over a full window was for
  it (it arrived last where they waited: a rank slow to compute is late to the first
  collective after its compute; the rest of the step runs in lockstep, so counting last
  arrivals alone would dilute it), it was clearly late (behind by at least half its usual
  lead) in at least an eighth of the window (one hiccup is no straggler), and the others
  waited for it at least ``cost`` of their wall time over that window. Send/recv pairs are
  not voted on (a receiver waiting for its sender is the schedule, not a straggler), nor is
  a rank in a group that also holds its send/recv partners (a pipeline's stage skew). The
  episode ends once every group that found it sees its share of the waiting under half
  ``majority`` or its cost under half ``cost``.
* **a slow link**: the two members of exchanges (send/recv, 2-rank groups) between two
  hosts arrive together, but the exchange itself (the smallest wait) takes ``link_factor``
  times the median of the other host pairs', per element, over a window; or every pair of
  one node does, against the pairs without it (**a node's links**: three hosts suffice).
  A rank is not named while one of its host's pairs is slow in its last exchanges: a rank
  that waited for a slow exchange comes late to the next one, which is the link's doing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

import numpy as np

from .findings import Finding, Kind, Straggler
from .ids import Ids

MAX_KEPT = 1024  # findings kept to update (a shard sends them all with its onsets)
HISTORY = 4  # windows of each group kept to place an episode's start (judged: the last one)
ONSET_GAIN = 4.0  # log-likelihood a later start must gain to be taken (a Bernoulli split)
MIN_LINK_WAIT = 0.005  # a slow pair's median exchange exceeds the others' by at least this
RECENT = 8  # a pair's last exchanges that say its link is slow now (a rank's veto)
CHANCE = 1e-3  # a straggler's share of far-behind arrivals is this unlikely by chance
MIN_LATE_SHARE = 8  # a straggler was clearly late in at least 1/8 of a window (not one hiccup)


class RulesError(ValueError):
    """A straggler setting that cannot be used (one line)."""


@dataclass(frozen=True)
class StragglerRules:
    """When a rank is a straggler; ``collect --straggler`` / ``run --straggler`` / the
    config file's ``straggler`` key, as ``key=value,...`` (or ``off``)."""

    window: int = 64  # collectives of one group judged together (a sliding window)
    majority: float = 0.6  # share of the others' waiting in them that was for the rank
    cost: float = 0.05  # share of the others' wall time spent waiting for it
    link_factor: float = 4.0  # a slow pair's exchanges take this many times the others'
    enabled: bool = True

    @classmethod
    def parse(cls, spec: str) -> StragglerRules:
        spec = spec.strip()
        if spec in ("", "on"):
            return cls()
        if spec == "off":
            return cls(enabled=False)
        values: dict[str, float | int] = {}
        names = {f.name: f.type for f in fields(cls) if f.name != "enabled"}
        for part in spec.split(","):
            key, sep, text = part.partition("=")
            key = key.strip()
            if not sep or key not in names:
                raise RulesError(f"straggler setting {part.strip()!r}: expected off or "
                                 f"key=value with key one of {', '.join(names)}")
            try:
                values[key] = int(text) if key == "window" else float(text)
            except ValueError:
                raise RulesError(f"straggler setting {key}={text.strip()!r} is not a "
                                 "number") from None
        rules = cls(**values)  # type: ignore[arg-type]
        if rules.window < 8 or not 0.5 < rules.majority <= 1 or not 0 < rules.cost < 1 \
                or rules.link_factor <= 1:
            raise RulesError(f"straggler settings {spec!r}: need window >= 8, "
                             "0.5 < majority <= 1, 0 < cost < 1, link_factor > 1")
        return rules


class _Episode:
    """One rank's (or host pair's) open episode: its finding, updated until it ends."""

    def __init__(self, finding: Finding[Straggler], holding: set[int]):
        self.finding = finding
        self.holding = holding  # windows whose last verdict still finds it
        self.others = 0.0  # the others' time in those windows' collectives since it began


class Stragglers:
    """Finished collectives (``ARRIVAL_DTYPE`` rows) in (:meth:`add`), ``straggler``
    findings out."""

    def __init__(self, rules: StragglerRules | None = None):
        self.rules = rules or StragglerRules()
        self.windows: dict[int, np.ndarray] = {}  # window id -> its last collectives
        self.older: dict[int, _Older] = {}  # window id -> the collectives before them
        self.pairs: dict[tuple[int, int], np.ndarray] = {}  # host ids -> exchange rows
        self.usual: dict[tuple[int, int], float] = {}  # host ids -> best window median
        self.partners: dict[int, set[int]] = {}  # rank -> its send/recv peers
        self.open: dict[tuple, _Episode] = {}
        self.changed: dict[int, Finding] = {}  # findings whose detail changed since taken
        self.raised: list[Finding] = []  # every finding raised (the latest MAX_KEPT)

    def __setstate__(self, d: dict) -> None:
        """One pickled before windows kept a history starts keeping it."""
        self.__dict__.update(d)
        self.__dict__.setdefault("older", {})

    def take_changed(self) -> list[Finding]:
        """Findings whose detail changed (cost, end) since the last call: to re-store."""
        out = list(self.changed.values())
        self.changed = {}
        return out

    def add(self, done: np.ndarray, ids: Ids, host_of: np.ndarray) -> list[Finding]:
        """Take finished collectives (``ARRIVAL_DTYPE``), judge the windows they touched."""
        if not self.rules.enabled or not len(done):
            return []
        done = done[np.argsort(done["wid"], kind="stable")]  # each window's rows in order
        return [f for part in _rounds(done, self.rules.window)
                for f in self._add_sorted(part, ids, host_of)]

    def _add_sorted(self, done: np.ndarray, ids: Ids, host_of: np.ndarray) -> list[Finding]:
        """:meth:`add` of at most a window's rows per window, sorted by window."""
        found: list[Finding] = []
        wids = done["wid"]
        cuts = np.flatnonzero(np.r_[True, wids[1:] != wids[:-1], True])
        spans = list(zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True))
        for a, b in spans:  # links first: a rank late after slow exchanges waited for them
            win = ids.windows[int(wids[a])]
            if win.name.startswith("p2p:") or len(win.ranks) == 2:
                self._note_pair(win.ranks, win.name.startswith("p2p:"))
                self._pair_rows(done[a:b], host_of, ids, found)
        for a, b in spans:
            w, rows = int(wids[a]), done[a:b]
            if ids.windows[w].name.startswith("p2p:"):
                continue
            self._follow(w, rows)
            kept = self._keep(w, rows)
            if len(kept) == self.rules.window:
                self._judge(w, kept, ids, host_of, found)
        self.raised = (self.raised + found)[-MAX_KEPT:]
        return found

    def _keep(self, w: int, rows: np.ndarray) -> np.ndarray:
        """Window ``w``'s last ``window`` collectives with ``rows`` (at most a window's:
        :meth:`add` takes larger blocks in rounds); those that fall out go to its history
        (:class:`_Older`)."""
        limit = self.rules.window
        old = self.windows.get(w)
        if old is not None and len(old) + len(rows) > limit:
            older = self.older.get(w)
            if older is None:
                older = self.older[w] = _Older((HISTORY - 1) * limit)
            older.add(old[:len(old) + len(rows) - limit])
        kept = self.windows[w] = _appended(old, rows, limit)
        return kept

    def _history(self, w: int, win: np.ndarray) -> np.ndarray:
        """Window ``w``'s kept history, oldest first, ending with ``win``."""
        older = self.older.get(w)
        return win if older is None else np.concatenate([older.rows(), win])

    # -- slow ranks ------------------------------------------------------------------------------

    def _note_pair(self, ranks: tuple[int, ...], p2p: bool) -> None:
        if p2p:
            a, b = ranks
            self.partners.setdefault(a, set()).add(b)
            self.partners.setdefault(b, set()).add(a)

    def _follow(self, w: int, rows: np.ndarray) -> None:
        """Open episodes this window holds: add what its new collectives cost the others."""
        for ep in self.open.values():
            if w in ep.holding and ep.finding.detail.cause == "rank":
                d = ep.finding.detail
                mine = rows["last"] == d.rank
                d.cost_s = round(d.cost_s + float(rows["cost"][mine].sum()), 6)
                ep.others += float(rows["others"].sum())
                d.cost_pct = round(100 * d.cost_s / ep.others, 2) if ep.others > 0 else 0.0
                self.changed[id(ep.finding)] = ep.finding

    def _judge(self, w: int, win: np.ndarray, ids: Ids, host_of: np.ndarray,
               found: list[Finding]) -> None:
        rules, n = self.rules, len(win)
        cost_by = np.bincount(win["last"], weights=win["cost"])
        r = int(cost_by.argmax())
        total = float(np.add.reduce(cost_by))
        share = float(cost_by[r]) / total if total > 0 else 0.0
        if share < rules.majority and not self.open:  # no rank to name, no episode to end
            return
        mine = win["last"] == r
        threshold = _p90(win["gap"][mine]) / 2 if mine.any() else 0.0
        late = mine & (win["gap"] >= threshold) if mine.any() \
            else mine  # nobody waited: every wait alike
        members = int(win["n"][-1])
        span = float(win["t_ref"][-1] - win["t_ref"][0])
        wall = float(cost_by[r]) / ((members - 1) * span) if span > 0 else 0.0
        holds = share >= rules.majority and wall >= rules.cost and \
            int(late.sum()) >= max(2, n // MIN_LATE_SHARE) and _stands_out(win, r, late)
        window = ids.windows[w]
        key = (window.run, r)
        ep = self.open.get(key)
        if ep is not None:
            if holds and w not in ep.holding:
                ep.holding.add(w)
                ep.finding.detail.groups = sorted({*ep.finding.detail.groups, window.label})
                self.changed[id(ep.finding)] = ep.finding
            elif share < rules.majority / 2 or wall < rules.cost / 2:  # hysteresis
                self._release(key, ep, w, win)
            return
        for other in list(self.open):  # another rank of this window's open episode
            o = self.open[other]
            if w in o.holding and o.finding.detail.rank != r:
                self._release(other, o, w, win)
        if not holds or self.partners.get(r, set()) & set(window.ranks) or \
                (r < len(host_of) and self._exchanges_slow(int(host_of[r]))):
            return
        found.append(self._raise(key, w, (win, self._history(w, win)), (mine, late, threshold),
                                 share, wall, ids, host_of))

    def _raise(self, key: tuple, w: int, rows: tuple[np.ndarray, np.ndarray],
               which: tuple[np.ndarray, np.ndarray, float], share: float, wall: float,
               ids: Ids, host_of: np.ndarray) -> Finding:
        """The finding for rank ``key[1]``, judged on ``win`` (``which``: its collectives,
        the clearly late ones, the gap that makes one clearly late); its start placed over
        ``kept`` (the window and the collectives kept before it), with what it cost since."""
        window, r = ids.windows[w], key[1]
        win, kept = rows
        mine, late, threshold = which
        gap = float(np.median(win["gap"][late]))
        start = change_point((kept["last"] == r) & (kept["gap"] >= threshold))
        sites = win["site"][mine]
        site = int(np.bincount(sites).argmax()) if len(sites) else int(win["site"][-1])
        host = ids.hosts[int(host_of[r])] if r < len(host_of) else ""
        since = kept[start:]
        cost = float(since["cost"][since["last"] == r].sum())
        others = float(since["others"].sum())
        detail = Straggler(
            cause="rank", rank=r, host=host, groups=[window.label], window=len(win),
            last_share=round(float(mine.mean()), 3), waiting_share=round(share, 3),
            wall_pct=round(100 * wall, 2), cost_s=round(cost, 6),
            cost_pct=round(100 * cost / others, 2) if others > 0 else 0.0,
            median_gap_ms=round(1e3 * gap, 3),
            start_step=int(kept["step"][start]), waited_at=ids.strings[site])
        last = win[-1]
        finding = Finding(kind=Kind.STRAGGLER, run=window.run, op=ids.strings[int(last["op"])],
                          group=window.label, seq=int(last["seq"]), step=int(kept["step"][start]),
                          culprits=[r], hosts=[host], callsite=ids.strings[site],
                          detail=detail, t=float(last["t_ref"]))
        ep = self.open[key] = _Episode(finding, {w})
        ep.others = others
        return finding

    def _release(self, key: tuple, ep: _Episode, w: int, win: np.ndarray) -> None:
        """Window ``w`` no longer finds the episode; it ends when no window does."""
        ep.holding.discard(w)
        if ep.holding:
            return
        d = ep.finding.detail
        d.ended, d.end_step, d.end_t = True, int(win["step"][-1]), float(win["t_ref"][-1])
        self.changed[id(ep.finding)] = ep.finding
        del self.open[key]

    # -- slow links ------------------------------------------------------------------------------

    def _pair_rows(self, rows: np.ndarray, host_of: np.ndarray, ids: Ids,
                   found: list[Finding]) -> None:
        """Exchanges between two hosts: each pair of hosts keeps its last ``window``."""
        win = ids.windows[int(rows["wid"][0])]
        a, b = win.ranks
        if max(a, b) >= len(host_of) or host_of[a] == host_of[b]:
            return
        pair = (int(min(host_of[a], host_of[b])), int(max(host_of[a], host_of[b])))
        kept = _appended(self.pairs.get(pair), rows, self.rules.window)
        self.pairs[pair] = kept
        if len(kept) >= self.rules.window // 2:
            self.usual[pair] = min(self.usual.get(pair, np.inf), _per_element(kept))
        if len(kept) == self.rules.window:
            self._judge_link(pair, kept, ids, found)

    def _judge_link(self, pair: tuple[int, int], kept: np.ndarray, ids: Ids,
                    found: list[Finding]) -> None:
        """A node's links (every pair of it slow against the pairs without it: three hosts
        are enough), else this host pair (slow against the other pairs)."""
        per = {p: _per_element(k) for p, k in self.pairs.items()
               if len(k) >= self.rules.window // 2}
        run = ids.windows[int(kept["wid"][-1])].run
        for h in pair:
            self._judge_node(h, per, run, ids, found)
        if any((run, ("node", h)) in self.open or self._node_slowing(h, per) for h in pair):
            return  # that node's links (found, or being found): its finding says so
        others = [v for p, v in per.items() if p != pair]
        key = (run, ("link", *pair))
        ep = self.open.get(key)
        if not others:
            return
        base = float(np.median(others))
        if ep is not None:
            if per[pair] < self.rules.link_factor / 2 * base:
                self._release(key, ep, -1, kept)
            return
        if per[pair] >= self.rules.link_factor * base and self._extra(kept, base):
            found.append(self._raise_link(key, sorted(ids.hosts[h] for h in pair), "", kept,
                                          base, ids))

    def _judge_node(self, h: int, per: dict[tuple[int, int], float], run: str, ids: Ids,
                    found: list[Finding]) -> None:
        mine = [p for p in per if h in p]
        rest = [v for p, v in per.items() if h not in p]
        if len(mine) < 2 or not rest:
            return
        base, fastest = float(np.median(rest)), min(per[p] for p in mine)
        key = (run, ("node", h))
        ep = self.open.get(key)
        rows = np.concatenate([self.pairs[p] for p in mine])
        rows = rows[np.argsort(rows["step"], kind="stable")]  # one order across their clocks
        if ep is not None:
            if fastest < self.rules.link_factor / 2 * base:
                self._release(key, ep, -1, rows)
            return
        if fastest >= self.rules.link_factor * base and \
                all(self._extra(self.pairs[p], base) for p in mine):
            host = ids.hosts[h]
            found.append(self._raise_link(key, [host], host, rows, base, ids))

    def _node_slowing(self, h: int, per: dict[tuple[int, int], float]) -> bool:
        """Every pair of host ``h`` is slow in its last exchanges (against the fastest
        pair's usual): its node's links are slowing; the node rule names them once their
        windows say so, and no single pair of it is named meanwhile."""
        mine = [p for p in per if h in p]
        if len(mine) < 2 or len(mine) == len(per):
            return False
        fastest = min(per.values())
        return all(_per_element(self.pairs[p][-RECENT:]) >= self.rules.link_factor * fastest
                   for p in mine)

    def _extra(self, kept: np.ndarray, base: float) -> bool:
        """The pair's exchanges take at least MIN_LINK_WAIT longer than ``base`` (per
        element) would: a factor on microseconds is noise."""
        median = float(np.median(kept["transfer"]))
        return median - base * float(np.median(np.maximum(kept["numel"], 1))) >= MIN_LINK_WAIT

    def _exchanges_slow(self, host: int) -> bool:
        """Whether a host pair of ``host`` is slow: a link episode names it, or its last
        exchanges took ``link_factor`` times its own usual (the best median of its windows:
        pairs may differ by design). A rank late there waited for its slow exchanges, which
        is the link's doing, not the rank's."""
        for _, what in self.open:  # (run, rank) or (run, ("link"|"node", host ids))
            if isinstance(what, tuple) and host in what[1:]:
                return True
        for p, k in self.pairs.items():
            usual = self.usual.get(p)
            recent = k[-RECENT:]
            if host in p and usual is not None and len(recent) >= RECENT // 2 and \
                    _per_element(recent) >= self.rules.link_factor * usual and \
                    self._extra(recent, usual):
                return True
        return False

    def _raise_link(self, key: tuple, link: list[str], host: str, rows: np.ndarray,
                    base: float, ids: Ids) -> Finding:
        """A slow host pair (``link``: the two hosts) or a node's links (``host``; ``link``:
        that host alone), from ``rows``: the exchanges that found it, oldest first."""
        base_s = base * float(np.median(np.maximum(rows["numel"], 1)))
        per = rows["transfer"] / np.maximum(rows["numel"], 1)
        now = float(np.median(per[-2 * RECENT:]))  # the slow level: its latest exchanges
        start = change_point(per >= np.sqrt(now * base))  # nearer which level, per exchange
        median = float(np.median(rows["transfer"][start:]))  # since it began
        last = rows[-1]
        window = ids.windows[int(last["wid"])]
        wids = np.unique(rows["wid"]).tolist()
        ranks = sorted({r for w in wids for r in ids.windows[w].ranks})
        extra = np.maximum(rows["transfer"][start:] - base_s, 0)
        spent = float(rows["others"][start:].sum()) + float(rows["transfer"][start:].sum())
        site = ids.strings[int(last["site"])]
        detail = Straggler(
            cause="link", rank=None, host=host, link=link, ranks=ranks,
            groups=sorted(ids.windows[w].label for w in wids), window=len(rows),
            last_share=0.0, wall_pct=0.0, cost_s=round(float(extra.sum()), 6),
            cost_pct=round(100 * float(extra.sum()) / max(spent, 1e-12), 2),
            median_gap_ms=round(1e3 * median, 3), baseline_ms=round(1e3 * base_s, 3),
            start_step=int(rows["step"][start]), waited_at=site)
        finding = Finding(kind=Kind.STRAGGLER, run=window.run,
                          op=ids.strings[int(last["op"])], group=window.label,
                          seq=int(last["seq"]), step=int(rows["step"][start]), culprits=[],
                          hosts=link, callsite=site, detail=detail, t=float(last["t_ref"]))
        self.open[key] = _Episode(finding, {-1})
        return finding


def _p90(x: np.ndarray) -> float:
    """``np.percentile(x, 90)`` to the bit (its linear method, its interpolation), without
    its ~20 µs of argument handling: it was half of judging a window."""
    x = np.sort(x)
    if np.isnan(x[-1]):
        return float("nan")
    v = (len(x) - 1) * 0.9
    lo = math.floor(v)
    if lo >= len(x) - 1:
        return float(x[-1])
    a, b, t = float(x[lo]), float(x[lo + 1]), v - lo
    d = b - a
    return b - d * (1 - t) if t >= 0.5 else a + d * t


def _per_element(rows: np.ndarray) -> float:
    """Median transfer per element of exchanges (sizes differ between pairs and calls)."""
    return float(np.median(rows["transfer"] / np.maximum(rows["numel"], 1)))


def _rounds(done: np.ndarray, n: int) -> list[np.ndarray]:
    """``done`` (sorted by window) a window's worth at a time: round k holds each window's
    rows k*n..(k+1)*n-1, in order. Each round is judged, so a block that finished more than a
    window of one group's collectives (a backlog, a shard's burst) has every one of them in
    a judged window, not only its last ``n`` (docs/ingest.md)."""
    if len(done) <= n:
        return [done]
    wids = done["wid"]
    first = np.flatnonzero(np.r_[True, wids[1:] != wids[:-1]])
    sizes = np.diff(np.r_[first, len(done)])
    if int(sizes.max()) <= n:
        return [done]
    k = (np.arange(len(done)) - np.repeat(first, sizes)) // n
    return [done[k == i] for i in range(int(k.max()) + 1)]


def rank_rows(counters: Mapping[str, int]) -> dict[int, dict[str, int]]:
    """The ``late.<rank>.<field>`` counters (``Lateness.counters``) by rank."""
    out: dict[int, dict[str, int]] = {}
    for name, value in counters.items():
        if name.startswith("late."):
            _, rank, field = name.split(".", 2)
            if rank.isdigit():
                out.setdefault(int(rank), {})[field] = int(value)
    return out


def _stands_out(win: np.ndarray, r: int, late: np.ndarray) -> bool:
    """Rank ``r`` owns more of the window's "as far behind" arrivals than chance would give
    one of its members (binomial tail ≤ ``CHANCE``). Without it, two ranks with the same
    noise (a loaded host) take turns: one arrives last in about half the collectives, and
    a few long stalls can put most of the waiting on it."""
    if not late.any():
        return False
    behind = win["gap"] >= float(win["gap"][late].min())
    total, mine = int(behind.sum()), int(late.sum())
    p = 1.0 / max(2, int(win["n"][-1]))
    tail = sum(math.comb(total, k) * p ** k * (1 - p) ** (total - k)
               for k in range(mine, total + 1))
    return tail <= CHANCE


def change_point(late: np.ndarray) -> int:
    """Where a run of collectives (``late``: the rank arrived last, as far behind as it
    usually is now) turned to the share of late arrivals it has now: the split of largest
    Bernoulli likelihood, taken only while it gains ``ONSET_GAIN`` over no split and the
    share after it is higher, then searched again after it (a start among earlier noise
    moves on to the last such rise); 0 when it was late throughout."""
    start = 0
    while len(late) - start >= 2:
        seg = late[start:]
        n = len(seg)
        k = np.concatenate([[0], np.cumsum(seg)])  # late ones before each split
        i = np.arange(1, n)
        before, after = k[i], k[n] - k[i]
        gains = _loglik(before, i) + _loglik(after, n - i) - _loglik(k[n:], np.array([n]))
        best = int(np.argmax(gains))
        split = best + 1
        if gains[best] < ONSET_GAIN or after[best] / (n - split) <= before[best] / split:
            break
        start += split
    at = np.flatnonzero(late[start:]) + start
    if len(at) > 2:  # an isolated late one leading the run is noise before it
        spacing = np.diff(at)
        usual = float(np.median(spacing))
        regular = np.flatnonzero(spacing <= 2 * usual)
        if len(regular):
            start = max(start, int(at[regular[0]]))
    return start


def _loglik(k: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Log-likelihood of ``k`` successes in ``n`` trials at their own rate (0 when n=0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        p = k / np.maximum(n, 1)
        out = k * np.log(np.where(k > 0, p, 1)) + (n - k) * np.log(np.where(n > k, 1 - p, 1))
    return out


class _Older:
    """The collectives a window let go, its latest ``limit``, joined into one array every
    ``JOIN`` pieces and when read. A piece is a slice of a window's kept array, which is
    its own buffer of at most a window's rows (:func:`_appended`): keeping the slice keeps
    no batch alive."""

    JOIN = 16

    def __init__(self, limit: int):
        self.limit = limit
        self.pieces: list[np.ndarray] = []

    def add(self, rows: np.ndarray) -> None:
        self.pieces.append(rows)
        if len(self.pieces) >= self.JOIN:
            self.pieces = [self.rows()]

    def rows(self) -> np.ndarray:
        if len(self.pieces) == 1:
            return self.pieces[0][-self.limit:]
        last = self.pieces[-1]  # joined as bytes: see _appended
        return np.frombuffer(b"".join(p.tobytes() for p in self.pieces), last.dtype
                             )[-self.limit:]


def _appended(old: np.ndarray | None, new: np.ndarray, limit: int) -> np.ndarray:
    """The last ``limit`` rows of ``old`` then ``new``, joined as bytes: numpy's
    ``concatenate`` of structured arrays resolves their dtypes in Python (~25 µs a call,
    ~40 % of :meth:`Stragglers.add`), the bytes join ~4 µs, with the same rows."""
    old_bytes = b"" if old is None else old[max(0, len(old) - limit + len(new)):].tobytes()
    return np.frombuffer(old_bytes + new[-limit:].tobytes(), new.dtype)
