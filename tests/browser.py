"""A real headless Chromium, driven over the DevTools protocol on a pipe
(``--remote-debugging-pipe``: NUL-separated JSON on the child's fds 3 and 4), so a test can
open a page, read its DOM, hear its console and take a screenshot with the standard
library alone. :func:`find` names the browser or None (the caller skips, saying why)."""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
WHY_NOT = ("no Chromium on PATH (nor $CHROMIUM): install the distribution's package "
           "(apt-get install -y chromium; .ci/run does)")


def find() -> str | None:
    if os.environ.get("CHROMIUM"):
        return shutil.which(os.environ["CHROMIUM"])
    return next((p for p in map(shutil.which, NAMES) if p), None)


def _high(fd: int) -> int:
    """``fd`` moved above the protocol's 3 and 4 (so dup2 onto them never clobbers it)."""
    new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return new


class Page:
    """One tab of a fresh browser profile; :meth:`close` ends the browser."""

    def __init__(self, exe: str, width: int = 1280, height: int = 900, timeout: float = 60):
        self.timeout = timeout
        self.events: list[dict] = []
        self._profile = tempfile.mkdtemp(prefix="commcheck-chromium-")
        to_child, self._w = os.pipe()
        self._r, from_child = os.pipe()
        to_child, from_child = _high(to_child), _high(from_child)  # dup2 below clears CLOEXEC

        def fds() -> None:
            os.dup2(to_child, 3)
            os.dup2(from_child, 4)

        self.proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-extensions", "--hide-scrollbars", "--remote-debugging-pipe",
             f"--user-data-dir={self._profile}", f"--window-size={width},{height}",
             "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=fds, close_fds=False)  # noqa: PLW1509 (fds 3 and 4 are the protocol)
        os.close(to_child)
        os.close(from_child)
        self._buf = b""
        self._id = 0
        self.session = ""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget",
                                 {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed its DevTools pipe")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method: str, params: dict | None = None) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if self.session:
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            got = self._read(deadline)
            if got.get("id") == self._id:
                if "error" in got:
                    raise RuntimeError(f"{method}: {got['error']}")
                return got.get("result", {})
            self.events.append(got)

    def wait_event(self, method: str) -> dict:
        deadline = time.monotonic() + self.timeout
        for e in self.events:
            if e.get("method") == method:
                return e
        while True:
            e = self._read(deadline)
            self.events.append(e)
            if e.get("method") == method:
                return e

    def open(self, url: str) -> None:
        self.call("Page.navigate", {"url": url})
        self.wait_event("Page.loadEventFired")

    def evaluate(self, expression: str) -> object:
        got = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                             "awaitPromise": True})
        if "exceptionDetails" in got:
            raise RuntimeError(f"{expression}: {got['exceptionDetails']}")
        return got["result"].get("value")

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and failed loads the page reported."""
        out = []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.exceptionThrown":
                out.append(f"exception: {p['exceptionDetails'].get('text')}")
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(f"console.{p['type']}: {p.get('args')}")
            elif m == "Log.entryAdded" and p["entry"].get("level") == "error":
                out.append(f"log: {p['entry'].get('text')} {p['entry'].get('url', '')}")
        return out

    def screenshot(self, full_page: bool = True) -> bytes:
        params: dict = {"format": "png"}
        if full_page:
            size = self.call("Page.getLayoutMetrics")["cssContentSize"]
            params["clip"] = {"x": 0, "y": 0, "width": size["width"],
                              "height": size["height"], "scale": 1}
            params["captureBeyondViewport"] = True
        return base64.b64decode(self.call("Page.captureScreenshot", params)["data"])

    def close(self) -> None:
        self.session, self.timeout = "", 10
        with contextlib.suppress(RuntimeError, TimeoutError, OSError):
            self.call("Browser.close")
        for fd in (self._w, self._r):
            with contextlib.suppress(OSError):
                os.close(fd)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self._profile, ignore_errors=True)
