"""``commcheck report DB --html FILE``: the report as one self-contained web page to attach
to an incident: inline CSS, figures inline (matplotlib SVG as data URIs), no script, nothing
fetched. Built from the same typed model as ``report --json`` (report.load), so the page's
findings are the JSON's; the terminal report rides along, folded, word for word. See
docs/views.md."""

from __future__ import annotations

import base64
import html
import io
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from matplotlib.figure import Figure
from rich.console import Console

from ..engine import Finding, Summary
from ..engine.suspects import describe
from ..wire.private import private_output
from .calls import Call, calls
from .figures import OpRate, findings_by_rank_step, link_matrix, svg
from .report import (
    CLEAN,
    FINDINGS,
    _how_far,
    _n,
    _short,
    exit_status,
    first_divergence,
    render,
    stopped_line,
    unfinished_count,
)
from .report import to_json as report_json
from .store import Store


class StreamedFigure(Protocol):
    """A figure counted from the records as they stream past (never gathered whole)."""

    def add(self, c: Call) -> None: ...

    def figure(self) -> Figure | None: ...


# Figures counted from the records, in page order, each with its caption and what the page
# says without it. The hook for per-rank lateness (how far each rank's entry trails its
# group's first, per step) once the stragglers work lands: one more StreamedFigure here.
STREAMED: list[tuple[Callable[[], StreamedFigure], str, str]] = [
    (OpRate, "Completed calls per op over time, all ranks together (each rank's own clock).",
     "no completed call was recorded"),
]


