"""How ``commcheck run`` splits its command line between itself, torchrun and the script,
and what it plans to start on each node (no process is started here)."""

from __future__ import annotations

import sys

import pytest

from commcheck.run import LaunchError
from commcheck.run.options import parse

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
    from commcheck.run.processes import run_keys

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

    from commcheck.run.processes import fresh_db

    monkeypatch.chdir(tmp_path)
    names = [fresh_db() for _ in range(3)]
    assert len(set(names)) == 3 and all(n.startswith("runs/commcheck-") for n in names)
    for n in names:
        assert os.stat(n).st_size == 0 and os.stat(n).st_mode & 0o777 == 0o600


def test_the_table_of_torchruns_options_is_this_torchs():
    """The plain read knows every torchrun option by whether it takes a value, as torch's
    parser does; a change in torch fails here, not in a user's job."""
    from torch.distributed.run import get_args_parser

    from commcheck.run.options import TORCHRUN_FLAGS, TORCHRUN_VALUED

    flags, valued = set(), set()
    for action in get_args_parser()._actions:
        if action.option_strings and action.dest != "help":
            (flags if action.nargs == 0 else valued).update(action.option_strings)
    assert (flags, valued) == (set(TORCHRUN_FLAGS), set(TORCHRUN_VALUED))


@pytest.mark.parametrize("argv", [
    ["--nproc-per-node", "4", "--db", "x.db", "{script}", "--db", "mine"],
    ["--node-rank=1", "--nnodes", "2", "--nproc_per_node=2", "--master-addr", "head",
     "--master-port", "29600", "--hang-timeout", "5", "--", "{script}", "-x"],
    ["--standalone", "--rdzv-id", "j", "--rdzv-endpoint", "h:1", "--tee", "3",
     "--collector-port=7", "-m", "pkg.train", "--x"],
    ["--no-python", "--rdzv_backend", "c10d", "--max-restarts", "0", "echo", "hi"],
])
def test_the_plain_read_reads_as_torchs_parser(script, argv):
    from commcheck.run.options import read_by_torch, read_plainly

    argv = [a.format(script=script) for a in argv]
    assert read_plainly(argv) == read_by_torch(argv)


@pytest.mark.parametrize("argv", [["--nproc", "2", "x.py"], ["-r0", "x.py"], ["--help"],
                                  ["--master-port", "-1", "x.py"], ["--", "-"]])
def test_what_the_table_cannot_decide_goes_to_torch(argv):
    from commcheck.run.options import read_plainly

    assert read_plainly(argv) is None


def test_a_plain_command_line_imports_no_torch(script):
    """Nor does asking for the DDP hook's library (its key names torch's build)."""
    import subprocess

    code = ("import sys; from commcheck.run.options import parse; "
            f"p = parse(['--nproc-per-node', '2', {script!r}, '--lr', '3'], {{}}); "
            "from commcheck.native import ddphook; ddphook.key('c++'); "
            "assert p.world == 2, p; assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr


def test_run_knows_every_status_with_which_the_collector_printed_its_report():
    """`commcheck run` prints the report again only when the collector printed none: a
    status it did not know (training failed, 4) printed the report twice."""
    from commcheck.collector import report
    from commcheck.run.main import REPORT_STATUSES

    assert sorted(REPORT_STATUSES) == sorted(
        (report.CLEAN, report.FINDINGS, report.UNFINISHED, report.FAILED, report.UNVERIFIED))
