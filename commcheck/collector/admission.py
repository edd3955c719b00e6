"""Who and what the collector lets in, besides valid messages: the senders it refused, by
name (for the report), and, for ``commcheck run``, only a database that holds no run yet.
See docs/security.md."""

from __future__ import annotations

from collections import Counter

from .store import Store, StoreError

PREFIX = "refused:"  # counters refused:<reason>:<who> = messages or attempts refused
MAX_NAMED = 32  # senders named; refusals of any further one count under "others"
OTHERS = "others"
OPEN = "open_collector"  # counter: 1 once the collector ran without CURVE keys


class RefusedSenders:
    """Refusals by (reason, who), kept as counters so the report can name the senders;
    a restarted collector goes on from the committed counts."""

    def __init__(self, store: Store):
        self.store = store
        self.counts: Counter[tuple[str, str]] = Counter()
        for key, n in store.conn.execute("SELECT key, value FROM counters WHERE key LIKE ?",
                                         (PREFIX + "%",)):
            reason, _, who = key.removeprefix(PREFIX).partition(":")
            self.counts[(reason, who)] = n
        self.changed = False

    def add(self, reason: str, who: str) -> None:
        if (reason, who) not in self.counts and len(self.counts) >= MAX_NAMED:
            who = OTHERS
        self.counts[(reason, who)] += 1
        self.changed = True

    def save(self) -> None:
        """Into the open transaction (committed with the counts of rejected messages)."""
        if self.changed:
            self.store.set_counters({f"{PREFIX}{r}:{w}": n for (r, w), n in self.counts.items()})
            self.changed = False


def refuse_used(store: Store) -> None:
    """Raise (one line) if ``store`` already holds a run: ``commcheck run`` puts one run in
    a database, since the report, the engine's snapshot and "every rank said goodbye" are
    the database's, not a run's; a second run resumed from the first one's state would be
    done before it started and print the first one's report."""
    q = store.conn.execute
    runs = [r for (r,) in q("SELECT run FROM ranks UNION SELECT run FROM delivered "
                            "ORDER BY run LIMIT 3")]
    if runs:
        more = f" (and {len(runs) - 1} more)" if len(runs) > 1 else ""
        raise StoreError(f"{store.name} already holds run {runs[0]}{more} of an earlier "
                         f"commcheck run: give a new --db, or leave --db out for a fresh one")
