"""Files on a shared node (issue 26 items 3 and 4), between two real unprivileged users:
the intruder plants files and folders where the job will look (a sticky, world-writable
folder like ``/dev/shm``), the job's user runs the ranks' ring writers with real relays,
``commcheck analyze`` and one ``commcheck run`` of a 2-rank gloo job.

Every attack must fail the same way: recording goes on (in a fresh private place when the
usual name is taken), a foreign file is never read nor written, and the refusal is one line
that names the file. The job user's side of the ring cases is one process
(tests/workers/shared_node.py) that runs them all after the intruder planted its files.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from commcheck.wire import (
    DUMP_MAGIC,
    GOODBYE,
    REC_DTYPE,
    BatchBuilder,
    decode,
    encode,
    read_frames,
)
from commcheck.wire import write_frame as frame
from commcheck.wire.ring import destination, lock_name, log_name, ring_name, ring_prefix

from ..harness import WORKERS
from ..records import rec
from ..users import two_users
from .test_delivery import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

TAG = uuid.uuid4().hex[:8]  # run ids of this session: nothing left by an earlier one counts


@pytest.fixture(scope="module")
def users():
    return two_users()


@pytest.fixture(scope="module")
def shared():
    """A folder like /dev/shm (root's, 1777) for this module; removed with all in it."""
    d = Path(tempfile.mkdtemp(prefix="cc-shared-", dir="/dev/shm" if os.path.isdir(
        "/dev/shm") else None))
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def planted(intruder, path: Path, data: bytes = b"", mode: int = 0o644) -> Path:
    """A file the intruder made (root writes it, then gives it away)."""
    path.write_bytes(data)
    return intruder.chown(path, mode)


def planted_dir(intruder, path: Path, mode: int = 0o777) -> Path:
    path.mkdir()
    return intruder.chown(path, mode)


def forged(run: str, world: int = 3, culprit: int = 2) -> dict[int, bytes]:
    """Per rank, a dump file's bytes (one record, a goodbye) whose record blames
    ``culprit`` for a value mismatch."""
    out = {}
    for rank in range(world):
        r = rec(seq=0, ranks=tuple(range(world)), out=(9, 9) if rank == culprit else (1, 1))
        b = BatchBuilder(run, rank, "node0", world)
        buf = io.BytesIO()
        buf.write(DUMP_MAGIC)
        frame(buf, encode(b.build([r], seq=0, t=1.0)))
        frame(buf, encode(b.control(GOODBYE, 1, 2.0, counters={"records": 1})))
        out[rank] = buf.getvalue()
    return out


def dumped_records(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(len(decode(p).env.records) // REC_DTYPE.itemsize for p in read_frames(f))


def prefix(uid: int, run: str, dump_dir: Path) -> str:
    return ring_prefix(uid, run, destination("", str(dump_dir)), 0)


@pytest.fixture(scope="module")
def ring_cases(users, shared):
    """Plant, then run every ring case as the job user in one process: its results, its
    stderr and what was planted."""
    job, intruder = users
    runs = {name: f"{name}-{TAG}" for name in ("tmp", "lock", "log", "names", "dir", "relay",
                                               "dump", "spill")}
    own_dumps = job.home / f"dumps-{TAG}"
    foreign_dir = planted_dir(intruder, shared / f"foreign-{TAG}")
    dump_base = shared / f"dumps-{TAG}"  # a shared dump folder (1777, like /tmp)
    dump_base.mkdir()
    os.chmod(dump_base, 0o1777)
    spill_base = shared / f"spills-{TAG}"
    spill_base.mkdir()
    os.chmod(spill_base, 0o1777)
    plan = {
        "tmp": dict(kind="ring", run=runs["tmp"], ring_dir=str(shared),
                    dump_dir=str(own_dumps)),
        "lock": dict(kind="ring", run=runs["lock"], ring_dir=str(shared),
                     dump_dir=str(own_dumps)),
        "log": dict(kind="ring", run=runs["log"], ring_dir=str(shared),
                    dump_dir=str(own_dumps)),
        "names": dict(kind="ring", run=runs["names"], ring_dir=str(shared),
                      dump_dir=str(own_dumps)),
        "dir": dict(kind="ring", run=runs["dir"], ring_dir=str(foreign_dir),
                    dump_dir=str(own_dumps)),
        "relay": dict(kind="relay", run=runs["relay"], ring_dir=str(foreign_dir),
                      dump_dir=str(own_dumps), ready=str(job.home / f"ready-{TAG}")),
        "dump": dict(kind="ring", run=runs["dump"], ring_dir=str(shared),
                     dump_dir=str(dump_base)),
    }
    env = job.env(COMMCHECK_NATIVE_HOT="0", PYTHONWARNINGS="ignore")
    p = job.popen([sys.executable, str(WORKERS / "shared_node.py")], env=env,
                  stdin=subprocess.PIPE)
    pid = int(p.stdout.readline())  # what the intruder sees in ps
    seen = {}
    for name in ("tmp", "names"):
        pre = prefix(job.uid, runs[name], own_dumps)
        for gen in range(80):
            ring = ring_name(pre, 0, pid, gen)
            path = shared / (f".{ring}.{pid}.tmp" if name == "tmp" else ring)
            if name == "names" or gen < 8:
                planted(intruder, path)
                seen.setdefault(name, []).append(path)
    seen["lock"] = [planted(intruder, shared / lock_name(prefix(job.uid, runs["lock"],
                                                                  own_dumps)))]
    seen["log"] = [planted(intruder, shared / log_name(prefix(job.uid, runs["log"],
                                                                own_dumps)))]
    run_folder = planted_dir(intruder, dump_base / runs["dump"])
    bait = forged(runs["dump"], world=1, culprit=-1)[0]
    seen["dump"] = [planted(intruder, run_folder / "rank00000.ccw", bait, 0o666)]
    spill_folder = planted_dir(intruder, spill_base / runs["spill"])
    seen["spill"] = [planted(intruder, spill_folder / f"rank00000.{pid}.spill", bait, 0o666)]
    plan["spill"] = dict(kind="spill", spill_dir=str(spill_base), run=runs["spill"],
                         planted=str(seen["spill"][0]))
    out, err = p.communicate(json.dumps(plan) + "\n", timeout=180)
    assert p.returncode == 0, err[-3000:]
    results = json.loads(out.strip().splitlines()[-1])
    seen["bait"] = bait
    yield results, err, seen, runs, own_dumps
    for r in results.values():
        if isinstance(r, dict) and r.get("ring_dir", "").startswith("/dev/shm/commcheck-"):
            shutil.rmtree(r["ring_dir"], ignore_errors=True)
    shutil.rmtree(own_dumps, ignore_errors=True)


def _lines(text: str, needle: object) -> list[str]:
    return [line for line in text.splitlines() if str(needle) in line]


def _untouched(path: Path, owner, data: bytes = b"") -> bool:
    st = path.lstat()
    return st.st_uid == owner.uid and path.read_bytes() == data


def _not_ours(path: Path, users) -> str:
    job, intruder = users
    return f"{path}: owned by uid {intruder.uid}, not ours ({job.uid})"


def test_a_planted_temporary_name_does_not_stop_ring_creation(users, ring_cases, shared):
    """Before: ``.<ring>.<pid>.tmp`` planted made ring creation fail (EPERM): nothing
    recorded. Now the temporary name is random; the planted files are left alone."""
    results, err, seen, runs, own = ring_cases
    r = results["tmp"]
    assert "error" not in r, r
    assert r["acked"] and r["ring_dir"] == str(shared) and r["refused"] == []
    assert dumped_records(own / runs["tmp"] / "rank00000.ccw") == 5
    assert all(_untouched(p, users[1]) for p in seen["tmp"])


@pytest.mark.parametrize("case", ["lock", "log"])
def test_a_planted_lock_or_log_moves_the_ring_to_a_private_folder(users, ring_cases, shared,
                                                                  case):
    """Before: another user's ``<prefix>.lock`` (or ``.relay.log``) meant no relay at all.
    Now the rank records into a fresh 0700 folder beside it, with a relay of its own; one
    line names the file, and the goodbye carries it to the report."""
    results, err, seen, runs, own = ring_cases
    r, bad = results[case], seen[case][0]
    assert r["acked"], r
    assert Path(r["ring_dir"]).parent == shared and r["ring_dir"] != str(shared)
    assert r["mode"] == 0o700
    assert r["refused"] == [f"refused_file:{_not_ours(bad, users)}"]
    said = _lines(err, bad)
    assert len(said) == 1 and f"recording into {r['ring_dir']}" in said[0], err
    assert dumped_records(own / runs[case] / "rank00000.ccw") == 5
    assert _untouched(bad, users[1])


def test_planted_ring_names_are_passed_by_under_a_random_one(users, ring_cases, shared):
    """Files at the ring's own names (80 generations of its pid): the ring takes a random
    generation in the same folder, and the node's relay serves it there."""
    results, err, seen, runs, own = ring_cases
    r = results["names"]
    assert r["acked"] and r["ring_dir"] == str(shared), r
    assert r["ring_name"] not in {p.name for p in seen["names"]}
    assert len(r["refused"]) == 1
    assert r["refused"][0] in {f"refused_file:{_not_ours(p, users)}" for p in seen["names"]}
    said = _lines(err, f"the ring is {shared / r['ring_name']} instead")
    assert len(said) == 1 and r["refused"][0].removeprefix("refused_file:") in said[0], err
    assert dumped_records(own / runs["names"] / "rank00000.ccw") == 5
    assert all(_untouched(p, users[1]) for p in seen["names"])


def test_a_foreign_ring_folder_is_refused_by_rank_and_relay_alike(users, ring_cases, shared):
    """``COMMCHECK_RING_DIR`` another user owns and anyone may write: the rank records in
    a private folder of its own; the relay pointed there refuses it in one line (before: it
    put its lock and log there) and leaves nothing in it."""
    job, intruder = users
    results, err, seen, runs, own = ring_cases
    foreign = shared / f"foreign-{TAG}"
    r = results["dir"]
    assert r["acked"] and r["mode"] == 0o700, r
    assert not r["ring_dir"].startswith(str(foreign))
    assert r["refused"] == [f"refused_file:{foreign}: owned by uid {intruder.uid}, not ours "
                            f"({job.uid})"]
    assert dumped_records(own / runs["dir"] / "rank00000.ccw") == 5
    relay = results["relay"]
    said = relay["stderr"].strip().splitlines()
    assert relay["rc"] == 2 and len(said) == 1, relay
    assert said[0].startswith(f"commcheck relay: error: {foreign}: owned by uid") and \
        "not serving" in said[0]
    assert [p for p in foreign.iterdir() if p.lstat().st_uid == job.uid] == []


def test_a_planted_dump_folder_is_never_written_into(users, ring_cases, shared):
    """Before: a pre-made ``DUMP_DIR/<run>/`` (0777, the intruder's file in it) was written
    into and read back. Now it is left alone and a fresh private folder beside it holds the
    dump files; the relay's log says so in one line."""
    job, intruder = users
    results, err, seen, runs, own = ring_cases
    r, bait = results["dump"], seen["dump"][0]
    assert r["acked"], r
    assert _untouched(bait, intruder, seen["bait"])
    assert sorted(p.name for p in bait.parent.iterdir()) == [bait.name]
    fresh = [p for p in bait.parent.parent.iterdir() if p.name.startswith(f"{runs['dump']}-")]
    assert len(fresh) == 1
    st = fresh[0].stat()
    assert st.st_uid == job.uid and stat.S_IMODE(st.st_mode) == 0o700
    assert dumped_records(fresh[0] / "rank00000.ccw") == 5
    log = shared / log_name(prefix(job.uid, runs["dump"], bait.parent.parent))
    wait_for(lambda: log.exists() and _lines(log.read_text(), fresh[0]), 20, "the log line")
    said = _lines(log.read_text(), bait.parent)
    assert len(said) == 1 and f"go to {fresh[0]}" in said[0]


def test_planted_spill_files_are_neither_read_nor_written(users, ring_cases):
    """Spill files: a run folder someone else made is passed over for a private one; a
    spill file that is not ours is neither re-sent (its forged frames) nor appended to."""
    job, intruder = users
    results, err, seen, runs, own = ring_cases
    r, bait = results["spill"], seen["spill"][0]
    assert Path(r["folder"]).parent == bait.parent.parent and r["mode"] == 0o700
    assert r["folder"] != str(bait.parent)
    assert r["loaded"] == 0 and r["put"] is False
    assert _untouched(bait, intruder, seen["bait"])
    assert len(_lines(err, bait)) == 2  # cannot reopen it; cannot spill to it


def test_analyze_reads_only_the_users_files_in_a_directory(users, shared, capsys):
    """Before: ``commcheck analyze /dev/shm`` read another user's rings and dump files and
    reported their forged value mismatch as the job's. Now each is skipped with one line
    that names it, counted (``not_ours``), and only the user's own files are read."""
    from commcheck.cli import main
    from commcheck.rank.ring import RingWriter
    from commcheck.wire.ring import MIN_CAPACITY, Identity

    job, intruder = users
    folder = shared / f"analyze-{TAG}"
    folder.mkdir()
    os.chmod(folder, 0o1777)
    run = f"forged-{TAG}"
    bad = forged(run)
    skipped = [planted(intruder, folder / f"rank{r:05d}.ccw", bad[r]) for r in (0, 1)]
    ident = Identity(run=run, rank=2, host="node0", world=3, node=0, pid=os.getpid(),
                     dest="forged")
    w = RingWriter.create(str(folder), ident, MIN_CAPACITY)
    w.start()
    w.write_record(rec(seq=0, ranks=(0, 1, 2), out=(9, 9)))
    w.close(linger=0)  # never acknowledged: left behind, as a dead rank's
    skipped.append(planted(intruder, Path(w.path), Path(w.path).read_bytes()))
    theirs = planted_dir(intruder, folder / "theirs", 0o755)
    skipped.append(theirs)
    mine = folder / "mine"
    mine.mkdir()
    job.chown(mine, 0o700)
    job.chown(planted(intruder, mine / "rank00000.ccw", forged(f"own-{TAG}", 1, -1)[0]), 0o600)
    # what analyze did before: the intruder's files, read, blame rank 2
    main(["analyze", *map(str, skipped[:3]), "--json"])
    before = json.loads(capsys.readouterr().out)["findings"]
    assert [(f["kind"], f["culprits"]) for f in before] == [("value_mismatch", [2])]
    r = job.run([sys.executable, "-m", "commcheck", "analyze", str(folder), "--json"],
                env=job.env(PYTHONWARNINGS="ignore"))
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["findings"] == [] and doc["summary"]["records"] == 1
    assert doc["summary"]["rejected"] == {"not_ours": len(skipped)}
    said = [line for line in r.stderr.splitlines() if line.startswith("commcheck analyze: ")]
    assert len(said) == len(skipped), r.stderr
    for path in skipped:
        assert len(_lines(r.stderr, f"skipped {path}")) == 1, r.stderr


def test_commcheck_run_records_past_a_planted_lock_and_log_and_the_report_names_them(
        users, shared):
    """The whole path: another user made the lock and the log of this run's relay (its run
    id and collector port are in ``ps``). Before: no relay, nothing recorded, "never reported
    (did it start? was commcheck.patch() called?)". Now the launcher's relay refuses in one
    line, each rank says where it records instead, every collective is verified, and the
    report names the planted file."""
    from ..harness import free_port

    job, intruder = users
    run, port = f"job-{TAG}", free_port()
    pre = ring_prefix(job.uid, run, f"tcp://127.0.0.1:{port}", 0)
    lock = planted(intruder, shared / lock_name(pre))
    log = planted(intruder, shared / log_name(pre))
    work = job.home / f"job-{TAG}"
    work.mkdir()
    job.chown(work, 0o700)
    env = job.env(COMMCHECK_RING_DIR=str(shared), COMMCHECK_RUN_ID=run,
                  PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    try:
        r = job.run([sys.executable, "-m", "commcheck", "run", "--db", str(work / "run.db"),
                     "--collector-port", str(port), "--stop-timeout", "20",
                     "--nproc-per-node", "2", str(WORKERS / "launched.py")],
                    env=env, cwd=work, timeout=180)
        assert r.returncode == 0, r.stderr[-3000:]
        doc = json.loads(job.run([sys.executable, "-m", "commcheck", "report", "--json",
                                  str(work / "run.db")], env=env).stdout)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = doc["summary"]
    assert summary["ranks_said_goodbye"] == 2 and summary["verified"] == 30
    assert summary["refused_files"] == {_not_ours(lock, users): [0, 1]}
    relay = _lines(r.stderr, "commcheck relay: error:")
    assert len(relay) == 1 and str(lock) in relay[0] and "not serving" in relay[0]
    ranks = _lines(r.stderr, "recording into")
    assert sorted(line.split(":")[1].strip() for line in ranks) == ["rank 0", "rank 1"]
    assert all(str(lock) in line for line in ranks)
    assert _lines(r.stdout, "refused a file") and _lines(r.stdout, lock)
    assert _untouched(lock, intruder) and _untouched(log, intruder)
    for line in ranks:  # the private folders: empty once everything was delivered
        folder = Path(line.split("recording into ")[1].split()[0])
        assert folder.parent == shared and not any(folder.iterdir())
