"""The relay: one process per node and run that takes the records out of the ranks.

Each rank writes its records into a ring file in shared memory (:mod:`commcheck.wire.ring`)
and holds no socket and no sender thread. The relay tails those rings, cuts them into
batches and ships them to ``commcheck collect`` with acknowledged, exactly-once delivery
(one ZeroMQ DEALER for the node; :mod:`commcheck.collector.ledger` has the protocol), or
writes the ranks' dump files when there is no collector. It journals every message in the
ring before sending it, so a relay killed and started again re-sends the same messages
under the same names. It watches the ranks' processes and reports what it sees
(``status`` messages: alive, stopped, gone, said goodbye, seconds since the last record).

Started by a launcher (``commcheck run``), by hand (``commcheck relay``), or
by the first rank of the run on the node that finds nobody holding the run's lock. It may
import only :mod:`commcheck.wire`.
"""

from __future__ import annotations
