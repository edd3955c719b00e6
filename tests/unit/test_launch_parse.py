"""How ``commcheck run`` splits its command line between itself, torchrun and the script,
and what it plans to start on each node (no process is started here)."""

from __future__ import annotations

import sys

import pytest

from commcheck.launch import LaunchError, parse

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def script(tmp_path):
    p = tmp_path / "train.py"
    p.write_text("")
    return str(p)


def test_one_node(script):
    plan = parse(["--nproc-per-node", "4", "--db", "x.db", script, "--db", "mine", "--lr",
                  "3"], {})
    assert plan.torchrun == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", "4", script, "--db", "mine", "--lr", "3"]
    assert plan.opts.db == "x.db"  # commcheck's before the script, the script's after
    assert (plan.world, plan.node, plan.bind) == (4, 0, "tcp://127.0.0.1:*")
    assert plan.run_id.startswith("run-")


def test_node_zero_and_one_of_two(script):
    common = ["--nnodes", "2", "--nproc_per_node=2", "--master-addr", "head",
              "--master-port", "29600", "--hang-timeout", "5", "--"]
    zero = parse(["--node-rank", "0", *common, script], {})
    one = parse(["--node-rank=1", *common, script], {"COMMCHECK_RUN_ID": "job7"})
    assert zero.torchrun[3:] == ["--node-rank", "0", "--nnodes", "2", "--nproc_per_node=2",
                                 "--master-addr", "head", "--master-port", "29600", script]
    assert (zero.world, zero.node, zero.bind, zero.run_id) == (4, 0, "tcp://0.0.0.0:5555",
                                                                "head:29600")
    assert zero.opts.hang_timeout == 5.0
    assert (one.node, one.bind, one.collector, one.run_id) == (1, "", "tcp://head:5555",
                                                               "job7")


def test_module_and_an_explicit_collector():
    plan = parse(["--nproc-per-node", "2", "--collector", "tcp://c:1", "-m", "pkg.train",
                  "--x"], {})
    assert plan.torchrun[-3:] == ["-m", "pkg.train", "--x"]
    assert (plan.bind, plan.collector) == ("", "tcp://c:1")


@pytest.mark.parametrize("argv, says", [
    (["--bogus", "x.py"], "--bogus"),
    ([], "training_script"),
    (["missing.py"], "missing.py"),
    (["--nnodes", "1:4", "{script}"], "elastic"),
    (["--nnodes", "2", "--node-rank", "2", "{script}"], "--node-rank"),
    (["--torchrun", "/no/such/torchrun", "{script}"], "torchrun is missing"),
])
def test_bad_input(script, argv, says):
    with pytest.raises(LaunchError, match=says):
        parse([a.format(script=script) for a in argv], {})


def test_per_run_keys_only_where_every_rank_can_read_them(script, tmp_path):
    """One node with its own collector: keys in the launcher's private directory; several
    nodes (the others could not read them), someone else's collector or keys of one's own:
    none made here."""
    from commcheck.launch import run_keys

    one = parse(["--nproc-per-node", "2", script], {})
    assert run_keys(one, tmp_path) and one.opts.curve_dir == str(tmp_path / "keys")
    two = parse(["--nnodes", "2", "--node-rank", "0", "--master-addr", "h", script], {})
    given = parse(["--nproc-per-node", "2", "--curve-dir", "/k", script], {})
    theirs = parse(["--collector", "tcp://h:1", script], {})
    for plan in (two, given, theirs):
        before = plan.opts.curve_dir
        assert not run_keys(plan, tmp_path) and plan.opts.curve_dir == before


def test_default_database_is_new_every_time(tmp_path, monkeypatch):
    """Two launches within the same second never share a generated database."""
    import os

    from commcheck.launch import fresh_db

    monkeypatch.chdir(tmp_path)
    names = [fresh_db() for _ in range(3)]
    assert len(set(names)) == 3 and all(n.startswith("runs/commcheck-") for n in names)
    for n in names:
        assert os.stat(n).st_size == 0 and os.stat(n).st_mode & 0o777 == 0o600
