"""The compiler's own description of itself, part of every native library's cache key (a
new compiler builds a new library). Its own module so that checking for a built library
needs neither numpy nor torch (the kernel's loader imports both)."""

from __future__ import annotations

import subprocess


def compiler_version(compiler: str) -> bytes:
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return b""
    return done.stdout
