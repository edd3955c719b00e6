"""The fast path's parts (fast_verdicts, kept, fast_convert, fast_stalls): a snapshot taken
before they had modules of their own, when the kept chunk and split tables were three
attributes of ``FastPath``, still restores and decides the rest like the uninterrupted
engine."""

from __future__ import annotations

import pytest

from commcheck.collector import snapshot
from commcheck.engine import Engine
from commcheck.engine.fastpath import FastPath
from tests.unit.test_engine_fast import _batches, _js, _state, _traffic


def _as_before_the_split(fast: FastPath) -> FastPath:
    state = dict(vars(fast))
    held = state.pop("held")
    for part in ("verdicts", "reader", "stalls"):
        del state[part]
    state.update(kept=held.tables, kept_refs=held.refs, _kept_id=held._last_id)
    old = FastPath.__new__(FastPath)
    old.__setstate__(state)
    return old


@pytest.mark.parametrize("seed", [1, 2])
def test_a_snapshot_of_the_unsplit_fast_path_restores(seed):
    rng, streams = _traffic(seed, keys=80)
    batches = _batches(rng, streams, 5, shuffle=True)
    ref, cur = Engine(5, hang_timeout=5.0), Engine(5, hang_timeout=5.0)
    half = len(batches) // 2
    assert _js(cur.ingest_many(batches[:half])) == _js(ref.ingest_many(batches[:half]))
    assert cur.fast.kept  # chunks or splits held open: the restore must carry them
    cur.fast = _as_before_the_split(cur.fast)
    cur = snapshot.load(snapshot.dump(cur))
    fast = cur.fast
    assert fast.reader.kept is fast.held and fast.verdicts.kept is fast.held
    assert fast.reader.tables is fast.tables and fast.stalls.tables is fast.tables
    assert _js(cur.ingest_many(batches[half:])) == _js(ref.ingest_many(batches[half:]))
    assert _js(cur.finish()) == _js(ref.finish())
    assert _state(cur) == _state(ref)
    assert cur.fast.kept == {} and cur.fast.kept_refs == {}
