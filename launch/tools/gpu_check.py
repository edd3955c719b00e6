"""GPU checks for a session lent a CUDA machine (issue 2): one script, figures on stdout.

    python launch/tools/gpu_check.py [--max-gib 1]

1. Device fingerprint throughput (hash + summary, ``DevicePrint.start`` and the event wait)
   against a plain ``torch.clone`` of the same tensor, 64 MiB … 1 GiB, CUDA-event timed.
2. A patched world-size-1 NCCL all_reduce (sync and async) under
   ``torch.cuda.set_sync_debug_mode("error")``: any host synchronisation commcheck caused on
   the training thread raises; the sender thread's event polling is non-blocking.
3. The device fold equals the CPU fold of the same bytes (the algorithm is device-agnostic).
4. CUDA-graph capture (issue 3): a patched all_reduce captured into a graph and replayed gives
   the eager result, commcheck puts nothing into the graph and counts the call not checked.
5. ``split_group`` (needs NCCL): a collective on a split group is recorded under that group,
   and the backend's work counter shows nothing bypassed the wrappers.
6. A frozen rank in an NCCL collective (issue 12; needs 2 GPUs, one rank each): rank 1
   stops itself (SIGSTOP) inside an all_reduce every member entered; the collector (hang
   timeout 3 s) must report a live ``hang`` naming rank 1, as it does on gloo.

Without CUDA it prints one line and exits 0, so it can sit in any checklist.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check")
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-gib", type=float, default=1.0)
    args = ap.parse_args()

    from commcheck.rank.fingerprint import DevicePrint, device_hash

    dev = torch.device("cuda", 0)
    print(f"device: {torch.cuda.get_device_name(dev)}")
    print(f"{'size':>10}{'clone ms':>12}{'print ms':>12}{'ratio':>8}{'GB/s':>8}")
    size = 64 << 20
    while size <= args.max_gib * (1 << 30):
        x = torch.randn(size // 4, device=dev)
        for _ in range(2):
            x.clone()
            DevicePrint.start(x)
        torch.cuda.synchronize()

        def timed(fn, reps=10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / reps

        t_clone = timed(lambda: x.clone())  # noqa: B023 - timed at once
        t_print = timed(lambda: DevicePrint.start(x))  # noqa: B023
        print(f"{size >> 20:>7} MiB{t_clone:>12.3f}{t_print:>12.3f}{t_print / t_clone:>8.2f}"
              f"{size / t_print / 1e6:>8.1f}")
        size *= 4

    x = torch.randn(1 << 20, device=dev)
    same = device_hash(x).tolist() == device_hash(x.cpu()).tolist()
    print(f"device fold == CPU fold of the same bytes: {same}")

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561",
                      COMMCHECK_DUMP_DIR=tempfile.mkdtemp(prefix="commcheck-gpu-"),
                      COMMCHECK_RUN_ID="gpu-check")
    import commcheck

    commcheck.patch()
    import torch.distributed as dist

    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    y = torch.ones(1 << 24, device=dev)
    dist.all_reduce(y)  # warm-up outside the checked region (NCCL init syncs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    ok = True
    try:
        t = time.perf_counter()
        for _ in range(20):
            dist.all_reduce(y)
            dist.all_reduce(y, async_op=True).wait()
        host_ms = (time.perf_counter() - t) * 1e3 / 40
    except RuntimeError as e:
        ok, host_ms = False, float("nan")
        print(f"synchronisation detected: {e}")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    print(f"patched NCCL all_reduce without host sync: {ok} ({host_ms:.3f} ms host time/call)")
    session = commcheck.active_session()
    graphed = _cuda_graph(dist, session, dev)
    split = _split_group(dist, session, dev)
    dist.destroy_process_group()
    frozen = _frozen_rank()
    return 0 if ok and same and graphed and split and frozen else 1


def _frozen_rank() -> bool:
    """Case 6: a collector and a 2-rank NCCL job of tests/workers/dying.py (DYING=stop)."""
    import json
    import signal
    import sqlite3
    import subprocess
    from pathlib import Path

    import torch

    if torch.cuda.device_count() < 2:
        print("frozen rank in an NCCL collective: skipped (needs 2 GPUs)")
        return True
    root = Path(__file__).resolve().parents[2]
    tmp = Path(tempfile.mkdtemp(prefix="commcheck-frozen-"))
    ready, db = tmp / "ready", tmp / "run.db"
    col = subprocess.Popen([sys.executable, "-m", "commcheck.cli", "collect", "--bind",
                            "tcp://127.0.0.1:*", "--world-size", "2", "--db", str(db),
                            "--ready-file", str(ready), "--no-live", "--hang-timeout", "3"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not ready.exists():
        time.sleep(0.1)
    env = {**os.environ, "COMMCHECK_COLLECTOR": ready.read_text().strip(), "BACKEND": "nccl",
           "DYING": "stop", "VICTIM": "1", "AT": "4", "COMMCHECK_RUN_ID": "gpu-frozen",
           "COMMCHECK_RING_DIR": str(tmp / "rings")}
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run",
                            "--nproc-per-node", "2", str(root / "tests/workers/dying.py")],
                           env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    found, t0 = [], time.monotonic()
    try:
        while not found and time.monotonic() - t0 < 60:
            time.sleep(0.5)
            if db.exists():
                with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as conn:
                    found = [json.loads(c) for (c,) in conn.execute(
                        "SELECT culprits FROM findings WHERE kind = 'hang'")]
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        col.send_signal(signal.SIGTERM)
        col.wait(60)
    ok = found == [[1]]
    print(f"frozen rank in an NCCL collective named live: {ok} ({found or 'no hang'} after "
          f"{time.monotonic() - t0:.1f} s)")
    return ok


def _cuda_graph(dist, session, dev) -> bool:
    import torch

    try:
        z = torch.full((1024,), 2.0, device=dev)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            dist.all_reduce(z)  # warm-up on the capture stream
        torch.cuda.current_stream().wait_stream(stream)
        before = session.not_checked
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            dist.all_reduce(z)
        z.fill_(3.0)
        graph.replay()
        torch.cuda.synchronize()
        ok = bool((z == 3.0).all()) and session.not_checked == before + 1
        print(f"CUDA-graph capture: replay correct and counted not checked: {ok} "
              f"(not_checked {before} -> {session.not_checked})")
        return ok
    except Exception as e:  # report, do not hide the other checks
        print(f"CUDA-graph capture check failed: {e!r}")
        return False


def _split_group(dist, session, dev) -> bool:
    import torch

    try:
        sub = dist.split_group(split_ranks=[[0]])
        w = torch.ones(8, device=dev)
        dist.all_reduce(w, group=sub)
        torch.cuda.synchronize()
        known = session.groups.resolve(sub) is not None
        unseen = session.tally.unseen()
        ok = known and not unseen
        print(f"split_group: group resolved {known}, bypassed {unseen or 'none'}: {ok}")
        return ok
    except Exception as e:
        print(f"split_group check failed: {e!r}")
        return False


if __name__ == "__main__":
    sys.exit(main())
