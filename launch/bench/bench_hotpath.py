"""Host time commcheck adds per wrapped call, by stage, on a gloo world of one rank.

    python launch/bench/bench_hotpath.py [--calls 2000] [--rounds 9] [--sizes 4096,65536]
    torchrun --nproc-per-node 2 launch/bench/bench_hotpath.py --p2p   # send/recv

One process, one rank, so the collective itself is nearly free: the wrapped function and the
original it wraps (``__commcheck_original__``, timed with torch's own ProcessGroup methods
put back: :func:`torch_own`) are timed interleaved, round after round,
and the median per-call difference is what commcheck costs — as CPU time of the training
thread (``time.thread_time``: what commcheck itself spends; the figure the issue's target
is about) and as wall time (which on a busy 2-core box also carries the scheduling of
gloo's worker thread and the relay process). The stages are then timed one by one on the
same arguments (prepare: bind, group, call site, entry record, input fingerprint; the two
ring writes; the output fingerprint), so a regression shows where it is: back to back (warm
caches) and each after a 50 µs block of the thread, as in a real call, which follows the
wait for the previous collective (on a VM that halts an idle vCPU, every stage costs 2–4×
more there: docs/performance.md). Records go to a
temporary dump directory. ``--p2p`` (2 ranks): rank 0 sends, rank 1 receives. ``--evict 64``
writes a 64 MiB buffer before every call (untimed), so each call runs with cold caches, as
between a training step's kernels: the figure that tells what a real step pays. ``--busy``
keeps the other core busy (a spinning process) while calls are timed: on a VM that halts an
idle vCPU (this project's box), every figure doubles without it, the original call's too.

``--device cuda`` (``--backend nccl``) puts the tensors on the GPU: device tensors take the
general path, whose fingerprints are kernels on the call's stream, so the wall time there
runs until the stream is done (what a step pays) and ``+launch`` is the wall time up to the
last launch (what the training thread pays).

``--relay`` sends the records to a real ``commcheck collect`` on loopback through the
node's real relay (started by the rank, as in a job without a launcher) instead of a dump
directory: the relay then tails the ring on the other core while the calls are timed, and
``--stop-relay`` freezes it (SIGSTOP) for the timing, so the two runs tell what its polling
and its work cost the training thread's wall clock. ``COMMCHECK_FLUSH_INTERVAL`` sets how
long the relay lets entries gather in the ring before it reads them (docs/startup.md).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_tmp = tempfile.TemporaryDirectory(prefix="commcheck-hotpath-")
_RELAY = "--relay" in sys.argv or "--stop-relay" in sys.argv


def start_collector() -> subprocess.Popen:
    """A real collector for a world of one on a free loopback port; the endpoint goes to
    ``COMMCHECK_COLLECTOR`` so that the rank's relay ships there."""
    ready = os.path.join(_tmp.name, "ready")
    proc = subprocess.Popen(
        [sys.executable, "-m", "commcheck", "collect", "--bind", "tcp://127.0.0.1:*",
         "--world-size", "1", "--db", os.path.join(_tmp.name, "bench.db"), "--no-live",
         "--exit-when-done", "--ready-file", ready],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (os.path.exists(ready) and Path(ready).read_text().endswith("\n")):
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit("bench_hotpath: the collector did not start")
        time.sleep(0.05)
    os.environ["COMMCHECK_COLLECTOR"] = Path(ready).read_text().strip()
    os.environ["COMMCHECK_RUN_ID"] = f"hotpath-{os.getpid()}"
    return proc


COLLECTOR = start_collector() if _RELAY else None
if not _RELAY:
    os.environ.setdefault("COMMCHECK_DUMP_DIR", _tmp.name)
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 20000))

import commcheck  # noqa: E402

commcheck.patch()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed import ProcessGroup  # noqa: E402

from commcheck.rank import runtime  # noqa: E402
from commcheck.rank.hotpath import EXPRESS  # noqa: E402
from commcheck.wire.ops import BY_NAME  # noqa: E402

DEVICE = torch.device("cpu")  # --device cuda: tensors on the GPU (NCCL or gloo)


