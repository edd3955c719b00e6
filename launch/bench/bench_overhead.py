"""Overhead of commcheck on collectives: patched vs unpatched, measured in the same job.

    torchrun --nproc-per-node 4 launch/bench/bench_overhead.py [--max-mib 4] [--seconds 3] \
        [--repeat 3]
    torchrun --nproc-per-node 4 launch/bench/bench_overhead.py --ddp [--steps 60]

Every rank patches (records go to a temporary dump directory unless COMMCHECK_COLLECTOR is
set). Per op and size, each round runs a block of K calls of the wrapped function back to
back (no barrier between calls, as a training loop issues them), then a block of K calls of
the original it wraps (``__commcheck_original__``), the order alternating by round, with a
barrier only between blocks. Rank 0 prints, per case, the median over rounds of the
per-round ratio wrapped/original block time and its interquartile range, the wall and
training-thread CPU time per call of each (the CPU column separates commcheck's own host
work from the box's noise), and at the end the CPU the rank's helper threads and the node's
relay process spent per 1000 calls. ``--repeat N`` runs the whole measurement N times and
prints the median of the medians. Absolute times on a shared box are noise; the same-run
ratio is the figure to quote.
"""

from __future__ import annotations

import argparse
import atexit
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import commcheck  # noqa: E402  (this checkout's, not whichever one is installed)
from commcheck.wire.ring import ensure_private_dir  # noqa: E402

if "--ddp" in sys.argv:
    os.environ.setdefault("COMMCHECK_DDP", "0")  # only the models the bench watches
if not os.environ.get("COMMCHECK_COLLECTOR"):
    # One dump directory for the job's ranks (children of one torchrun agent), so one relay
    # serves them all and exits when they are done. A directory per rank started a relay
    # per rank that waited its idle timeout (60 s) for the ranks it expected, polling on
    # into the next run's measurement.
    _dump = os.path.join(tempfile.gettempdir(), f"commcheck-bench-{os.getuid()}-{os.getppid()}")
    ensure_private_dir(_dump)  # a predictable name in /tmp: ours, 0700, or refused
    if os.environ.get("LOCAL_RANK", "0") == "0":
        atexit.register(shutil.rmtree, _dump, True)
    os.environ.setdefault("COMMCHECK_DUMP_DIR", _dump)
commcheck.patch()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import commcheck.rank.runtime  # noqa: E402

try:  # a commcheck from before the ring (sender thread) runs the bench too, for comparison
    from commcheck.wire.ring import R_ACKED_OFF, R_PID, W_RECORDS, W_WRITE
except ImportError:
    R_ACKED_OFF = R_PID = W_RECORDS = W_WRITE = -1

sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
from benchstats import Ratio, median_of_medians, ratio  # noqa: E402


def sizes(max_mib: int) -> list[int]:
    """4 KiB, 64 KiB, then 1 MiB and on by fours up to ``max_mib``."""
    out, s = [4 << 10, 64 << 10], 1 << 20
    while s <= max_mib << 20:
        out.append(s)
        s *= 4
    return out


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _plain(fn):
    return getattr(fn, "__commcheck_original__", fn)


