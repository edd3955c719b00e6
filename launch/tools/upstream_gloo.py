"""Run a subset of PyTorch's own gloo tests with and without ``commcheck.patch()``.

Issue 16 item 6: commcheck must never change what torch does. The tests are the
``DistributedTest`` spawn suite that ships in the torch wheel
(``torch/testing/_internal/distributed/distributed_test.py``), driven as upstream's
``test/distributed/test_distributed_spawn.py`` does, at world size 3 with ``BACKEND=gloo``.
Patched, every spawned rank runs ``commcheck.patch()`` from a ``sitecustomize.py`` (as
``commcheck run`` does) and dumps its records to a directory per test, which is then
analysed: a finding there is a finding on a clean run (the tests are correct programs).

    python launch/tools/upstream_gloo.py [--group collectives|p2p|ddp ...] [-k SUBSTR ...]
                                    [--timeout 280] [--json out.json] [--keep]

Prints one row per test: outcome unpatched, outcome patched (and findings), and whether the
two agree (same outcome, and the same exception type and message where one was raised).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHILD = "UPSTREAM_GLOO_CHILD"  # set: this process runs the tests (or is one of their ranks)
PATCH = "UPSTREAM_GLOO_PATCH"  # "1" in the ranks' environment: sitecustomize patches them
DUMPS = "UPSTREAM_GLOO_DUMPS"  # patched runs: one dump directory per test under this one

GROUPS = {  # each about 4 minutes a side on 2 loaded cores (a test spawns 3 fresh ranks)
    "collectives": [
        "test_all_reduce_sum_async", "test_all_reduce_sum_complex",
        "test_all_reduce_complex_unsupported_ops", "test_all_reduce_coalesced_sum",
        "test_sparse_all_reduce_sum", "test_broadcast", "test_reduce_sum",
        "test_all_gather", "test_all_gather_coalesced_with_empty", "test_gather_checks",
        "test_scatter_checks", "test_all_to_all_single_unequal_split", "test_barrier",
    ],
    "p2p": [
        "test_send_recv", "test_send_recv_any_source", "test_send_recv_with_tag",
        "test_isend", "test_irecv", "test_batch_isend_irecv_gloo",
        "test_batch_isend_irecv_op_err", "test_batch_isend_irecv_op_list_err",
        "test_coalescing_manager", "test_all_gather_object_default_pg",
        "test_scatter_object_list", "test_all_to_all", "test_monitored_barrier_gloo",
    ],
    "groups": [  # the default group passed explicitly, and error paths (the "_group"
        # tests and the object ones skip at world size 3, as upstream's CPU runs do)
        "test_all_reduce_full_group_sum", "test_reduce_full_group_max",
        "test_all_gather_full_group", "test_scatter_full_group", "test_gather_full_group",
        "test_broadcast_full_group", "test_barrier_full_group",
        "test_all_gather_coalesced_simple", "test_all_reduce_coalesced_max_complex_unsupported",
        "test_destroy_group", "test_batch_isend_irecv_gloo_tags",
    ],
    "ddp": [  # those that run on CPU (most of upstream's DDP tests need 2+ GPUs)
        "test_DistributedDataParallelCPU", "test_DistributedDataParallelCPU_grad_is_view",
        "test_DistributedDataParallel_requires_grad", "test_ddp_create_graph",
        "test_ddp_logging_data_cpu", "test_static_graph_api_cpu",
        "test_accumulate_gradients_no_sync_allreduce_hook",
        "test_accumulate_gradients_no_sync_allreduce_with_then_hook", "test_get_future",
    ],
}
SELECTION = [n for names in GROUPS.values() for n in names]
EXPECTED = {  # findings a test earns on purpose: its ranks really disagree
    "test_monitored_barrier_gloo": "missing_rank",  # rank 1 skips the last barrier
}

SITECUSTOMIZE = """\
import os
from commcheck.rank.boot import _chain
_chain(os.path.dirname(os.path.abspath(__file__)))
if os.environ.get({patch!r}) == "1":
    import commcheck
    commcheck.patch()
"""


def _suite_class():
    """The upstream suite, as test_distributed_spawn.py builds it (needs BACKEND etc.)."""
    from torch.testing._internal.distributed.distributed_test import (
        DistributedTest,
        TestDistBackend,
    )

    class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self):
            dumps = os.environ.get(DUMPS)
            if dumps:  # ranks inherit the environment at spawn
                os.environ["COMMCHECK_DUMP_DIR"] = os.path.join(dumps, self._testMethodName)
                os.environ["COMMCHECK_RUN_ID"] = self._testMethodName
                os.environ[PATCH] = "1"
            super().setUp()
            self._spawn_processes()

    TestDistBackendWithSpawn.__qualname__ = "TestDistBackendWithSpawn"  # picklable for spawn
    return TestDistBackendWithSpawn


if os.environ.get(CHILD):  # also in each spawned rank, which imports this as __mp_main__
    TestDistBackendWithSpawn = _suite_class()

_EXC = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit)):? ?(.*)$")


def _exception(text: str) -> str:
    """The last exception line of a rank's traceback: 'Type: message' (ranks' tracebacks
    in the parent's RuntimeError are separated by 'Process N exited ...')."""
    found = []
    for part in re.split(r"Process \d+ exited with error code \d+ and exception:", text):
        lines = [ln.strip() for ln in part.splitlines() if _EXC.match(ln.strip())]
        if lines:
            found.append(lines[-1][:200])
    return " | ".join(sorted(set(found))) or text.strip().splitlines()[-1][:200]


