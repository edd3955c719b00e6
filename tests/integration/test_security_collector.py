"""A real ``commcheck collect --curve-dir`` and real DEALER senders: no key, an unknown client
key, the wrong server key, the right keys. Only the last one's records reach the database;
every refusal is counted."""

from __future__ import annotations

import re

import pytest
import zmq

from commcheck.rank.config import load_config
from commcheck.wire.keys import ClientKeys, keygen

from ..harness import report_json, start_collector
from ..senders import Push, Rank, wait_counters
from ..stored import stored


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_collector_accepts_only_allowed_client_keys(tmp_path):
    keys = tmp_path / "keys"
    keygen(keys)
    good = load_config(env={"COMMCHECK_CURVE_DIR": str(keys)}).client_keys()
    assert good is not None
    intruder = ClientKeys(*zmq.curve_keypair(), server=good.server)
    wrong_server = ClientKeys(good.public, good.secret, server=zmq.curve_keypair()[0])
    col = start_collector(tmp_path, 1, "--curve-dir", str(keys), "--exit-when-done",
                          "--idle-timeout", "60")
    seen: dict[str, int] = {}
    for i, (keys_used, reason) in enumerate([(None, "auth_handshake"), (intruder, "auth"),
                                             (wrong_server, "auth_handshake")]):
        before = seen.get(f"rejected.{reason}", 0)
        sender = Push(col.endpoint, keys_used)
        try:
            r = Rank(f"intruder{i}")
            for payload in (r.hello(), r.batch(5), r.goodbye()):
                sender.send(payload)
            seen = wait_counters(col.db, lambda c, k=f"rejected.{reason}", n=before:
                                 c.get(k, 0) > n)
        finally:
            sender.close(linger_ms=0)
    rank = Rank("trusted")
    with Push(col.endpoint, good) as sender:
        for payload in (rank.hello(), rank.batch(3), rank.batch(2), rank.goodbye()):
            sender.send(payload)
    rc, out, err = col.wait(60)
    assert rc == 0, err
    assert "Traceback" not in err
    assert "refused client key" in err and "refused a connection" in err
    # both refusal paths name the peer (ZAP: its address; a failed handshake: host:port)
    assert re.search(r"refused client key \S+ from 127\.0\.0\.1", err), err
    assert re.search(r"refused a connection: .* from 127\.0\.0\.1:\d+", err), err
    with stored(col.db) as conn:
        kept = conn.execute("SELECT run, COUNT(*) FROM records GROUP BY run").fetchall()
        ranks = conn.execute("SELECT run FROM ranks").fetchall()
    assert kept == [("trusted", 5)]
    assert ranks == [("trusted",)]
    code, doc = report_json(col.db)
    assert code == 0
    assert doc["summary"]["verified"] == 5
    assert {"auth", "auth_handshake"} <= set(doc["summary"]["rejected"])
    refused = {r["reason"]: r for r in doc["summary"]["refused"]}  # the senders, named
    assert re.fullmatch(r"client key \S{40} from 127\.0\.0\.1", refused["auth"]["who"])
    assert refused["auth_handshake"]["who"].startswith(("127.0.0.1 (", "an unknown address"))
    assert "open_collector" not in doc["summary"]
    assert "messages rejected (auth)" in out
