"""Host time commcheck adds per wrapped call, by stage, on a gloo world of one rank.

    python launch/bench_hotpath.py [--calls 2000] [--rounds 7] [--sizes 4096,65536]

One process, one rank, so the collective itself is nearly free: the wrapped function and the
original it wraps (``__commcheck_original__``) are timed interleaved, round after round,
and the median per-call difference is what commcheck costs. The stages are then timed one by
one on the same arguments (bind, metadata, call site, fingerprint, hand-off to the ring), so
a regression shows where it is. Records go to a temporary dump directory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_tmp = tempfile.TemporaryDirectory(prefix="commcheck-hotpath-")
os.environ.setdefault("COMMCHECK_DUMP_DIR", _tmp.name)
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 20000))

import commcheck  # noqa: E402

commcheck.patch()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from commcheck.rank import runtime  # noqa: E402
from commcheck.rank.callsite import callsite  # noqa: E402
from commcheck.rank.prints import SidePrint  # noqa: E402
from commcheck.wire import SIDE_IN, SIDE_OUT  # noqa: E402
from commcheck.wire.ops import BY_NAME  # noqa: E402


class _SendRecv:
    """isend to oneself's pair is not allowed on one rank: send+recv via a 2nd group is not
    possible either, so p2p is timed as the Python work only (see the README)."""


def cases(n: int) -> dict[str, tuple]:
    """op -> (wrapped function, args, spec, input tensor, output tensor)."""
    x = torch.randn(n)
    out = torch.empty(n)
    return {
        "all_reduce": (dist.all_reduce, (x,), BY_NAME["all_reduce"], None, x),
        "all_gather_single": (dist.all_gather_single, (out, x), BY_NAME["all_gather_single"],
                              x, out),
        "broadcast": (dist.broadcast, (x, 0), BY_NAME["broadcast"], x, x),
        "reduce_scatter_single": (dist.reduce_scatter_single, (out, x),
                                  BY_NAME["reduce_scatter_single"], None, out),
    }


def per_call(fn, args, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - t) / calls * 1e6


def stages(session, fn, args, spec, inp, out, calls: int) -> dict[str, float]:
    """µs per call of each commcheck stage, run alone on the call's arguments."""
    import torch.distributed.distributed_c10d as c10d

    from commcheck.wire import Record

    bind = fn.__commcheck_bind__ if hasattr(fn, "__commcheck_bind__") else None
    pg = c10d._get_default_group()
    group = session.groups.resolve(pg)
    res: dict[str, float] = {}
    if bind is not None:
        res["bind"] = per_call(bind, (args, {}), calls)
    res["metadata"] = per_call(session.groups.resolve, (pg,), calls)
    res["call site"] = per_call(callsite, (1,), calls)

    def fingerprint() -> None:
        if inp is not None:
            SidePrint.take(SIDE_IN, [[inp]], None, hash=True, summary=True)
        SidePrint.take(SIDE_OUT, [[out]], None, hash=True, summary=spec.summarize_output)

    res["fingerprint"] = per_call(fingerprint, (), calls)
    rec = Record(group_name=group.name, group_ranks=group.ranks, seq=0, op=spec.name,
                 dtype="float32", callsite="x.py:1 f", numel_in=out.numel(),
                 numel_out=out.numel(), in_shape=tuple(out.shape), out_shape=tuple(out.shape))
    writer = session.sender
    res["hand-off (2 records)"] = per_call(lambda: (writer.write_record(rec),
                                                    writer.write_record(rec)), (), calls)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sizes", default="4096,65536", help="bytes, comma separated")
    ap.add_argument("--ops", default="all_reduce,all_gather_single,broadcast,"
                                     "reduce_scatter_single")
    ap.add_argument("--no-stages", action="store_true")
    args = ap.parse_args()
    dist.init_process_group("gloo", rank=0, world_size=1)
    session = runtime.active_session()
    torch.set_num_threads(1)
    print(f"gloo world 1, torch {torch.__version__}; µs per call, median of {args.rounds} "
          f"rounds x {args.calls} calls (min..max of the added time in brackets)")
    print(f"{'op':<24}{'size':>8}{'orig':>9}{'wrapped':>9}{'added':>9}  range")
    for nbytes in (int(s) for s in args.sizes.split(",")):
        for op in args.ops.split(","):
            fn, fargs, spec, inp, out = cases(nbytes // 4)[op]
            orig = fn.__commcheck_original__
            per_call(fn, fargs, 50)
            per_call(orig, fargs, 50)
            o, w = [], []
            for r in range(args.rounds):
                pair = ((orig, o), (fn, w)) if r % 2 else ((fn, w), (orig, o))
                for f, acc in pair:
                    acc.append(per_call(f, fargs, args.calls))
            added = sorted(b - a for a, b in zip(o, w, strict=True))
            print(f"{op:<24}{nbytes >> 10:>6}Ki{statistics.median(o):>9.1f}"
                  f"{statistics.median(w):>9.1f}{statistics.median(added):>9.1f}  "
                  f"[{added[0]:.1f}..{added[-1]:.1f}]", flush=True)
            if not args.no_stages:
                parts = stages(session, fn, fargs, spec, inp, out, args.calls)
                print("    stages: " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