def _send_recv(t: torch.Tensor, send=None, recv=None) -> None:
    """Ring exchange: even ranks send first, odd ranks receive first (no deadlock)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    buf = torch.empty_like(t)
    if rank % 2 == 0:
        send(t, right)
        recv(buf, left)
    else:
        recv(buf, left)
        send(t, right)


def _case(op: str, n: int, world: int):
    """(wrapped function, its arguments, tensor to restore before each block or None)."""
    x = torch.randn(n)
    per = max(n // world, 1)
    cases = {
        "all_reduce": lambda: (dist.all_reduce, (x,), x.clone()),
        "all_gather_into_tensor": lambda: (dist.all_gather_single,
                                           (torch.empty(world * n), x), None),
        "all_gather": lambda: (dist.all_gather,
                               ([torch.empty(n) for _ in range(world)], x), None),
        "broadcast": lambda: (dist.broadcast, (x, 0), x.clone()),
        "reduce_scatter_tensor": lambda: (dist.reduce_scatter_single,
                                          (torch.empty(per), torch.randn(per * world)), None),
        "all_to_all_single": lambda: (dist.all_to_all_single,
                                      (torch.empty(per * world), torch.randn(per * world)),
                                      None),
        "reduce": lambda: (dist.reduce, (x, 0), x.clone()),
        "send_recv": lambda: (_SendRecv(), (x,), None),
    }
    return cases[op]()


class _SendRecv:
    """send + recv as one timed call; its original uses the unwrapped functions."""

    def __call__(self, t):
        _send_recv(t, dist.send, dist.recv)

    def __commcheck_original__(self, t):
        _send_recv(t, dist.send.__commcheck_original__, dist.recv.__commcheck_original__)


def _agree(value: float, op) -> float:
    """The same number on every rank (MIN or MAX of the ranks' values), unrecorded."""
    t = torch.tensor([value], dtype=torch.float64)
    _plain(dist.all_reduce)(t, op=op)
    return float(t)


@dataclass
class Blocks:
    """Per round, one block of K calls of one function (rank 0): wall seconds, the training
    thread's CPU seconds, the whole process's CPU seconds (gloo's threads included)."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    proc: list[float] = field(default_factory=list)

    def add(self, sample: tuple[float, float, float]) -> None:
        for acc, v in zip((self.wall, self.cpu, self.proc), sample, strict=True):
            acc.append(v)


@dataclass
class Case:
    """One (op, size) of one repeat: K calls per block, the wrapped and the original blocks."""

    op: str
    nbytes: int
    calls: int
    wrapped: Blocks = field(default_factory=Blocks)
    original: Blocks = field(default_factory=Blocks)
    passes: Blocks = field(default_factory=Blocks)  # --passes: the original + the reads

    def ratio(self) -> Ratio:
        return ratio(self.wrapped.wall, self.original.wall)

    def passes_ratio(self) -> Ratio | None:
        return ratio(self.passes.wall, self.original.wall) if self.passes.wall else None

    def proc_ratio(self) -> Ratio:
        return ratio(self.wrapped.proc, self.original.proc)

    def per_call(self, xs: list[float]) -> float:
        """Median over rounds, per call, microseconds."""
        return statistics.median(xs) / self.calls * 1e6

    def cpu_added(self) -> float:
        """Training-thread CPU commcheck adds per call, microseconds."""
        return self.per_call(self.wrapped.cpu) - self.per_call(self.original.cpu)


def block(fn, args, fresh, calls: int) -> tuple[float, float, float]:
    """K calls back to back after one barrier: (wall, training-thread CPU, process CPU)."""
    if fresh is not None:  # in-place reductions grow by world**K per block: start afresh
        args[0].copy_(fresh)
    _plain(dist.barrier)()
    p, c, t = time.process_time(), time.thread_time(), time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return time.perf_counter() - t, time.thread_time() - c, time.process_time() - p


class _Passes:
    """The original call plus the memory passes commcheck makes over its tensors and nothing
    else (no records, no Python of its own): the input side read before the call (the
    gathers': while it runs), the output side after it, by the same native calls. Its ratio
    to the original is the floor a wrapper with every check on can reach on this box (issue
    13: "beyond which only the memory passes of the fingerprints remain")."""

    def __init__(self, op: str, original):
        from commcheck.rank.fingerprint import fingerprint_cpu
        self.op, self.original, self.fp = op, original, fingerprint_cpu

    def __call__(self, *args):
        fp = self.fp
        if self.op == "all_reduce":  # in place: the input's sums, then the output's
            fp(args[0], False, True)  # hash and sums (reductions' inputs are not hashed)
            self.original(*args)
            fp(args[0], True, True)
            return
        out, inp = args  # the gathers: the input's hash and sums while the call runs (as
        work = self.original(*args, async_op=True)  # commcheck reads a large one), then
        fp(inp, True, True)  # the output's hashes
        work.wait()
        for o in out if isinstance(out, list) else (out,):
            fp(o, True, False)


PASSES_OPS = ("all_reduce", "all_gather_into_tensor", "all_gather")


def bench(op: str, nbytes: int, world: int, budget_s: float, block_s: float,
          max_calls: int, passes: bool = False) -> Case:
    """Rounds of a wrapped block and an original block (which first alternates), K calls
    each, K chosen so a block takes about ``block_s``; as many rounds as fit ``budget_s``.
    ``passes``: a third block per round, :class:`_Passes` (its place in the order rotates)."""
    patched, args, fresh = _case(op, nbytes // 4, world)
    original = patched.__commcheck_original__
    floor = _Passes(op, original) if passes and op in PASSES_OPS else None
    for fn in (patched, original, floor):
        if fn is not None:
            block(fn, args, fresh, 3)
    probe = statistics.median(block(original, args, fresh, 3)[0] / 3 for _ in range(3))
    probe = _agree(probe, dist.ReduceOp.MAX)
    # an in-place sum grows by ``world`` per call: keep world**K far below float32's 3e38
    cap = min(max_calls, int(30 / math.log10(world))) if world > 1 else max_calls
    calls = max(2, min(cap, round(block_s / max(probe, 1e-6))))
    rounds = max(8, min(1000, int(budget_s / (2 * calls * max(probe, 1e-6)))))
    case = Case(op, nbytes, calls)
    if floor is None:
        for i in range(rounds):
            order = ((patched, case.wrapped), (original, case.original))
            for fn, blocks in order if i % 2 else order[::-1]:
                blocks.add(block(fn, args, fresh, calls))
        return case
    three = [(patched, case.wrapped), (original, case.original), (floor, case.passes)]
    for i in range(rounds):
        k = i % 6  # each of the six orders of the three blocks in turn
        order = three[k % 3:] + three[:k % 3]
        for fn, blocks in order if k < 3 else order[::-1]:
            blocks.add(block(fn, args, fresh, calls))
    return case


# --- CPU the rank's helper threads and the node's relay spend (rank 0 prints) ---------------

_TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu(path: str) -> float:
    """utime + stime of one /proc stat file, seconds (0 if it is gone)."""
    try:
        with open(path, "rb") as f:
            rest = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(rest[11]) + int(rest[12])) / _TICK  # fields 14 and 15 of stat


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads other than the main one, by name, summed over
    threads of one name: a Python thread by its own name from its CPU clock (ns), the others
    (gloo's) by the kernel's ``comm`` from /proc (10 ms ticks)."""
    py = {t.native_id: t for t in threading.enumerate()}
    main = threading.main_thread().native_id
    out: dict[str, float] = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        if tid == main:
            continue
        t = py.get(tid)
        if t is not None and t.ident is not None:
            name = t.name
            try:
                cpu = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except OSError:  # it ended meanwhile
                continue
        else:
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
            except OSError:
                continue
            cpu = _proc_cpu(f"/proc/self/task/{tid}/stat")
        out[name] = out.get(name, 0.0) + cpu
    return out


def _ring():
    """This rank's ring (None before the ring existed: no relay, records unknown)."""
    if R_PID < 0:
        return None
    session = commcheck.rank.runtime.active_session()
    writer = getattr(session, "ring", None) or getattr(session, "sender", None)  # older
    return getattr(writer, "ring", None)


def relay_pid() -> int:
    ring = _ring()
    return ring.word(R_PID) if ring is not None else 0


def records_written() -> int:
    ring = _ring()
    return ring.word(W_RECORDS) if ring is not None else 0


def wait_relay_caught_up(timeout: float = 10.0) -> bool:
    """Until the relay acknowledged (dump file: wrote) all this rank's ring holds."""
    ring = _ring()
    deadline = time.monotonic() + timeout
    while ring is not None and ring.word(R_ACKED_OFF) < ring.word(W_WRITE):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@dataclass
class CpuMark:
    """Where the counters stood: helper threads, relay CPU, records this rank wrote."""

    threads: dict[str, float]
    relay: float
    records: int

    @classmethod
    def now(cls, pid: int) -> CpuMark:
        return cls(thread_cpu(), _proc_cpu(f"/proc/{pid}/stat") if pid else 0.0,
                   records_written())


def cpu_report(idle: tuple[float, float], start: CpuMark, pid: int, wrapped_calls: int,
               seconds: float) -> None:
    """Per 1000 wrapped calls: CPU of this rank's non-main threads (the resolver apart); the
    relay's CPU per 1000 records it took from all ranks of the node, as measured and less
    what it spends idle (``idle``: relay CPU seconds over so many seconds of no calls)."""
    caught_up = wait_relay_caught_up()
    end = CpuMark.now(pid)
    mine = end.records - start.records
    total = int(_agree(float(mine), dist.ReduceOp.SUM))
    caught_up = _agree(float(caught_up), dist.ReduceOp.MIN) > 0
    if dist.get_rank() != 0:
        return
    grew = {k: v - start.threads.get(k, 0.0) for k, v in end.threads.items()}
    k = max(wrapped_calls, 1) / 1000
    res = grew.pop("commcheck-resolver", 0.0)
    print(f"\nrank 0: {wrapped_calls} wrapped calls ({mine} records) in {seconds:.0f} s; "
          f"CPU ms per 1000 wrapped calls: commcheck-resolver {res / k * 1e3:.3f} (it wakes "
          f"on its own clock: {res / seconds * 1e3:.3f} ms per second); other "
          "non-main threads (gloo's, original calls too) " + ", ".join(
              f"{n} {v / k * 1e3:.0f}" for n, v in sorted(grew.items(), key=lambda x: -x[1])
              if v > 0), flush=True)
    relay = end.relay - start.relay
    idle_rate = idle[0] / idle[1] if idle[1] > 0 else 0.0
    net = max(relay - idle_rate * seconds, 0.0)
    print(f"relay (pid {pid or '?'}): {relay:.2f} CPU s for {total} records of "
          f"{dist.get_world_size()} ranks in {seconds:.0f} s = {relay / max(total, 1) * 1e6:.1f} "
          f"ms per 1000 records ({relay / seconds * 100:.1f} % of a core); idle it spends "
          f"{idle_rate * 100:.2f} % of a core ({idle[0]:.2f} s in {idle[1]:.0f} s), so "
          f"{net / max(total, 1) * 1e6:.1f} ms per 1000 records net"
          + ("" if caught_up else "; not caught up after 10 s: an underestimate"), flush=True)


def collectives(args) -> None:
    """The back-to-back measurement, ``--repeat`` times, then the median of the medians."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ops = args.ops.split(",")
    deadline = time.monotonic() + 5
    while not relay_pid() and time.monotonic() < deadline:  # the relay finds rings in 0.2 s
        time.sleep(0.05)
    pid = relay_pid()
    idle0, t_idle = CpuMark.now(pid).relay, time.perf_counter()
    time.sleep(args.idle)  # the relay's CPU while no rank calls anything
    _plain(dist.barrier)()
    idle = (CpuMark.now(pid).relay - idle0, time.perf_counter() - t_idle)
    start, t0 = CpuMark.now(pid), time.perf_counter()
    wrapped_calls = 0
    runs: dict[tuple[str, int], list[Case]] = {}
    if rank == 0:
        print(f"world {world}, gloo, CPU, {torch.get_num_threads()} torch thread(s); per "
              "round a block of K wrapped and a block of K original calls back to back (order "
              "alternating); ratio = wrapped/original block wall time, median of the rounds "
              "and interquartile range; proc = the same for the process's CPU time; us per "
              "call (medians): wall and training-thread CPU, original (o) and wrapped (w), "
              f"cpu + = what commcheck adds; load {os.getloadavg()[0]:.1f}", flush=True)
    for rep in range(args.repeat):
        if rank == 0:
            print(f"{'op':<24}{'size':>7}{'ratio':>7}{'IQR':>11}{'proc':>6}{'rounds':>7}"
                  f"{'K':>4}{'wall o':>8}{'wall w':>8}{'cpu o':>7}{'cpu w':>7}{'cpu +':>7}")
        for op in ops:
            for nbytes in sizes(args.max_mib):
                case = bench(op, nbytes, world, args.seconds, args.block_ms / 1e3,
                             args.max_calls, args.passes)
                wrapped_calls += case.calls * (len(case.wrapped.wall) + 3)
                runs.setdefault((op, nbytes), []).append(case)
                if rank == 0:
                    r, w, o = case.ratio(), case.wrapped, case.original
                    print(f"{op:<24}{_size(nbytes):>7}{r.median:>7.3f}"
                          f"{f'{r.q1:.2f}-{r.q3:.2f}':>11}{case.proc_ratio().median:>6.2f}"
                          f"{r.rounds:>7}{case.calls:>4}{case.per_call(o.wall):>8.0f}"
                          f"{case.per_call(w.wall):>8.0f}{case.per_call(o.cpu):>7.0f}"
                          f"{case.per_call(w.cpu):>7.0f}{case.cpu_added():>7.0f}"
                          + _passes_cell(case, " passes {:.3f}"), flush=True)
        if rank == 0:
            print(f"repeat {rep + 1}/{args.repeat} done, load {os.getloadavg()[0]:.1f}",
                  flush=True)
    cpu_report(idle, start, pid, wrapped_calls, time.perf_counter() - t0)
    if rank == 0:
        print(f"\nmedian of {args.repeat} repeat(s), load {os.getloadavg()[0]:.1f}:\n"
              "| op | size | ratio | repeats' medians | per-round IQR | proc CPU ratio | rounds "
              "| CPU µs/call added | passes only |\n|---|---|---|---|---|---|---|---|---|")
        for (op, nbytes), cases in runs.items():
            rs = [c.ratio() for c in cases]
            iqr = statistics.median(r.iqr for r in rs)
            proc = median_of_medians([c.proc_ratio() for c in cases]).median
            added = statistics.median(c.cpu_added() for c in cases)
            print(f"| {op} | {_size(nbytes)} | {median_of_medians(rs).median:.3f} | "
                  f"{', '.join(f'{r.median:.2f}' for r in rs)} | {iqr:.2f} | {proc:.2f} | "
                  f"{sum(r.rounds for r in rs)} | {added:.0f} | "
                  f"{_passes_median(cases)} |", flush=True)


def _passes_cell(case: Case, fmt: str) -> str:
    r = case.passes_ratio()
    return "" if r is None else fmt.format(r.median)


def _passes_median(cases: list[Case]) -> str:
    rs = [r for r in (c.passes_ratio() for c in cases) if r is not None]
    return f"{median_of_medians(rs).median:.3f}" if rs else "—"


def ddp_steps(steps: int) -> None:
    """A nanoGPT-sized DDP step (6 x 256x256 linear layers, 4 buckets of ~100 K floats),
    the same model five ways, rotating step by step so all see the same load: plain DDP
    (its C++ reducer, no hook: the step without commcheck), torch's built-in C++ ALLREDUCE
    hook (what any comm hook costs), torch's Python ``allreduce_hook`` (what a Python hook
    costs), watched by commcheck (its C++ hook where it builds) and watched with
    ``COMMCHECK_DDP_NATIVE=0`` (its Python hook). Prints the median step of each and the
    ratios to plain DDP."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    def model() -> DDP:
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[m for _ in range(6) for m in
                                    (torch.nn.Linear(256, 256), torch.nn.GELU())])
        return DDP(net, bucket_cap_mb=0.4)

    plain, builtin, hooked, watched = model(), model(), model(), model()
    builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    DDP.register_comm_hook.__commcheck_original__(hooked, hooked.process_group,
                                                  default_hooks.allreduce_hook)
    assert commcheck.watch(watched)
    os.environ["COMMCHECK_DDP_NATIVE"] = "0"
    python = model()
    assert commcheck.watch(python)
    del os.environ["COMMCHECK_DDP_NATIVE"]
    native = watched._commcheck_slot.native is not None
    names = ("plain", "builtin", "python-hook", "commcheck" if native else "commcheck(no C++)",
             "commcheck-python")
    runs = [(m, torch.optim.SGD(m.parameters(), lr=1e-3), [])
            for m in (plain, builtin, hooked, watched, python)]
    x = torch.randn(64, 256)
    for i in range(steps + 5):
        order = runs[i % len(runs):] + runs[:i % len(runs)]
        for m, opt, acc in order:
            dist.barrier()
            t = time.perf_counter()
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
            if i >= 5:
                acc.append(time.perf_counter() - t)
    if dist.get_rank() == 0:
        med = [statistics.median(r[2]) for r in runs]
        print(f"DDP step, {dist.get_world_size()} ranks, {steps} steps each, median ms "
              f"(ratio to plain): " + ", ".join(f"{n} {t * 1e3:.2f} ({t / med[0]:.3f})"
                                                for n, t in zip(names, med, strict=True)),
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-mib", type=int, default=4, help="sizes 4, 64 KiB, 1 MiB x4.. to this")
    ap.add_argument("--seconds", type=float, default=3.0, help="time budget per size and op")
    ap.add_argument("--ops", default="all_reduce,all_gather_into_tensor,all_gather",
                    help="comma list of: all_reduce, all_gather_into_tensor, all_gather (list "
                         "form), broadcast, reduce_scatter_tensor, all_to_all_single, reduce, "
                         "send_recv")
    ap.add_argument("--repeat", type=int, default=1, help="whole measurement N times")
    ap.add_argument("--block-ms", type=float, default=20.0,
                    help="K calls per block, K chosen so a block takes about this long")
    ap.add_argument("--max-calls", type=int, default=32, help="at most K calls per block")
    ap.add_argument("--idle", type=float, default=3.0,
                    help="seconds of no calls first, to measure the relay's idle CPU")
    ap.add_argument("--passes", action="store_true",
                    help="a third block per round: the original call plus only the memory "
                         "passes commcheck makes (all_reduce and the all_gathers)")
    ap.add_argument("--ddp", action="store_true", help="time a DDP training step instead")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    if args.ddp:
        ddp_steps(args.steps)
        dist.destroy_process_group()
        return
    collectives(args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
