"""The relay's command line (``python -m commcheck.relay`` and ``commcheck relay``).

Every option falls back to the ``COMMCHECK_*`` variable of the same name (the rank side's
configuration keys), so a relay started in a job's environment needs only ``--run``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..wire.keys import SecurityError
from ..wire.ring import RingError, default_ring_dir, open_private
from .relay import Options, Relay


def _env(key: str, default: str = "") -> str:
    return os.environ.get(f"COMMCHECK_{key.upper()}", default)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="commcheck relay",
        description="Ship the records of one run's ranks on this node (their ring files) to "
                    "the collector, or to dump files; exit when they are done.")
    p.add_argument("--run", default=_env("run_id"),
                   help="run id, as the ranks resolve it (default: $COMMCHECK_RUN_ID)")
    p.add_argument("--node", type=int, default=int(os.environ.get("GROUP_RANK", "-1") or -1),
                   help="node rank (torchrun's GROUP_RANK; default: $GROUP_RANK or -1)")
    p.add_argument("--ring-dir", default=_env("ring_dir") or default_ring_dir())
    p.add_argument("--expect", type=int,
                   default=int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1),
                   help="ranks on this node (default: $LOCAL_WORLD_SIZE or 1)")
    p.add_argument("--collector", default=_env("collector"))
    p.add_argument("--dump-dir", default=_env("dump_dir"))
    p.add_argument("--spill-dir", default=_env("spill_dir"))
    p.add_argument("--spill-bytes", type=int, default=int(_env("spill_bytes", str(256 << 20))))
    p.add_argument("--buffer-bytes", type=int, default=int(_env("buffer_bytes", str(4 << 20))))
    p.add_argument("--ack-timeout", type=float, default=float(_env("ack_timeout", "2.0")))
    p.add_argument("--batch-records", type=int, default=int(_env("batch_records", "512")))
    p.add_argument("--flush-interval", type=float, default=float(_env("flush_interval", "0.05")))
    p.add_argument("--linger", type=float, default=float(_env("linger", "5.0")),
                   help="seconds to wait for acknowledgements once the ranks are done")
    p.add_argument("--curve-dir", default=_env("curve_dir"))
    p.add_argument("--curve-client-key", default=_env("curve_client_key"))
    p.add_argument("--curve-server-key", default=_env("curve_server_key"))
    p.add_argument("--lock-fd", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--log", default="",
                   help="log to this file instead of stderr; 'auto': the relay's log next to "
                        "the rings (removed when the relay exits with everything delivered)")
    p.add_argument("--ready-file", default="",
                   help="write the relay's pid here once it holds the run's lock (or found "
                        "another relay holding it)")
    p.add_argument("--idle-exit", type=float, default=60.0,
                   help="exit after this many seconds without a live ring, even if fewer "
                        "ranks than expected came")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    log_to, ready = args.log, args.ready_file
    del args.log, args.ready_file
    if not args.run:
        print("commcheck relay: error: --run (or COMMCHECK_RUN_ID) is required", file=sys.stderr)
        return 2
    if not args.collector and not args.dump_dir:
        print("commcheck relay: error: --collector or --dump-dir is required", file=sys.stderr)
        return 2
    opts = Options(**{k: v for k, v in vars(args).items()})
    try:
        relay = Relay(opts)
        stream = sys.stderr
        if log_to:
            path = relay.log_path if log_to == "auto" else log_to
            stream = os.fdopen(open_private(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "a")
        logging.basicConfig(level=logging.INFO, stream=stream,
                            format="%(asctime)s commcheck-relay[%(process)d] %(message)s")
        return relay.run(ready)
    except (SecurityError, RingError, OSError) as e:
        print(f"commcheck relay: error: {e}", file=sys.stderr)
        return 2