def cases(n: int) -> dict[str, tuple]:
    """op -> (wrapped function, args, spec, input tensor, output tensor)."""
    x = torch.randn(n, device=DEVICE)
    out = torch.empty(n, device=DEVICE)
    return {
        "all_reduce": (dist.all_reduce, (x,), BY_NAME["all_reduce"], None, x),
        "all_gather_single": (getattr(dist, "all_gather_single", dist.all_gather_into_tensor),
                              (out, x), BY_NAME["all_gather_single"],
                              x, out),
        "all_gather": (dist.all_gather, ([out], x), BY_NAME["all_gather"], x, out),
        "broadcast": (dist.broadcast, (x, 0), BY_NAME["broadcast"], x, x),
        "reduce_scatter_single": (getattr(dist, "reduce_scatter_single",
                                          dist.reduce_scatter_tensor), (out, x),
                                  BY_NAME["reduce_scatter_single"], None, out),
    }


EVICT: torch.Tensor | None = None  # --evict: the "training step" run between two calls
BLOCK_S = 50e-6  # the block before each stage in the "after a block" timing


def per_call(fn, args, calls: int) -> tuple[float, float, float]:
    """(wall µs, training-thread CPU µs, launch wall µs) per call. With ``EVICT``, a pass
    over that buffer precedes each call, untimed: the call then finds its code and data out
    of the caches, as a collective does between a training step's kernels. On a GPU the
    wall time runs until the stream has finished (what the step pays), the CPU and launch
    wall time until the last launch (what the training thread pays); elsewhere the launch
    wall is the wall."""
    if EVICT is None:
        t, c = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            fn(*args)
        cpu = (time.thread_time() - c) / calls * 1e6
        launched = (time.perf_counter() - t) / calls * 1e6
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t) / calls * 1e6, cpu, launched
    wall = cpu = 0.0
    for _ in range(calls):
        EVICT.add_(1.0)
        t, c = time.perf_counter(), time.thread_time()
        fn(*args)
        wall += time.perf_counter() - t
        cpu += time.thread_time() - c
    return wall / calls * 1e6, cpu / calls * 1e6, wall / calls * 1e6


@contextlib.contextmanager
def torch_own():
    """torch's own ProcessGroup methods in place while the original is timed: commcheck
    also wraps those (for callers that skip dist.*), and that wrapper, called outside a
    dist.* wrapper, checks who called it (~0.8 µs a call here). The baseline is torch's
    call, so that cost is counted as commcheck's."""
    _, patcher = runtime._active
    own = [(cls, name, value) for cls, name, value in patcher.installer.saved
           if cls is ProcessGroup]
    installed = [(cls, name, vars(cls)[name]) for cls, name, _ in own]
    for cls, name, value in own:
        setattr(cls, name, value)
    try:
        yield
    finally:
        for cls, name, value in installed:
            setattr(cls, name, value)


def original(fn, fargs, calls: int) -> tuple[float, float, float]:
    """:func:`per_call` of torch's own call behind the wrapped ``fn``."""
    with torch_own():
        return per_call(fn.__commcheck_original__, fargs, calls)


def compare(fn, fargs, rounds: int, calls: int
            ) -> tuple[list[float], list[float], float, float]:
    """Per round, µs added per call (wall, CPU), wrapped minus original (torch's own call,
    :func:`torch_own`), order alternating; the original's median wall µs; the median wall
    µs added up to the last launch."""
    per_call(fn, fargs, 50)
    original(fn, fargs, 50)
    wall, cpu, base, launched = [], [], [], []
    for r in range(rounds):
        if r % 2:
            (ow, oc, ol), (ww, wc, wl) = original(fn, fargs, calls), per_call(fn, fargs, calls)
        else:
            (ww, wc, wl), (ow, oc, ol) = per_call(fn, fargs, calls), original(fn, fargs, calls)
        wall.append(ww - ow)
        cpu.append(wc - oc)
        launched.append(wl - ol)
        base.append(ow)
    return sorted(wall), sorted(cpu), statistics.median(base), statistics.median(launched)


