"""What a relay sees of a rank's process: ``/proc/<pid>/stat`` (state letter, start time,
and a zombie's exit status). The start time recorded in the ring tells a reused pid from
the rank's."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..wire import ALIVE, GONE, STOPPED
from ..wire.ring import proc_stat


@dataclass(frozen=True)
class Seen:
    state: str = ALIVE
    proc: str = ""
    exit_code: int = -1
    signal: int = 0


class Owner:
    def __init__(self, pid: int, start: int = 0):
        self.pid, self.start = pid, start
        self.last = Seen()

    @property
    def gone(self) -> bool:
        return self.last.state == GONE

    def look(self) -> Seen:
        """Read the process's state now (a gone process stays gone)."""
        if self.gone:
            return self.last
        st = proc_stat(self.pid)
        if st is None or (self.start and st[1] != self.start):
            self.last = replace(self.last, state=GONE, proc="")
            return self.last
        letter, _, status = st
        if letter in "ZX":
            seen = Seen(GONE, letter)
            if status >= 0:
                sig = status & 0x7F
                seen = replace(seen, signal=sig, exit_code=-1 if sig else (status >> 8) & 0xFF)
            self.last = seen
        elif letter in "Tt":
            self.last = Seen(STOPPED, letter)
        else:
            self.last = Seen(ALIVE, letter)
        return self.last
