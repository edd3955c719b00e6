"""What a training process that called ``commcheck.patch()`` has loaded and holds."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest


@pytest.mark.integration
def test_a_patched_training_process_loads_no_collector_or_engine_module():
    code = ("import commcheck, sys; commcheck.patch(); "
            "print(sorted(m for m in sys.modules "
            "if m.startswith(('commcheck.collector', 'commcheck.engine'))))")
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_a_patched_rank_holds_no_socket_and_no_sender_thread(tmp_path, monkeypatch):
    """The training process writes its ring; the socket is the relay's (another process)."""
    import gc
    import socket
    import warnings

    import torch
    import torch.distributed as dist
    import zmq

    import commcheck

    monkeypatch.setenv("COMMCHECK_COLLECTOR", "tcp://127.0.0.1:9")  # nobody listens
    monkeypatch.setenv("COMMCHECK_RUN_ID", f"nosocket-{os.getpid()}")
    monkeypatch.setenv("COMMCHECK_RING_DIR", str(tmp_path / "rings"))
    monkeypatch.setenv("COMMCHECK_LINGER", "0")
    monkeypatch.delenv("COMMCHECK_DUMP_DIR", raising=False)
    def open_sockets() -> set[int]:
        with warnings.catch_warnings():  # isinstance() on torch's deprecated aliases warns
            warnings.simplefilter("ignore")
            return {id(o) for o in gc.get_objects()  # type(): a dead weak proxy may be here
                    if issubclass(type(o), zmq.Socket) and not o.closed}

    open_before = open_sockets()
    threads_before = set(threading.enumerate())  # another test's store may still be closing
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert commcheck.patch()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
        dist.all_reduce(torch.ones(4))
        ours = {t.name for t in set(threading.enumerate()) - threads_before
                if t.name.startswith("commcheck")}
        assert ours == {"commcheck-resolver"}
        assert open_sockets() - open_before == set()
        assert commcheck.active_session().ring.stats()["records"] == 2
    finally:
        commcheck.unpatch()
        if dist.is_initialized():
            dist.destroy_process_group()
