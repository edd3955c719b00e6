"""Config precedence (kwargs > env > file > defaults) and one-line errors."""

from __future__ import annotations

import json

import pytest

from commcheck.rank.config import Config, ConfigError, load_config
from commcheck.rank.inject import Fault, parse

pytestmark = pytest.mark.timeout(30)


def test_defaults():
    assert load_config(env={}) == Config()


def test_precedence_kwargs_over_env_over_file(tmp_path):
    f = tmp_path / "cc.json"
    f.write_text(json.dumps({"batch_records": 7, "linger": 1.5, "host": "from-file",
                             "summary": False}))
    env = {"COMMCHECK_CONFIG": str(f), "COMMCHECK_BATCH_RECORDS": "9",
           "COMMCHECK_HOST": "from-env", "COMMCHECK_UNRELATED_TOOL": "x"}
    cfg = load_config(env=env, host="from-kwargs")
    assert cfg.host == "from-kwargs"
    assert cfg.batch_records == 9
    assert cfg.linger == 1.5
    assert cfg.summary is False
    assert load_config(env={"COMMCHECK_CONFIG": str(f)}).host == "from-file"
    assert load_config(env={}, config=str(f)).batch_records == 7


@pytest.mark.parametrize("env, match", [
    ({"COMMCHECK_BATCH_RECORDS": "lots"}, "batch_records='lots' from environment"),
    ({"COMMCHECK_HASH": "maybe"}, "hash='maybe'"),
    ({"COMMCHECK_LINGER": "-1"}, "must not be negative"),
    ({"COMMCHECK_CONFIG": "/nonexistent/cc.json"}, "does not exist"),
    ({"COMMCHECK_BATCH_RECORDS": "10", "COMMCHECK_QUEUE_RECORDS": "5"}, "batch_records"),
])
def test_bad_values_raise_one_clear_line(env, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(env=env)
    assert "\n" not in str(e.value)


def test_bad_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(env={}, config=str(bad))
    bad.write_text("[1]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(env={}, config=str(bad))
    bad.write_text('{"colector": "tcp://x:1"}')
    with pytest.raises(ConfigError, match="unknown key 'colector'"):
        load_config(env={}, config=str(bad))
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(env={}, bogus=1)


def test_inject_spec_parsing():
    faults = parse("bitflip:rank=2,op=all_reduce,call=40; swap:rank=1,op=all_gather_into_tensor,"
                   "call=3,a=0,b=2")
    assert faults == [Fault("bitflip", 2, "all_reduce", 40),
                      Fault("swap", 1, "all_gather_single", 3, a=0, b=2)]
    for bad, match in [("melt:rank=1,op=all_reduce,call=1", "unknown fault kind"),
                       ("bitflip:rank=1,op=all_reduce", "lacks call"),
                       ("bitflip:rank=x,op=all_reduce,call=1", "not an integer"),
                       ("bitflip:rank=1,op=nope,call=1", "unknown op"),
                       ("bitflip:rank=1,op=all_reduce,call=1,color=red", "bad item")]:
        with pytest.raises(ConfigError, match=match):
            parse(bad)
