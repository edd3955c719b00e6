"""What ``commcheck collect`` can be told, with its defaults: the one place they are written.

The collector (:mod:`.daemon`) takes a :class:`CollectorOptions`; ``commcheck collect``'s
options take their defaults from this class (``tests/unit/test_collector_options.py`` holds
the two together). Nothing heavy is imported here: the CLI reads it to build ``--help``.
"""

from __future__ import annotations

from dataclasses import dataclass

# how records are kept (store.py RECORD_MODES): the records file, SQL rows, blobs, none
DEFAULT_RECORDS = "file"
# more than this share of the collectives unverified (records dropped) is not clean
DEFAULT_MAX_UNVERIFIED = 0.1


@dataclass
class CollectorOptions:
    bind: str
    world_size: int
    db: str
    exit_when_done: bool = False
    done_wait: float = 60.0  # exit_when_done: seconds of silence from unfinished ranks
    idle_timeout: float = 0.0  # seconds without a message before exiting; 0: never
    live: bool | None = None  # None: live view only on a terminal
    ready_file: str = ""
    commit_interval: float = 0.5  # at least; longer while commits are expensive (maintain)
    # the engine's DEFAULT_HANG_TIMEOUT (engine/core.py; the test holds them equal: the
    # engine imports numpy, too much for --help)
    hang_timeout: float = 30.0
    curve_dir: str = ""  # accept only CURVE senders holding a key in curve_dir/clients
    records: str = DEFAULT_RECORDS  # how records are kept: file, rows, batches or none
    # (see store.py)
    shards: int = 1  # engine processes; > 1 routes batches by group identity (shards.py)
    keep_bodies: bool = False  # keep every message body in `delivered` (analyze reads a
    # sharded collector's database from them)
    metrics: str = ""  # serve Prometheus metrics on HOST:PORT (metrics.py); "": off
    new_keys: bool = False  # write fresh CURVE keys into curve_dir first (commcheck run's
    # per-run keys): every sender of the job holds them, so a refused one is never the
    # job's and does not shorten exit_when_done's wait
    fresh: bool = False  # refuse a database that already holds a run (commcheck run)
    max_unverified: float = DEFAULT_MAX_UNVERIFIED  # more unverified is not clean (status 5)
    straggler: str = ""  # when a rank is a straggler: "key=value,..." or "off" (see
    # engine/stragglers.py StragglerRules)
