"""The typed contract (engine/findings.py): every kind has its detail type, findings read
from a database write back the same bytes, travel between processes unchanged, survive a
snapshot, and a finding this commcheck cannot type is one clear error."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import msgspec
import pytest

from commcheck.cli import main
from commcheck.collector import snapshot
from commcheck.collector.store import Store, StoreError
from commcheck.engine import DETAILS, Engine, Finding, Kind
from commcheck.engine.findings import FOLDED, Divergence, NanInf
from commcheck.wire import F_OUT_HASH, F_OUT_SUMMARY
from commcheck.wire.ops import BY_NAME

from ..records import WORLD, feed, rec

pytestmark = pytest.mark.timeout(30)
EVERY_KIND = Path(__file__).parent / "data" / "report" / "every_kind.db"
LIVENESS = EVERY_KIND.with_name("liveness.db")  # the stall kinds issue 12 added
COLUMNS = "kind, run, op, grp, seq, step, culprits, hosts, callsite, detail, ambiguous, t"


def test_every_kind_has_a_detail_type_and_every_op_finds_a_kind():
    assert set(DETAILS) == set(Kind)
    assert {Kind(spec.mismatch_kind) for spec in BY_NAME.values()} <= set(Kind)
    for kind, field in FOLDED.items():
        assert field in DETAILS[kind].__struct_fields__


def test_a_kind_prints_as_its_value():
    assert (f"{Kind.NAN_INF}", str(Kind.NAN_INF), f"{Kind.DESYNC:>8}") == (
        "nan_inf", "nan_inf", "  desync")
    assert Kind.NAN_INF == "nan_inf" and json.dumps({Kind.DESYNC: 1}) == '{"desync": 1}'


def test_the_pinned_databases_hold_every_kind():
    """Except straggler, newer than them: test_stragglers.py stores and reads its own."""
    kinds = {f.kind for db in (EVERY_KIND, LIVENESS) for f in Store.open(db).findings()}
    assert kinds == set(Kind) - {Kind.STRAGGLER}


@pytest.mark.parametrize("db", [EVERY_KIND, LIVENESS], ids=lambda p: p.stem)
def test_findings_read_from_a_database_write_back_the_same_bytes(tmp_path, db):
    old = Store.open(db)
    findings = old.findings()
    new = Store.create(tmp_path / "new.db")
    new.add_findings(findings)
    for f in findings:  # what a collector does to onsets at every commit
        if f.kind in FOLDED:
            new.update_finding_detail(f)
    new.commit()
    want = old.conn.execute(f"SELECT {COLUMNS} FROM findings ORDER BY t, id").fetchall()
    got = new.conn.execute(f"SELECT {COLUMNS} FROM findings ORDER BY id").fetchall()
    new.close()
    old.close()
    assert got == want


def test_findings_cross_processes_unchanged():
    """As the shards send them: to_json, msgpack, from_json."""
    for f in Store.open(EVERY_KIND).findings() + Store.open(LIVENESS).findings():
        back = Finding.from_json(msgspec.msgpack.decode(msgspec.msgpack.encode(f.to_json())))
        assert back == f and type(back.detail) is type(f.detail)
        assert json.dumps(back.to_json()) == json.dumps(f.to_json())


def _probe(seq: int, diverged: bool, nan: int = 0):
    return rec(op="grad", group_name="grad:w", seq=seq, step=seq, out=(9, 9) if diverged else
               (1, 1), out_summary=(1.0, 1.0, nan, 0), flags=F_OUT_HASH | F_OUT_SUMMARY)


@pytest.mark.parametrize("fast", [True, False])
def test_onsets_in_a_snapshot_keep_their_type_and_keep_counting(fast):
    engine = Engine(4, fast=fast)
    found = []
    for r in WORLD:  # rank 3 diverges at steps 0-1; rank 2's bias gradient carries a NaN
        found += feed(engine, r, [_probe(0, r == 3), _probe(1, r == 3),
                                  rec(op="grad", group_name="grad:b", seq=0, out=(1, 1),
                                      out_summary=(0.0, 1.0, int(r == 2), 0),
                                      flags=F_OUT_HASH | F_OUT_SUMMARY)])
    assert sorted(f.kind for f in found) == [Kind.GRAD_DIVERGENCE, Kind.NAN_INF]
    engine = snapshot.load(snapshot.dump(engine))
    for r in WORLD:
        assert feed(engine, r, [_probe(2, r == 3)]) == []
    onsets = {o.finding.kind: o.finding for o in engine.onsets.values()}
    assert isinstance(onsets[Kind.GRAD_DIVERGENCE].detail, Divergence)
    assert onsets[Kind.GRAD_DIVERGENCE].detail.later_steps == 2
    assert isinstance(onsets[Kind.NAN_INF].detail, NanInf)


@pytest.mark.parametrize(("column", "value", "says"), [
    ("kind", "corrupted_vibes", "'corrupted_vibes' is not a valid Kind"),
    ("detail", '{"links": [[1, 3]], "colour": "red"}', "unknown field `colour`"),
    ("detail", '{"links": "1→3"}', "Expected `array`, got `str`"),
])
def test_a_finding_this_commcheck_cannot_type_is_one_clear_error(tmp_path, capsys, column,
                                                                  value, says):
    db = tmp_path / "odd.db"
    shutil.copyfile(EVERY_KIND, db)
    with sqlite3.connect(db) as conn:
        conn.execute(f"UPDATE findings SET {column} = ? WHERE id = (SELECT MIN(id) FROM "
                     f"findings WHERE kind = 'link_corruption')", (value,))
    conn.close()
    with pytest.raises(StoreError, match=f"{db}: finding [0-9]+ .*{says}"):
        Store.open(db).findings()
    assert main(["report", str(db), "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("commcheck: error: ") and err.count("\n") == 1