def relay_pid(session, timeout: float = 120.0) -> int:
    """The pid of the relay serving this rank's ring, once it serves it (it marks the
    ring): its start-up is then over and not counted as work per call."""
    from commcheck.wire.ring import R_PID

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = session.ring.ring.word(R_PID)
        if pid:
            return pid
        time.sleep(0.05)
    sys.exit("bench_hotpath: no relay came up")


def cpu_of(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 without one)."""
    if not pid:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _blocked() -> None:
    time.sleep(BLOCK_S)


def per_call_blocked(fn, args, calls: int) -> float:
    """Training-thread CPU µs per call of ``fn`` when each call follows a short block of the
    thread (a sleep), as every stage does in a real call (it follows the wait for the
    previous collective): on a VM that halts an idle vCPU, code after a block runs with
    cold caches and predictors. The cost of the two clock reads is subtracted."""
    def one(f) -> float:
        total = 0
        for _ in range(calls):
            _blocked()
            c = time.thread_time_ns()
            f(*args)
            total += time.thread_time_ns() - c
        return total / calls / 1e3
    return one(fn) - one(lambda *a: None)


def stages(session, fn, args, spec, calls: int, timer=None) -> dict[str, float]:
    """µs per call (training-thread CPU) of each commcheck stage, run alone on the call's
    arguments: back to back (``timer`` None), or each after a block (:func:`per_call_blocked`)."""
    from commcheck.rank.hotpath import SLOW

    time_it = timer or (lambda f, a, n: per_call(f, a, n)[1])
    prepare = session.hotpath.make(spec)
    if prepare is None or prepare(args, {}) is SLOW:
        return {}
    plan = prepare(args, {})
    _, writer, values, finish, _, during = plan
    res = {"prepare": time_it(prepare, (args, {}), calls),
           "ring writes (2)": time_it(lambda: (writer.write_values(values),
                                               writer.write_values(values)), (), calls)}
    if during is not None:  # a large input, read while the collective runs
        res["input fingerprint"] = time_it(during, (), calls)
    res["output fingerprint"] = time_it(finish, (list(values),), calls)
    return res


def wait_for_device_fold() -> str:
    """Until the Triton fold (built on a thread of its own at the first device tensor) is
    ready, so that rounds time one path; the path that will be timed."""
    from commcheck.rank import device_fold

    dist.all_reduce(torch.zeros(8, device=DEVICE))
    if device_fold.kernels() is None:
        return "torch ops (no Triton, or COMMCHECK_TRITON=0)"
    deadline = time.monotonic() + 120
    while not device_fold.ready() and time.monotonic() < deadline:
        time.sleep(0.05)
    return "one Triton kernel" if device_fold.ready() else "torch ops (Triton did not build)"


def p2p(args) -> None:
    """Rank 0 sends, rank 1 receives, wrapped and original interleaved per round."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    for nbytes in (int(s) for s in args.sizes.split(",")):
        t = torch.randn(nbytes // 4)
        fn = dist.send if rank == 0 else dist.recv
        fargs = (t, 1 - rank)
        dist.barrier()
        wall, cpu, base, _ = compare(fn, fargs, args.rounds, args.calls)
        name = "send" if rank == 0 else "recv"
        print(f"{name:<24}{nbytes >> 10:>6}Ki{base:>9.1f}{statistics.median(wall):>10.1f}"
              f"{statistics.median(cpu):>9.1f}  [{cpu[0]:.1f}..{cpu[-1]:.1f}]", flush=True)
        if not args.no_stages:  # a ping-pong's own CPU varies by more than commcheck adds
            parts = stages(runtime.active_session(), fn, fargs, BY_NAME[name], args.calls)
            print(f"    stages (CPU, sum {sum(parts.values()):.1f}): " +
                  ", ".join(f"{k} {v:.1f}" for k, v in parts.items()), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--sizes", default="4096,65536", help="bytes, comma separated")
    ap.add_argument("--ops", default="all_reduce,all_gather_single,all_gather,broadcast,"
                                     "reduce_scatter_single")
    ap.add_argument("--no-stages", action="store_true")
    ap.add_argument("--p2p", action="store_true", help="send/recv (torchrun, 2 ranks)")
    ap.add_argument("--evict", type=int, default=0, metavar="MiB",
                    help="write a buffer this large before every call (caches cold)")
    ap.add_argument("--relay", action="store_true",
                    help="records to a real collector through the node's relay")
    ap.add_argument("--stop-relay", action="store_true",
                    help="--relay, with the relay frozen (SIGSTOP) while calls are timed")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="where the tensors are (cuda: the wall time waits for the stream)")
    ap.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    ap.add_argument("--python", action="store_true",
                    help="also time each op Express takes on the Python hot path (Express off)")
    ap.add_argument("--busy", action="store_true",
                    help="keep another core busy (a spinning process) while calls are timed")
    args = ap.parse_args()
    if args.busy:  # an idle vCPU halts, and every call then runs cold (docs/performance.md)
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        atexit.register(spinner.kill)
    global EVICT, DEVICE
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("bench_hotpath: --device cuda, and torch sees no GPU")
        DEVICE = torch.device("cuda", 0)
        torch.cuda.set_device(DEVICE)
    if args.evict:
        EVICT = torch.zeros(args.evict << 18)
    print(f"torch {torch.__version__}; µs per call, median of {args.rounds} rounds x "
          f"{args.calls} calls; added = wrapped - original (CPU: min..max in brackets)")
    gpu = args.device == "cuda"
    print(f"{'op':<32}{'size':>8}{'orig':>9}{'+wall':>10}{'+cpu':>9}  range"
          + ("  (GPU: +wall until the stream is done; +launch: wall until the last launch)"
             if gpu else ""))
    if args.p2p:
        p2p(args)
        return
    dist.init_process_group(args.backend, rank=0, world_size=1)
    session = runtime.active_session()
    torch.set_num_threads(1)
    relay = relay_pid(session) if _RELAY else 0
    frozen = relay if args.stop_relay else 0
    if frozen:
        os.kill(frozen, signal.SIGSTOP)
    print(f"records: {'a collector through the relay' if _RELAY else 'a dump directory'}"
          f"{f' (relay pid {frozen} frozen while timed)' if frozen else ''}; flush interval "
          f"{os.environ.get('COMMCHECK_FLUSH_INTERVAL', 'default')}", flush=True)
    if args.device == "cuda":
        print(f"device fingerprint: {wait_for_device_fold()}", flush=True)
    for nbytes in (int(s) for s in args.sizes.split(",")):
        for op in args.ops.split(","):
            fn, fargs, spec, _, _ = cases(nbytes // 4)[op]
            express = session.hotpath._express
            paths = [(op, True)]
            if args.python and op in EXPRESS:
                paths.append((f"{op} (Python)", False))
            for label, on in paths:
                for x in express:
                    x.on = on
                relay_cpu = cpu_of(relay)
                wall, cpu, base, launched = compare(fn, fargs, args.rounds, args.calls)
                relay_cpu = (cpu_of(relay) - relay_cpu) / (args.rounds * args.calls + 50) * 1e6
                print(f"{label:<32}{nbytes >> 10:>6}Ki{base:>9.1f}"
                      f"{statistics.median(wall):>10.1f}{statistics.median(cpu):>9.1f}"
                      f"  [{cpu[0]:.1f}..{cpu[-1]:.1f}]"
                      + (f"  +launch {launched:.1f}" if gpu else "")
                      + (f"  relay cpu {relay_cpu:.1f}/call" if relay else ""), flush=True)
            for x in express:
                x.on = True
            if not args.no_stages:
                warm = stages(session, fn, fargs, spec, args.calls)
                cold = stages(session, fn, fargs, spec, args.calls // 2, per_call_blocked)
                print("    stages (CPU, back to back / each after a block): " + ", ".join(
                    f"{k} {v:.1f} / {cold.get(k, 0.0):.1f}" for k, v in warm.items())
                    + f"; sum {sum(warm.values()):.1f} / {sum(cold.values()):.1f}", flush=True)
    if frozen:
        os.kill(frozen, signal.SIGCONT)
    dist.destroy_process_group()
    runtime.unpatch()  # the goodbye, and every record acknowledged, before the collector goes
    if COLLECTOR is not None:
        try:
            COLLECTOR.wait(60)
        except subprocess.TimeoutExpired:
            COLLECTOR.kill()


if __name__ == "__main__":
    main()
