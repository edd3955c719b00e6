"""Calls torch rejects, sparse tensors and a second patch() in one run, on a real single-rank
gloo group (issue #16, item 6): the caller sees torch's own exception, no entry record is
left dangling, what cannot be checked is counted with its reason, and a rank's dump file is
appended to, never truncated."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import commcheck
from commcheck.wire import (
    F_IN_HASH,
    F_IN_SUMMARY,
    F_OUT_HASH,
    F_OUT_SUMMARY,
    F_REJECTED,
    GOODBYE,
    HELLO,
    PHASE_COMPLETE,
    PHASE_ENTRY,
)

from .test_patch import _init, patched, read_dump, records  # noqa: F401

pytestmark = pytest.mark.timeout(60)
PRINTS = F_IN_HASH | F_IN_SUMMARY | F_OUT_HASH | F_OUT_SUMMARY


def _goodbye(batches) -> dict[str, int]:
    [bye] = [b for b in batches if b.env.kind == GOODBYE]
    return bye.env.counters


REJECTED = [
    ("all_gather", lambda: ([torch.empty(2, dtype=torch.int64)], torch.ones(2))),  # dtypes
    ("broadcast", lambda: (torch.ones(2), 3)),  # a root outside the group
    ("all_gather_single", lambda: (torch.empty(3), torch.ones(2))),  # sizes
]


@pytest.mark.parametrize(("op", "make"), REJECTED, ids=[r[0] for r in REJECTED])
def test_a_call_torch_rejects_leaves_no_dangling_entry(patched, op, make):  # noqa: F811
    _init()
    fn = getattr(dist, op)
    with pytest.raises(Exception) as got:
        fn(*make())
    with pytest.raises(Exception) as want:
        fn.__commcheck_original__(*make())
    assert (type(got.value), str(got.value)) == (type(want.value), str(want.value))
    dist.all_reduce(torch.ones(4))  # a good call afterwards is recorded as usual
    dist.destroy_process_group()
    batches = read_dump(patched)
    entries = records(batches, PHASE_ENTRY)
    done = records(batches, PHASE_COMPLETE)
    key = [(int(r["group"]), int(r["seq"])) for _, r in entries]
    assert key == [(int(r["group"]), int(r["seq"])) for _, r in done]  # every entry closed
    (b, rej), (_, ok) = done
    assert b.strings[rej["op"]] == op
    assert int(rej["flags"]) & F_REJECTED and not int(rej["flags"]) & PRINTS
    assert not int(ok["flags"]) & F_REJECTED and int(ok["flags"]) & F_OUT_HASH
    counters = _goodbye(batches)
    assert counters["not_checked:rejected"] == 1 and counters["internal_errors"] == 0


HOT_REJECTED = [
    ("broadcast", lambda: (torch.ones(2), 0), lambda: (torch.ones(2), 3)),
    ("all_gather_single", lambda: (torch.empty(2), torch.ones(2)),
     lambda: (torch.empty(3), torch.ones(2))),
]


@pytest.mark.parametrize(("op", "good", "bad"), HOT_REJECTED, ids=[r[0] for r in HOT_REJECTED])
def test_a_rejected_call_after_the_hot_path_learned_its_op_is_still_closed(
        patched, op, good, bad):  # noqa: F811
    """The hot path stops reading the backend's counter after the call once it learned an
    op's work; a call torch rejects must still be told from one that failed in its work."""
    _init()
    fn = getattr(dist, op)
    for _ in range(12):
        fn(*good())
    with pytest.raises((RuntimeError, ValueError)):
        fn(*bad())
    fn(*good())
    dist.destroy_process_group()
    batches = read_dump(patched)
    entries = records(batches, PHASE_ENTRY)
    done = records(batches, PHASE_COMPLETE)
    assert len(entries) == len(done) == 14  # every entry closed
    rejected = [r for _, r in done if int(r["flags"]) & F_REJECTED]
    assert len(rejected) == 1 and int(rejected[0]["seq"]) == 12
    counters = _goodbye(batches)
    assert counters["not_checked:rejected"] == 1 and counters["internal_errors"] == 0
    assert counters["hotpath"] == 14 and counters.get("bypassed", 0) == 0
    # taken whole in C once learned (native/express.c), the rejected call too
    assert counters["hotpath_express"] == 14 - 8


def test_sparse_tensors_are_not_checked_with_their_reason(patched):  # noqa: F811
    _init()
    x = torch.ones(3).to_sparse()
    dist.all_reduce(x)
    assert torch.equal(x.to_dense(), torch.ones(3))
    dist.destroy_process_group()
    batches = read_dump(patched)
    assert records(batches, PHASE_ENTRY) == [] and records(batches) == []
    counters = _goodbye(batches)
    assert counters["not_checked:sparse"] == 1 and counters["not_checked"] == 1
    assert counters["internal_errors"] == 0


def test_patching_again_in_the_same_run_appends_to_the_dump(patched):  # noqa: F811
    _init()
    dist.all_reduce(torch.ones(4))
    commcheck.unpatch()  # delivers and says goodbye
    first = read_dump(patched)
    assert commcheck.patch()
    dist.all_reduce(torch.ones(4))
    dist.all_reduce(torch.ones(4))
    commcheck.unpatch()
    batches = read_dump(patched)
    assert [b.env.kind for b in batches[:len(first)]] == [b.env.kind for b in first]
    assert [b.env.kind for b in batches].count(HELLO) == 2
    assert [b.env.kind for b in batches].count(GOODBYE) == 2
    assert len(records(batches)) == 3
