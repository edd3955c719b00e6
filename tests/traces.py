"""Reading Chrome trace-event JSON as `commcheck trace` writes it, for the tests: events by
phase, the tracks, and what the format and the viewers require of them."""

from __future__ import annotations

from commcheck.collector.trace import NOBODY, TID_BASE


def rank(e: dict) -> int:
    """The rank whose track an event is on."""
    return e["tid"] - TID_BASE


def by(events: list[dict], ph: str) -> list[dict]:
    return [e for e in events if e["ph"] == ph]


def tracks(events: list[dict]) -> tuple[dict[int, str], dict[tuple[int, int], str]]:
    """Process names by pid, thread names by (pid, tid)."""
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e["name"] == "thread_name"}
    return procs, threads


def well_formed(events: list[dict]) -> None:
    """What the trace-event format requires of each phase, and slices of one track that
    nest (Perfetto drops a slice that overlaps its neighbour partly)."""
    for e in events:
        assert {"name", "ph", "pid"} <= set(e), e
        if e["ph"] in ("X", "B", "i"):
            assert isinstance(e["ts"], float) and "tid" in e, e
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
        if e["ph"] == "i":
            assert e["s"] in ("t", "g"), e
    pids: dict[int, set[int]] = {}
    for e in events:
        if "tid" in e:
            pids.setdefault(e["tid"], set()).add(e["pid"])
    assert all(len(p) == 1 for p in pids.values()), "a tid under two pids (Perfetto splits it)"
    # Perfetto merges tid 0 (the idle thread) and a tid equal to its pid into the process's
    # main thread: a rank's track would vanish into another's (the no-culprit track is its
    # process's only thread)
    assert 0 not in pids and all(t not in p for t, p in pids.items() if t != NOBODY), \
        "tid 0 or a rank's tid = its pid"
    assert all(e["pid"] != 0 for e in events), "pid 0"
    by_track: dict[tuple, list[tuple[float, float]]] = {}
    for e in by(events, "X"):
        by_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_track.values():
        stack: list[float] = []
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1], "slices of one track overlap partly"
            stack.append(end)
