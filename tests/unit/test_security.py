"""CURVE keys, the collector's gatekeeper and the insecure-bind warning.

The collector tests run a real ``commcheck collect --curve-dir`` subprocess and real DEALER
senders: no key, a client key the collector does not know, the wrong server key, and the
right keys. Only the last one's records may reach the database; every refusal is counted.
"""

from __future__ import annotations

import stat

import pytest

from commcheck.cli import main
from commcheck.collector.gate import insecure_bind_warning, is_loopback
from commcheck.rank.config import ConfigError, load_config
from commcheck.wire.keys import SecurityError, keygen, server_keys


def _mode(p) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_keygen_writes_the_layout_with_private_secrets(tmp_path, capsys):
    d = tmp_path / "keys"
    assert main(["keygen", str(d)]) == 0
    assert set(capsys.readouterr().out.split()) == {
        str(d / n) for n in ("server.key", "server.key_secret", "client.key_secret",
                             "clients/client.key")}
    assert _mode(d) == 0o700
    assert _mode(d / "server.key_secret") == 0o600
    assert _mode(d / "client.key_secret") == 0o600
    assert [p.name for p in d.iterdir() if p.name.startswith(".")] == []
    keys = server_keys(d)
    assert len(keys.allowed) == 1
    rank = load_config(env={"COMMCHECK_CURVE_DIR": str(d)}).client_keys()
    assert rank is not None and rank.server == keys.public and rank.public in keys.allowed


def test_keygen_refuses_to_overwrite_unless_forced(tmp_path, capsys):
    d = tmp_path / "keys"
    keygen(d)
    before = (d / "server.key_secret").read_text()
    assert main(["keygen", str(d)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("commcheck: error:") and "--force" in err[0]
    assert (d / "server.key_secret").read_text() == before
    assert main(["keygen", str(d), "--force"]) == 0
    assert (d / "server.key_secret").read_text() != before


def test_rank_keys_from_dir_or_explicit_paths(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    keygen(a)
    keygen(b)
    assert load_config(env={}).curve_dir == ""
    assert load_config(env={}).client_keys() is None
    mixed = load_config(env={"COMMCHECK_CURVE_DIR": str(a),
                             "COMMCHECK_CURVE_SERVER_KEY": str(b / "server.key")}).client_keys()
    assert mixed is not None
    assert mixed.server == server_keys(b).public
    assert mixed.public in server_keys(a).allowed
    explicit = load_config(curve_client_key=str(b / "client.key_secret"),
                           curve_server_key=str(b / "server.key")).client_keys()
    assert explicit is not None and explicit.public in server_keys(b).allowed


@pytest.mark.parametrize("env", [
    {"COMMCHECK_CURVE_DIR": "/nonexistent/keys"},
    {"COMMCHECK_CURVE_CLIENT_KEY": "{a}/client.key_secret"},  # no server key anywhere
    {"COMMCHECK_CURVE_DIR": "{a}", "COMMCHECK_CURVE_CLIENT_KEY": "{a}/server.key"},  # public
])
def test_bad_rank_keys_are_one_line_config_errors(tmp_path, env):
    keygen(tmp_path / "a")
    env = {k: v.format(a=tmp_path / "a") for k, v in env.items()}
    with pytest.raises(ConfigError) as e:
        load_config(env=env)
    assert "\n" not in str(e.value) and str(e.value).startswith("commcheck config:")


def test_server_keys_need_a_secret_and_allowed_clients(tmp_path):
    with pytest.raises(SecurityError, match="not a key directory"):
        server_keys(tmp_path / "missing")
    keygen(tmp_path / "k")
    (tmp_path / "k" / "clients" / "client.key").unlink()
    with pytest.raises(SecurityError, match="no client public keys"):
        server_keys(tmp_path / "k")
    (tmp_path / "k" / "server.key_secret").write_text("garbage\n")
    with pytest.raises(SecurityError, match="server.key_secret"):
        server_keys(tmp_path / "k")


@pytest.mark.parametrize("endpoint, local", [
    ("tcp://127.0.0.1:5555", True), ("tcp://127.0.0.1:*", True), ("tcp://127.3.2.1:1", True),
    ("tcp://localhost:5555", True), ("tcp://[::1]:5555", True), ("ipc:///tmp/cc", True),
    ("inproc://x", True), ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False),
    ("tcp://10.1.2.3:5555", False), ("tcp://eth0:5555", False), ("tcp://[::]:5555", False),
])
def test_an_open_bind_always_says_so_in_one_line(endpoint, local):
    """Loopback too: any local process can send as the job's ranks (issue 26)."""
    assert is_loopback(endpoint) is local
    warning = insecure_bind_warning(endpoint, "")
    assert warning is not None and "\n" not in warning
    assert warning.startswith("commcheck collect: warning:") and "--curve-dir" in warning
    assert ("any local process" in warning) is local
    assert ("other hosts" in warning) is not local
    assert insecure_bind_warning(endpoint, "/some/keys") is None


@pytest.mark.parametrize("bind, curve, warned", [
    ("tcp://0.0.0.0:5555", "", True), ("tcp://127.0.0.1:5555", "", True),
    ("tcp://0.0.0.0:5555", "KEYS", False),
])
def test_collect_warns_once_about_an_open_bind(bind, curve, warned, capsys, monkeypatch):
    import commcheck.collector.daemon

    class Stub:
        def __init__(self, opts):
            assert opts.curve_dir == curve

        def run(self) -> int:
            return 0

    monkeypatch.setattr(commcheck.collector.daemon, "Collector", Stub)
    args = ["collect", "--bind", bind, "--world-size", "1", "--db", "x.db"]
    assert main(args + (["--curve-dir", curve] if curve else [])) == 0
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == int(warned)
    if warned:
        assert lines[0].startswith("commcheck collect: warning:") and "--curve-dir" in lines[0]