@dataclass(frozen=True)
class Shown:
    """One figure of the page: SVG text, or why there is none."""

    caption: str
    svg: str | None
    absent: str
    square: bool = False  # a matrix: drawn smaller than the page's width


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1c1e21;
background:#f6f7f9}
main{max-width:1200px;margin:0 auto;padding:24px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px}
.sub{color:#5b6270}.verdict{display:inline-block;padding:3px 10px;border-radius:4px;
font-weight:600;color:#fff}.v-clean{background:#2e7d32}.v-findings{background:#c62828}
.v-unfinished{background:#ef6c00}
section{background:#fff;border:1px solid #dde1e6;border-radius:6px;padding:12px 16px;
margin:12px 0;overflow-x:auto}
table{border-collapse:collapse;width:100%}table.counts,table.ops{width:auto;min-width:40%}
th,td{text-align:left;padding:4px 8px;border-bottom:1px solid #eceff2;vertical-align:top}
table.findings td{white-space:nowrap}table.findings td.site,table.findings td.far{
white-space:pre-wrap;overflow-wrap:anywhere;min-width:180px}th{background:#f0f2f5;font-weight:600}
td.n{text-align:right;font-variant-numeric:tabular-nums}
tr.first td{background:#fdecea}.tag{font-size:11px;padding:1px 5px;border-radius:3px;
background:#eceff2;margin-left:4px}.site{font-family:ui-monospace,Menlo,monospace;
font-size:12px;white-space:pre-wrap}
ul{margin:4px 0;padding-left:20px}.warn{color:#8a4b00}.bad{color:#b71c1c;font-weight:600}
figure{margin:12px 0}figure img{width:880px;max-width:100%;height:auto;display:block}
figure img.square{width:460px}
figcaption{color:#5b6270;font-size:13px}pre{font-size:12px;overflow-x:auto}
"""


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def _counts(s: Summary) -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = [
        ("records", s.records), ("ranks heard from", s.ranks),
        ("ranks that said goodbye", s.ranks_said_goodbye),
        ("world size", s.world or "unknown"), ("collectives verified", s.verified),
        ("collectives not reported by every member", s.unmatched),
        ("collectives not verified (records dropped)", s.not_verified),
        ("records dropped on ranks", s.dropped_on_ranks),
        ("records spilled to disk on ranks", s.spilled_on_ranks),
        ("calls not checked", s.not_checked_on_ranks),
        ("collectives that bypassed commcheck", sum(s.bypassed.values())),
        ("findings", s.findings), ("runs", ", ".join(s.runs) or "—")]
    rows += [(f"messages rejected ({why})", n) for why, n in s.rejected.items()]
    rows += [(f"calls not checked: {why}", n) for why, n in s.not_checked_reasons.items()]
    return rows


def _summary(findings: list[Finding], s: Summary) -> str:
    cells = "".join(f"<tr><th>{_e(k)}</th><td class=n>{_e(v)}</td></tr>"
                    for k, v in _counts(s))
    out = [f'<section id=summary><h2>Summary</h2><table class=counts>{cells}</table>']
    if s.suspects:
        out.append("<h2>Suspects</h2><ul>" + "".join(
            f"<li class=bad>{_e(describe(x))}</li>" for x in s.suspects) + "</ul>")
    if s.unfinished:
        items = []
        for u in s.unfinished:
            if u.never_reported:
                what = "never reported"
            elif u.last is None:
                what = "connected, entered no collective"
            else:
                what = f"last entered {u.last.op} {u.last.at} at {_short(u.last.callsite)}"
            host = f" ({u.host})" if u.host else ""
            items.append(f"<li>{u.label}{_e(host)}: {_e(what)}</li>")
        stops = "".join(f"<p>{_e(stopped_line(x))}</p>" for x in s.stopped)
        out.append(f'<h2 class=warn>The run did not finish: {unfinished_count(s)} of '
                   f'{s.world or s.ranks} ranks never said goodbye</h2>{stops}'
                   f'<ul>{"".join(items)}</ul>')
    if s.ops:
        rows = "".join(f"<tr><td>{_e(o.op)}</td><td class=n>{o.recorded}</td>"
                       f"<td class=n>{o.verified}</td></tr>" for o in s.ops)
        out.append("<h2>Per op</h2><table class=ops><tr><th>op</th><th>calls recorded "
                   f"(all ranks)</th><th>collectives verified</th></tr>{rows}</table>")
    out.append("</section>")
    return "".join(out)


_COLUMNS = ("#", "kind", "op", "group", "seq", "step", "culprits", "hosts", "call site",
            "how far apart")


def _findings(findings: list[Finding]) -> str:
    if not findings:
        return ("<section id=findings><h2>Findings</h2><p>No findings: every verified "
                "collective was consistent.</p></section>")
    first = first_divergence(findings)
    head = "".join(f"<th>{c}</th>" for c in _COLUMNS)
    rows = []
    for i, f in enumerate(findings):
        tags = "".join(f"<span class=tag>{t}</span>" for t, on in (
            ("first", i == first), ("ambiguous", f.ambiguous), ("injected", f.injected)) if on)
        cells = (f"<td class=n>{i + 1}</td><td><span class=kind>{_e(f.kind)}</span>{tags}</td>"
                 f"<td class=op>{_e(f.op)}</td><td class=group>{_e(f.group)}</td>"
                 f"<td class='n seq'>{f.seq}</td><td class='n step'>{f.step}</td>"
                 f"<td class=culprits>{_e(','.join(map(str, f.culprits)) or '—')}</td>"
                 f"<td class=hosts>{_e(','.join(f.hosts))}</td>"
                 f"<td class=site>{_e(_short(f.callsite))}</td>"
                 f"<td class=far>{_e(_how_far(f))}</td>")
        rows.append(f"<tr class='finding{' first' if i == first else ''}'>{cells}</tr>")
    return (f"<section id=findings><h2>{_n(len(findings), 'finding')}</h2><table class=findings>"
            f"<tr>{head}</tr>{''.join(rows)}</table></section>")


def _figures(shown: list[Shown]) -> str:
    out = ["<section id=figures><h2>Figures</h2>"]
    for f in shown:
        if f.svg is None:
            out.append(f"<p class=sub>{_e(f.caption)} — {_e(f.absent)}.</p>")
            continue
        data = base64.b64encode(f.svg.encode()).decode()
        square = " class=square" if f.square else ""
        out.append(f'<figure><img{square} alt="{_e(f.caption)}" src="data:image/svg+xml;'
                   f'base64,{data}"><figcaption>{_e(f.caption)}</figcaption></figure>')
    out.append("</section>")
    return "".join(out)


def figures(store: Store, findings: list[Finding], summary: Summary) -> list[Shown]:
    """Every figure of the page, the records read once for those counted from them."""
    streamed = [(make(), caption, absent) for make, caption, absent in STREAMED]
    for c in calls(store):
        for fig, _, _ in streamed:
            fig.add(c)
    drawn = [
        (findings_by_rank_step(findings, summary.world),
         "Findings by culprit rank and training step.", "no finding names a culprit"),
        (link_matrix(summary.link_matrix), "Corrupted chunks by link: the sender down, the "
         "receiver across.", "no corrupted chunk"),
        *((fig.figure(), caption, absent) for fig, caption, absent in streamed)]
    return [Shown(caption, None if fig is None else svg(fig), absent, square=i == 1)
            for i, (fig, caption, absent) in enumerate(drawn)]


def _terminal(findings: list[Finding], summary: Summary) -> str:
    console = Console(file=io.StringIO(), record=True, width=160, color_system=None)
    render(findings, summary, console)
    return console.export_text()


def page(name: str, findings: list[Finding], summary: Summary, shown: list[Shown]) -> str:
    status = exit_status(findings, summary)
    verdict, cls = {CLEAN: ("clean", "v-clean"),
                    FINDINGS: (_n(len(findings), "finding"), "v-findings")}.get(
        status, ("did not finish", "v-unfinished"))
    data = json.dumps(report_json(findings, summary)).replace("</", "<\\/")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return (
        f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
        f"<meta name=viewport content='width=device-width,initial-scale=1'>"
        f"<title>commcheck report: {_e(name)}</title><style>{_CSS}</style></head><body><main>"
        f"<h1>commcheck report <span class='verdict {cls}'>{_e(verdict)}</span></h1>"
        f"<div class=sub>{_e(name)} · {summary.records} records from {summary.ranks} ranks, "
        f"{summary.verified} collectives verified · written {when}</div>"
        f"{_summary(findings, summary)}{_findings(findings)}{_figures(shown)}"
        f"<section id=terminal><details><summary>The terminal report (commcheck report)"
        f"</summary><pre>{_e(_terminal(findings, summary))}</pre></details></section>"
        f"<script type=application/json id=report-json>{data}</script>"
        f"</main></body></html>\n")


def write_html(store: Store, findings: list[Finding], summary: Summary, path: str,
               name: str) -> int:
    """The page into a new private file; its size in bytes."""
    with private_output(path) as out:  # opened first: an unwritable path fails at once
        text = page(name, findings, summary, figures(store, findings, summary)).encode()
        out.write(text)
    return len(text)
