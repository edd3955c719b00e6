"""Every command, fed bad arguments, missing files, corrupt databases and bad key material:
exactly one line on stderr starting with ``commcheck``, exit status 2, never a traceback."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from commcheck.cli import main
from commcheck.collector.store import Store
from commcheck.wire.keys import keygen

pytestmark = pytest.mark.timeout(60)

SAFE = ("--idle-timeout", "0.5", "--no-live")  # a case that wrongly starts still ends


def _files(d: Path) -> None:
    good = Store.create(d / "good.db")
    good.conn.executemany("INSERT INTO records (run, rank, chunks) VALUES ('r', 1, ?)",
                          [(os.urandom(200),) for _ in range(500)])
    good.conn.executemany(
        "INSERT INTO findings (kind, run, op, grp, seq, step, culprits, hosts, callsite, "
        "detail, ambiguous, t) VALUES ('k','r','op','g',1,1,'[1]','[]','cs','{}',0,1.0)",
        [()] * 500)
    good.close()
    data = (d / "good.db").read_bytes()
    with sqlite3.connect(d / "good.db") as conn:
        root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name='findings'")
        page = root.fetchone()[0]
        size = conn.execute("PRAGMA page_size").fetchone()[0]
    (d / "trunc.db").write_bytes(data[:len(data) // 2])
    (d / "tail_cut.db").write_bytes(data[:-size])
    corrupt = bytearray(data)
    corrupt[(page - 1) * size:page * size] = os.urandom(size)
    (d / "corrupt.db").write_bytes(bytes(corrupt))
    (d / "random.db").write_bytes(os.urandom(8192))
    (d / "empty.db").write_bytes(b"")
    with sqlite3.connect(d / "foreign.db") as conn:
        conn.execute("CREATE TABLE songs (title TEXT)")
    from commcheck.collector import snapshot
    from commcheck.engine import Engine

    for name, parts in (("oldsnap.db", [b"commcheck-snapshot 0 0.0.1\n"]),
                        ("sharded.db", [snapshot.dump(Engine(2))] * 3)):
        st = Store.create(d / name)
        st.set_snapshot(parts)
        st.close()
    (d / "afile").write_text("not a directory\n")
    (d / "dir.db").mkdir()
    keygen(d / "keys")
    keygen(d / "badkeys")
    (d / "badkeys" / "server.key_secret").write_text("public-key = \"short\"\n")
    keygen(d / "noclients")
    (d / "noclients" / "clients" / "client.key").unlink()
    (d / "runa").mkdir()
    (d / "runb").mkdir()
    (d / "runa" / "rank0").mkdir()
    (d / "runa" / "rank0" / "grad_summary_0.csv").write_bytes(os.urandom(300))


def collect(*args: str) -> list[str]:
    base = {"--bind": "tcp://127.0.0.1:*", "--world-size": "2", "--db": "new.db"}
    out = ["collect", *SAFE]
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    for k, v in base.items():
        out += [k] if v is None else [k, v]
    return out


CASES = {
    # collect
    "collect-no-options": ["collect"],
    "collect-missing-db": ["collect", "--bind", "tcp://127.0.0.1:*", "--world-size", "2"],
    "collect-world-zero": collect("--world-size", "0"),
    "collect-world-text": collect("--world-size", "two"),
    "collect-bad-endpoint": collect("--bind", "nonsense"),
    "collect-bad-port": collect("--bind", "tcp://127.0.0.1:99999"),
    "collect-unknown-host": collect("--bind", "tcp://no-such-host.invalid:5555"),
    "collect-random-db": collect("--db", "random.db"),
    "collect-foreign-db": collect("--db", "foreign.db"),
    "collect-truncated-db": collect("--db", "trunc.db"),
    "collect-tail-cut-db": collect("--db", "tail_cut.db"),
    "collect-db-is-dir": collect("--db", "dir.db"),
    "collect-snapshot-other-version": collect("--db", "oldsnap.db"),
    "collect-snapshot-other-shards": collect("--db", "sharded.db"),
    "collect-db-unwritable": collect("--db", "/proc/commcheck/x.db"),
    "collect-db-under-file": collect("--db", "afile/x.db"),
    "collect-no-keydir": collect("--curve-dir", "missing-keys"),
    "collect-bad-server-key": collect("--curve-dir", "badkeys"),
    "collect-no-client-keys": collect("--curve-dir", "noclients"),
    "collect-keydir-is-file": collect("--curve-dir", "afile"),
    "collect-negative-idle": collect("--idle-timeout", "-1"),
    "collect-hang-timeout-zero": collect("--hang-timeout", "0"),
    "collect-ready-file-nowhere": collect("--ready-file", "missing-dir/ready"),
    "collect-ready-file-is-dir": collect("--ready-file", "runa"),
    "collect-unknown-option": collect("--colour", "red"),
    # report
    "report-no-args": ["report"],
    "report-missing-file": ["report", "nope.db"],
    "report-directory": ["report", "dir.db"],
    "report-random": ["report", "random.db"],
    "report-random-json": ["report", "random.db", "--json"],
    "report-empty-file": ["report", "empty.db"],
    "report-foreign": ["report", "foreign.db"],
    "report-truncated": ["report", "trunc.db"],
    "report-tail-cut": ["report", "tail_cut.db"],
    "report-corrupt-page": ["report", "corrupt.db"],
    "report-extra-arg": ["report", "good.db", "other.db"],
    # keygen
    "keygen-no-args": ["keygen"],
    "keygen-existing": ["keygen", "keys"],
    "keygen-dir-is-file": ["keygen", "afile"],
    "keygen-under-file": ["keygen", "afile/keys"],
    "keygen-unwritable": ["keygen", "/proc/commcheck-keys"],
    "keygen-unknown-option": ["keygen", "k2", "--overwrite"],
    # grad compare
    "grad-no-args": ["grad", "compare"],
    "grad-missing-runs": ["grad", "compare", "nope-a", "nope-b", "out"],
    "grad-threshold": ["grad", "compare", "runa", "runb", "out", "--threshold", "2"],
    "grad-threshold-text": ["grad", "compare", "runa", "runb", "out", "--threshold", "hi"],
    "grad-empty-runs": ["grad", "compare", "runb", "runb", "out"],
    "grad-corrupt-dump": ["grad", "compare", "runa/rank0", "runa/rank0", "out"],
    "grad-no-common-rank": ["grad", "compare", "runa", "runb", "afile"],
    # analyze
    "analyze-no-args": ["analyze"],
    "analyze-missing": ["analyze", "nope"],
    "analyze-no-dumps": ["analyze", "runb"],
    "analyze-not-a-dump": ["analyze", "random.db"],
    "analyze-hang-timeout-zero": ["analyze", "runb", "--hang-timeout", "0"],
    "analyze-max-unverified-above-1": ["analyze", "runb", "--max-unverified", "1.5"],
    "report-max-unverified-not-a-number": ["report", "good.db", "--max-unverified", "most"],
    "analyze-empty-file": ["analyze", "empty.db"],
    "analyze-foreign-db": ["analyze", "foreign.db"],
    "analyze-truncated-db": ["analyze", "trunc.db"],
    "analyze-corrupt-db": ["analyze", "corrupt.db"],
    "analyze-db-without-delivered": ["analyze", "good.db"],
    "analyze-output-is-input": ["analyze", "good.db", "--db", "good.db"],
    "analyze-several-bad-sources": ["analyze", "runb", "nope"],
    # top level
    "unknown-command": ["frobnicate"],
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bad-input")
    _files(d)
    return d


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_one_line_and_status_2(name, files, capsys, monkeypatch):
    monkeypatch.chdir(files)
    rc = main(CASES[name])
    err = capsys.readouterr().err
    lines = err.strip("\n").splitlines()
    assert rc == 2, (rc, err)
    assert len(lines) == 1, err
    assert lines[0].startswith("commcheck"), err
    assert "Traceback" not in err


def test_foreign_database_is_left_untouched(files, monkeypatch):
    monkeypatch.chdir(files)
    main(collect("--db", "foreign.db"))
    with sqlite3.connect(files / "foreign.db") as conn:
        tables = {n for (n,) in conn.execute("SELECT name FROM sqlite_master")}
    assert tables == {"songs"}


EVERY_KIND = Path(__file__).parent / "data" / "report" / "every_kind.db"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_a_full_stdout_is_one_line_and_status_2():
    """The report into a full disk (``/dev/full`` answers every write with ENOSPC)."""
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "commcheck", "report", str(EVERY_KIND),
                            "--json"], stdout=full, stderr=subprocess.PIPE, text=True,
                           timeout=60)
    assert p.returncode == 2
    assert p.stderr.splitlines() == [
        "commcheck: error: cannot write the output (No space left on device)"]


def test_a_trace_into_a_pipe_is_written_into_it_not_over_it(tmp_path):
    """``-o /dev/stdout`` or a named pipe: written in place (renaming a file onto it would
    replace it, and root may)."""
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    p = subprocess.Popen([sys.executable, "-m", "commcheck", "trace", str(EVERY_KIND), "-o",
                          str(fifo)], stderr=subprocess.PIPE, text=True)
    with open(fifo, "rb") as reader:  # opening waits for the writer
        got = reader.read()
    assert p.wait(timeout=60) == 0, p.stderr.read()
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert json.loads(got)["traceEvents"]
