"""The sending half of acknowledged delivery (in the relay): messages kept until the collector
acks them.

The protocol is described in :mod:`commcheck.collector.ledger`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

MAX_BACKOFF = 30.0


@dataclass
class Entry:
    seq: int
    pid: int
    payload: bytes
    records: int
    sent: float = 0.0  # monotonic time of the last send; 0: not sent yet
    wait: float = 0.0  # seconds to wait for the ack before re-sending


class Outbox:
    """Messages awaiting the collector's ack, bounded by the bytes they hold."""

    def __init__(self, max_bytes: int, ack_timeout: float):
        self.max_bytes = max_bytes
        self.ack_timeout = max(ack_timeout, 0.05)
        self.bytes = 0
        self._entries: OrderedDict[tuple[int, int], Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def records(self) -> int:
        return sum(e.records for e in self._entries.values())

    def entries(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))

    def get(self, pid: int, seq: int) -> Entry | None:
        return self._entries.get((pid, seq))

    def room(self, payload_len: int) -> bool:
        return self.bytes + payload_len <= self.max_bytes or not self._entries

    def add(self, seq: int, pid: int, payload: bytes, records: int, force: bool = False) -> bool:
        if not force and not self.room(len(payload)):
            return False
        self._entries[(pid, seq)] = Entry(seq, pid, payload, records, wait=self.ack_timeout)
        self.bytes += len(payload)
        return True

    def acked(self, names: list[tuple[int, int]]) -> None:
        """Forget acknowledged messages. Acks prove the link works again: what waits for a
        backed-off re-send is due after one plain ``ack_timeout`` from now on."""
        if names:
            for e in self._entries.values():
                e.wait = self.ack_timeout
        for name in names:
            e = self._entries.pop(tuple(name), None)  # type: ignore[arg-type]
            if e is not None:
                self.bytes -= len(e.payload)

    def send_due(self, send: Callable[[bytes], bool], now: float) -> int:
        """Send what was never sent or waited past its timeout, oldest first; stop at the
        first refusal (no connection, or the socket's queue is full). Returns re-sends."""
        resent = 0
        for e in self._entries.values():
            if e.sent and now - e.sent < e.wait:
                continue
            if not send(e.payload):
                break
            if e.sent:
                resent += 1
                e.wait = min(e.wait * 2, MAX_BACKOFF)
            e.sent = now
        return resent