class _Result(unittest.TextTestResult):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.outcomes: dict[str, dict] = {}

    out = ""  # written after every test: a side that times out keeps what it finished

    def _put(self, test, outcome, detail=""):
        self.outcomes[test._testMethodName] = {"outcome": outcome, "detail": detail}
        Path(self.out).write_text(json.dumps(self.outcomes, indent=1))

    def addSuccess(self, test):
        super().addSuccess(test)
        self._put(test, "pass")

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._put(test, "skip", reason)

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._put(test, "fail", _exception(str(err[1])))

    def addError(self, test, err):
        super().addError(test, err)
        self._put(test, "fail", _exception(str(err[1])))


def _child(names: list[str], out: str) -> None:
    cls = TestDistBackendWithSpawn
    _Result.out = out
    suite = unittest.TestSuite(cls(n) for n in names)
    runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=2, resultclass=_Result)
    runner.run(suite)


def _run_side(names: list[str], patched: bool, work: Path, timeout: float) -> dict:
    side = "patched" if patched else "plain"
    env = dict(os.environ, BACKEND="gloo", WORLD_SIZE="3", TEMP_DIR=str(work / side / "tmp"),
               **{CHILD: "1"})
    (work / side / "tmp").mkdir(parents=True)
    env.pop(PATCH, None)
    env.pop("COMMCHECK_DUMP_DIR", None)
    paths = [str(ROOT)]
    if patched:
        boot = work / "boot"
        boot.mkdir(exist_ok=True)
        (boot / "sitecustomize.py").write_text(SITECUSTOMIZE.format(patch=PATCH))
        paths.insert(0, str(boot))
        env[DUMPS] = str(work / side / "dumps")
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    out = work / side / "outcomes.json"
    log = work / side / "log.txt"
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, __file__, "--child", str(out), *names],
                                env=env, stdout=f, stderr=subprocess.STDOUT, cwd=work,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the spawned ranks too
            proc.wait()
            print(f"{side}: timed out after {timeout:.0f}s (log: {log})", file=sys.stderr)
    took = time.monotonic() - start
    outcomes = json.loads(out.read_text()) if out.exists() else {}
    for n in names:
        outcomes.setdefault(n, {"outcome": "timeout", "detail": ""})
    if patched:
        for n in names:
            outcomes[n]["findings"] = _findings(work / side / "dumps" / n)
    print(f"{side}: {took:.0f}s (log: {log})", file=sys.stderr)
    return outcomes


def _findings(dump: Path) -> str:
    """What `commcheck analyze` says about one test's records: '' when clean."""
    if not dump.is_dir() or not any(dump.rglob("*.ccw")):
        return "no records"
    r = subprocess.run([sys.executable, "-m", "commcheck", "analyze", "--json", str(dump)],
                       capture_output=True, text=True, cwd=ROOT)
    try:
        data = json.loads(r.stdout)
    except ValueError:
        return f"analyze exit {r.returncode}: {r.stderr.strip()[-200:]}"
    said = []
    kinds = sorted({f.get("kind", "?") for f in data.get("findings", [])})
    summary = data.get("summary", {})
    if summary.get("ranks_said_goodbye", 0) < summary.get("ranks", 0):
        said.append(f"{summary['ranks'] - summary['ranks_said_goodbye']} ranks without goodbye")
    if summary.get("rejected"):
        said.append(f"rejected {summary['rejected']}")
    return ", ".join(kinds + said)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        _child(sys.argv[3:], sys.argv[2])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--group", action="append", choices=sorted(GROUPS), default=[],
                    help="only these groups of tests (default: all, ~12 minutes a side)")
    ap.add_argument("-k", action="append", default=[], help="only tests containing this")
    ap.add_argument("--timeout", type=float, default=280.0, help="seconds per side")
    ap.add_argument("--json", default="", help="also write the table here")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    chosen = [n for g in args.group for n in GROUPS[g]] if args.group else SELECTION
    names = [n for n in chosen if not args.k or any(k in n for k in args.k)]
    work = Path(tempfile.mkdtemp(prefix="upstream-gloo-"))
    plain = _run_side(names, False, work, args.timeout)
    patched = _run_side(names, True, work, args.timeout)
    rows, disagree = [], []
    for n in names:
        a, b = plain[n], patched[n]
        clean = b["findings"] in ("", "no records", EXPECTED.get(n)) or b["outcome"] == "skip"
        same = a["outcome"] == b["outcome"] != "timeout" and a["detail"] == b["detail"] and clean
        rows.append({"test": n, "plain": a, "patched": b, "agree": same})
        if not same:
            disagree.append(n)
    w = max(len(n) for n in names)
    print(f"{'test':<{w}}  {'plain':<7} {'patched':<7} agree  findings (patched)")
    for r in rows:
        expected = " (expected)" if r["patched"]["findings"] == EXPECTED.get(r["test"]) else ""
        print(f"{r['test']:<{w}}  {r['plain']['outcome']:<7} {r['patched']['outcome']:<7} "
              f"{'yes' if r['agree'] else 'NO ':<5}  {r['patched']['findings']}{expected}")
    for r in rows:
        if not r["agree"] and r["plain"]["detail"] != r["patched"]["detail"]:
            print(f"\n{r['test']}:\n  plain:   {r['plain']['detail']}\n"
                  f"  patched: {r['patched']['detail']}")
    print(f"\n{len(names)} tests, {len(names) - len(disagree)} agree, "
          f"{len(disagree)} disagree: {', '.join(disagree) or '-'}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"work directory: {work}", file=sys.stderr)
    return 1 if disagree else 0


if __name__ == "__main__":
    sys.exit(main())
