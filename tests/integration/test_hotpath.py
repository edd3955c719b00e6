"""The hot path (commcheck/rank/hotpath.py) writes the records the general path writes:
the same job run with it on and off, every field of every record compared (times aside),
and the goodbye's counts (bypassed, not checked) equal."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from commcheck.native import hot
from commcheck.wire import GOODBYE, RECORDS, decode, read_frames

from ..harness import WORKERS, start_job

pytestmark = pytest.mark.timeout(240)
TIMES = ("t_enter", "t_exit", "t_done")


def _comparable(v: object) -> object:
    """A field's value; NaN (a sum over NaN elements) as a string, so that it equals itself."""
    return "nan" if isinstance(v, float) and math.isnan(v) else v


def _records(dump: Path) -> tuple[dict[int, list[tuple]], dict[int, dict[str, int]]]:
    """Per rank: its records as comparable tuples (sorted), and its goodbye counters."""
    out: dict[int, list[tuple]] = {}
    counters: dict[int, dict[str, int]] = {}
    files = sorted(dump.rglob("*.ccw")) or sorted(p for p in dump.rglob("*") if p.is_file())
    for path in files:
        with path.open("rb") as f:
            for frame in read_frames(f):
                batch = decode(frame)
                env = batch.env
                if env.kind == GOODBYE:
                    counters[env.rank] = dict(env.counters)
                if env.kind != RECORDS:
                    continue
                names = [n for n in batch.records.dtype.names if n not in TIMES]
                for row in batch.records:
                    name, ranks = env.groups[int(row["group"])]
                    fields = {n: _comparable(row[n].item()) for n in names}
                    for n in ("op", "dtype", "redop", "algo", "callsite"):
                        fields[n] = env.strings[fields[n]]
                    fields["group"] = (name, tuple(ranks))
                    off, n = int(row["chunk_off"]), int(row["chunk_n"])
                    chunks = [tuple(_comparable(c.item()) for c in ch)
                              for ch in batch.chunks[off:off + n]]
                    del fields["chunk_off"], fields["shape_off"]
                    out.setdefault(env.rank, []).append(
                        (fields["group"], fields["seq"], fields["phase"],
                         tuple(sorted(fields.items(), key=str)), batch.ints(row),
                         tuple(chunks)))
    return {r: sorted(v, key=lambda x: (x[0], x[1], x[2])) for r, v in out.items()}, counters


def test_the_hot_path_writes_what_the_general_path_writes(tmp_path):
    if hot.module() is None:
        pytest.skip("the native per-call path cannot be built here")
    jobs = {}
    for on in ("1", "0"):  # the two jobs side by side: nothing shared but the code
        env = {"COMMCHECK_DUMP_DIR": str(tmp_path / f"hot{on}"), "COMMCHECK_RUN_ID": "hot",
               "COMMCHECK_HOTPATH": on}
        jobs[on] = start_job(WORKERS / "hotpath_ops.py", env, nnodes=1, nproc=2)
    got = {}
    for on, procs in jobs.items():
        for p in procs:
            out, _ = p.communicate(timeout=200)
            assert p.returncode == 0, out[-3000:]
        got[on] = _records(tmp_path / f"hot{on}")
    (fast, fast_counts), (general, general_counts) = got["1"], got["0"]
    assert sorted(fast) == sorted(general) == [0, 1]
    for rank in (0, 1):
        assert len(fast[rank]) == len(general[rank]) > 200
        for a, b in zip(fast[rank], general[rank], strict=True):
            assert a == b, [(x, y) for x, y in zip(a[3], b[3], strict=True) if x != y]
        # 17 plain calls per dtype, 7 more per float dtype; 6 large float32 ones, 5 large
        # bfloat16 ones, 4 aliased
        assert fast_counts[rank]["hotpath"] == 7 * 17 + 4 * 7 + 6 + 5 + 4
        # taken whole in C from a group's 9th call of an op (native/express.c), small ones
        # only: on the world all_reduce 6 + 8, broadcast 7, all_gather_single 6 + 4,
        # reduce_scatter_single 6 + 4, all_gather 6 + 4; broadcast on the subgroup 6
        assert fast_counts[rank]["hotpath_express"] == 14 + 7 + 10 + 10 + 10 + 6
        # the large out-of-place ones, not aliased: read while the call ran
        assert fast_counts[rank]["hotpath_overlapped"] == 3 + 2
        assert general_counts[rank]["hotpath"] == 0
        for key in ("bypassed", "not_checked", "dropped", "errors", "internal_errors"):
            assert fast_counts[rank].get(key, 0) == general_counts[rank].get(key, 0), key
