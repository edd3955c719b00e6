"""Aggregation across findings: which host, rank or link the evidence points at.

One corrupted link is a finding; the same link corrupting chunk after chunk, or every
culprit living on one host, is the answer an operator wants first.
"""

from __future__ import annotations

from collections import Counter

from .findings import (
    AnySuspect,
    Finding,
    HostSuspect,
    LinkCorruption,
    LinkSuspect,
    RankAt,
    RankSuspect,
    ReceiverSuspect,
    SenderSuspect,
)

LINK_SHARE = 0.5  # one link carries at least this share of corrupted chunks
END_SHARE = 0.75  # one sender / receiver / host is in at least this share


def link_matrix(findings: list[Finding]) -> dict[tuple[int, int], int]:
    """Corrupted chunks per (src, dst) over all link_corruption findings."""
    m: Counter[tuple[int, int]] = Counter()
    for f in findings:
        if isinstance(f.detail, LinkCorruption):
            m.update((int(a), int(b)) for a, b in f.detail.links)
    return dict(m)


def suspects(findings: list[Finding], hosts: dict[int, str]) -> list[AnySuspect]:
    """Statements, strongest first: a host, a rank, a link, a sender, a receiver."""
    out: list[AnySuspect] = []
    blamed = [f for f in findings if f.culprits and not f.ambiguous]
    # Findings, not culprits: a finding naming two ranks of a host counts once for it.
    finding_hosts = Counter(h for f in blamed for h in {hosts.get(r, "") for r in f.culprits}
                            if h)
    job_hosts = set(hosts.values())
    if finding_hosts and len(job_hosts) > 1:
        host, n = finding_hosts.most_common(1)[0]
        total = len(blamed)
        if n == total or (n >= 3 and n / total >= END_SHARE):
            ranks = sorted({r for f in blamed for r in f.culprits if hosts.get(r) == host})
            out.append(HostSuspect(host=host, findings=n, of=total, ranks=ranks))
    ranks = Counter(r for f in blamed for r in f.culprits)
    every = sorted(r for r, n in ranks.items() if n == len(findings))
    if every and len(findings) > 1:
        out.append(RankSuspect(rank=every[0], host=hosts.get(every[0], ""),
                               findings=len(findings), of=len(findings),
                               alike=[RankAt(rank=r, host=hosts.get(r, "")) for r in every[1:]]))
    links = link_matrix(findings)
    total = sum(links.values())
    if total >= 2:
        (src, dst), n = max(links.items(), key=lambda kv: kv[1])
        if n / total >= LINK_SHARE:
            out.append(LinkSuspect(src=src, dst=dst, src_host=hosts.get(src, ""),
                                   dst_host=hosts.get(dst, ""), chunks=n, of=total))
        for end, index in ((SenderSuspect, 0), (ReceiverSuspect, 1)):
            per = Counter()
            for link, c in links.items():
                per[link[index]] += c
            rank, n = per.most_common(1)[0]
            peers = {link[1 - index] for link in links if link[index] == rank}
            if len(peers) > 1 and n / total >= END_SHARE:
                out.append(end(rank=rank, host=hosts.get(rank, ""), chunks=n, of=total))
    return out


def _on(*hosts: str) -> str:
    """" (node1)", " (node0→node1)"; nothing for a host never heard from."""
    return f" ({'→'.join(hosts)})" if all(hosts) else ""


def describe(s: AnySuspect) -> str:
    if isinstance(s, HostSuspect):
        ranks = s.ranks
        span = f"{ranks[0]}–{ranks[-1]}" if len(ranks) > 2 and ranks == list(
            range(ranks[0], ranks[-1] + 1)) else ",".join(map(str, ranks))
        return f"suspect host {s.host}: {s.findings} of {s.of} findings on ranks {span}"
    if isinstance(s, RankSuspect):
        if not s.alike:
            return f"suspect rank {s.rank}{_on(s.host)}: culprit in every finding"
        every = [RankAt(rank=s.rank, host=s.host), *s.alike]
        hosts = sorted({a.host for a in every})
        where = _on(", ".join(hosts)) if all(hosts) else ""
        return (f"suspect ranks {','.join(str(a.rank) for a in every)}{where}: culprits "
                f"in every finding")
    if isinstance(s, LinkSuspect):
        return (f"suspect link {s.src}→{s.dst}{_on(s.src_host, s.dst_host)}: "
                f"{s.chunks} of {s.of} corrupted chunks")
    return (f"suspect {s.kind} rank {s.rank}{_on(s.host)}: in {s.chunks} of "
            f"{s.of} corrupted chunks")
