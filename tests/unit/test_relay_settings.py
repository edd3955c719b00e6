"""The rank↔relay contract (docs/relay-settings.md): one settings type, every field carried
by the rank and read back by the relay's command line unchanged."""

from __future__ import annotations

import os
from dataclasses import fields, replace

import pytest

from commcheck.rank.config import Config
from commcheck.rank.relay_launch import relay_settings
from commcheck.relay.main import command, main, parse
from commcheck.wire.relay_settings import RELAY_DEFAULTS, RelaySettings, flag, to_argv

pytestmark = pytest.mark.timeout(30)

# set by the rank from its process (run id, node, local world), by RingWriter.create (the
# folder it chose), at the launch (the lock), or only by a relay started by hand
NOT_FROM_CONFIG = {"run", "node", "expect", "lock_fd", "log", "ready_file", "idle_exit"}
SHARED = [f.name for f in fields(RelaySettings) if f.name not in NOT_FROM_CONFIG]


def _unusual(kind: str, i: int) -> object:
    """A value no default has, per field, that a careless encoding would not keep."""
    return {"str": f"-odd value {i}=x", "int": 1000 + i, "float": 0.1 * (i + 1) + 1e-12}[kind]


def _everything_set() -> RelaySettings:
    return RelaySettings(**{f.name: _unusual(str(f.type), i)
                            for i, f in enumerate(fields(RelaySettings))})


def test_every_field_survives_the_command_line_exactly():
    s = _everything_set()
    assert all(getattr(s, f.name) != f.default for f in fields(s))
    assert parse(to_argv(s)) == s


def test_the_command_line_is_generated_from_the_fields():
    options = {o for p in command().params for o in p.opts} - {"--help"}
    assert options == {flag(f) for f in fields(RelaySettings)}


def test_the_rank_carries_every_relay_field_of_its_configuration():
    """A field added to RelaySettings must be a Config key of the same name and default
    (the rank then carries it), or be named here as set another way."""
    config = {f.name: f for f in fields(Config)}
    relay = {f.name: f for f in fields(RelaySettings)}
    assert set(SHARED) <= set(config), "a relay field the rank's configuration lacks"
    for name in SHARED:
        assert config[name].default == getattr(RELAY_DEFAULTS, name), name
        assert relay[name].metadata["env"] == f"COMMCHECK_{name.upper()}", name
    values = {name: _unusual(str(config[name].type), i) for i, name in enumerate(SHARED)}
    with_collector = Config(**values)
    s = relay_settings(with_collector, "run-1", 3, 4)
    assert (s.run, s.node, s.expect) == ("run-1", 3, 4)
    for name in SHARED:
        want = values[name]
        if name == "dump_dir":
            want = ""  # a collector: no dump files
        elif name in ("spill_dir", "curve_dir", "curve_client_key", "curve_server_key"):
            want = os.path.join(os.getcwd(), want)  # absolute: the relay's cwd differs
        assert getattr(s, name) == want, name
    assert parse(to_argv(s)) == s
    alone = relay_settings(replace(with_collector, collector=""), "r", -1, 1)
    assert alone.dump_dir.endswith(values["dump_dir"]) and alone.curve_dir == ""


def test_flags_win_over_the_environment_and_absent_ones_fall_back_to_it(monkeypatch):
    monkeypatch.setenv("COMMCHECK_RUN_ID", "from-env")
    monkeypatch.setenv("COMMCHECK_SPILL_DIR", "/env/spill")
    monkeypatch.setenv("COMMCHECK_BATCH_RECORDS", "9")
    monkeypatch.setenv("GROUP_RANK", "")  # empty: the default
    assert parse([]) == RelaySettings(run="from-env", spill_dir="/env/spill", batch_records=9)
    assert parse(to_argv(RelaySettings(run="r"))) == RelaySettings(run="r")  # "" is a value


@pytest.mark.parametrize("argv, said", [
    (["--node", "x"], "Invalid value for '--node'"),
    (["--no-such"], "No such option: --no-such"),
    (["--dump-dir", "/d"], "--run (or COMMCHECK_RUN_ID) is required"),
    (["--run", "r"], "--collector or --dump-dir is required"),
])
def test_bad_command_lines_get_one_line_and_status_2(monkeypatch, capsys, argv, said):
    for name in ("COMMCHECK_RUN_ID", "COMMCHECK_COLLECTOR", "COMMCHECK_DUMP_DIR", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("commcheck relay: error: ") and said in err
