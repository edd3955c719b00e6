"""The C ring writer (native/hot.c) converts every argument before it writes: a call with a
bad argument raises and leaves the ring exactly as it was (no half-published entry)."""

from __future__ import annotations

import pytest

from commcheck.wire.ring import K_RECORD, W_ENTRIES, W_WRITE

from .test_ring import writer


@pytest.mark.parametrize("bad", [("kind", "x"), ("records", -1), ("payload", 3)])
def test_a_bad_argument_writes_nothing(tmp_path, bad):
    from commcheck.native import hot

    if hot.module() is None:
        pytest.skip("the native per-call path cannot be built here")
    w = writer(tmp_path)
    assert w._hot is not None
    args = {"kind": K_RECORD, "payload": b"\x90", "records": 1, "count_drop": True}
    args[bad[0]] = bad[1]
    before = (w.ring.word(W_WRITE), w.ring.word(W_ENTRIES))
    with pytest.raises((TypeError, OverflowError, ValueError)):
        w._hot.put(args["kind"], args["payload"], args["records"], args["count_drop"])
    assert (w.ring.word(W_WRITE), w.ring.word(W_ENTRIES)) == before
    w._hot.put(K_RECORD, b"\x90", 1, True)  # the good call still writes
    assert w.ring.word(W_ENTRIES) == before[1] + 1
    w.close(0.0)
