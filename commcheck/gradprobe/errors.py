"""Exceptions raised by the gradient probe.

Every user-facing failure is a :class:`GradProbeError` carrying one sentence that names the
offending field, file or directory, so the CLI can print it on one line without a traceback.
"""

from __future__ import annotations


class GradProbeError(Exception):
    """Base class for all gradient-probe errors with a one-line, user-facing message."""


class GradProbeConfigError(GradProbeError, ValueError):
    """A grad_probe setting is invalid; the message names the field and the bad value."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        self.field = field
        self.value = value
        self.reason = reason
        super().__init__(f"grad_probe config: {field}={value!r} is invalid: {reason}")


class DumpNotFoundError(GradProbeError):
    """A dump directory or file that the comparison needs does not exist."""


class NoCommonDataError(GradProbeError):
    """Two dumps share no rank, or no step, that could be compared."""


class DumpFormatError(GradProbeError):
    """A dump file is corrupt, truncated or inconsistent with its companion files."""
