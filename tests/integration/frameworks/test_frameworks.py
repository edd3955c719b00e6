"""Real frameworks under ``commcheck.patch()``, as a user would run them: PyTorch Lightning
(``strategy="ddp"``), Hugging Face Accelerate (a plain loop with ``Accelerator()``) and
transformers ``Trainer`` (a tiny GPT-2 from a config, nothing downloaded), 2 ranks each on
CPU/gloo, each with a real collector (tests/workers/fw_*.py).

Per framework one job with two faults on rank 1: bit 30 of its last DDP gradient bucket
(the reduction's output; two ranks, so only the evidence in the records can name rank 1)
and one bit of a chunk it received in a gather (a corrupted link 0 → 1). Neither changes
a training loss (the bucket is the last step's, after its loss; the gathered values are
only logged), so the rest of that job is the clean case: no other finding, and every loss
bit for bit that of an unpatched run beside it. Trainer's ``evaluate()`` reads the
corrupted parameters and gather, so its clean case is a fault-free job of its own.

``accelerate_fp16`` is Accelerate with its FP16 comm hook (issue 29 part 4): the bucket is
``ddp_bucket``, reduced through float16, and its recorded sums (input before the hook,
output after) settle the two-rank tie on rank 1, as DDP's own reduction does.

Call sites are expected to show the user's line beside the framework's (issue 18 item 5),
DDP buckets to be recorded by ``patch()`` alone (``COMMCHECK_TEST_WATCH=1`` in the
environment makes the workers call ``commcheck.watch`` as well).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import pytest

from ...harness import WORKERS, call_lines, report_json, start_collector, start_job
from ...stored import stored

# find_spec, not importorskip: importing the frameworks in pytest's process costs seconds
MISSING = [m for m in ("lightning", "accelerate", "transformers") if find_spec(m) is None]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300),
              pytest.mark.skipif(bool(MISSING), reason=f"not installed: {MISSING} "
                                 "(pip install -r requirements-dev.txt)")]

DDP_OPS = ("ddp_allreduce", "ddp_bucket")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@dataclass(frozen=True)
class Framework:
    script: str
    gather_op: str  # the gather whose received chunk is corrupted
    gather_call: int  # rank 1's call number of that op (counts from 1)
    gathers: int  # complete records of gather_op per rank in a clean run
    steps: int = 4
    ddp_op: str = "ddp_allreduce"  # what a gradient bucket is recorded as
    env: tuple[tuple[str, str], ...] = ()  # the worker's own settings

    def line(self, marker: str) -> str:
        """``script:line`` of the worker's ``# CALL:marker`` (the user's frame of a call)."""
        return f"{self.script}:{call_lines(WORKERS / self.script)[marker]}"

    @property
    def faults(self) -> str:
        return (f"bitflip:rank=1,op={self.ddp_op},call={self.steps},bit=30;"
                f"bitflip:rank=1,op={self.gather_op},call={self.gather_call}")


FRAMEWORKS = {
    # self.all_gather(loss) in each training_step: a barrier and an all_gather
    "lightning": Framework("fw_lightning.py", "all_gather", 2, 4),
    # gather_for_metrics(predictions) each step
    "accelerate": Framework("fw_accelerate.py", "all_gather", 2, 4),
    # the same with Accelerate's FP16 comm hook: buckets are ddp_bucket, through float16
    "accelerate_fp16": Framework("fw_accelerate.py", "all_gather", 2, 4, ddp_op="ddp_bucket",
                                 env=(("FW_COMM_HOOK", "fp16"),)),
    # per step Trainer gathers num_items_in_batch, the loss for logging and a scalar (3 x 4),
    # one more at the end of training, then evaluate() gathers per batch: call 14 is the
    # first evaluation gather (gather_for_metrics)
    "trainer": Framework("fw_trainer.py", "all_gather", 14, 17),
}


@dataclass
class Run:
    rc: int  # the collector's exit status
    doc: dict  # commcheck report --json
    db: Path
    outputs: list[str]


def _patched(tmp: Path, fw: Framework, inject: str = "") -> tuple:
    col = start_collector(tmp, 2, "--exit-when-done")
    env = {**OFFLINE, **dict(fw.env), "COMMCHECK_COLLECTOR": col.endpoint,
           "COMMCHECK_RUN_ID": tmp.name}
    if inject:
        env["COMMCHECK_INJECT"] = inject
    return col, start_job(WORKERS / fw.script, env, nnodes=1, nproc=2)


def _finish(procs, timeout: float = 240) -> list[str]:
    outputs = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, out[-4000:]
        outputs.append(out)
    return outputs


def _collect(col, outputs: list[str]) -> Run:
    rc, _, err = col.wait()
    code, doc = report_json(col.db)
    return Run(rc, doc, col.db, outputs)


def _losses(output: str) -> list[str]:
    """Every ``LOSS rank step hex`` and ``EVAL rank hex`` line, in (rank, step) order. Not
    anchored at a line's start: the ranks share one pipe, and another process's write
    longer than PIPE_BUF (a framework's warning) may be cut around a rank's one-write line."""
    return sorted(re.findall(r"(?:LOSS \d+ \d+|EVAL \d+) -?0x[0-9a-f.]+p[-+]\d+|"
                             r"(?:LOSS \d+ \d+|EVAL \d+) (?:-?inf|nan)$", output, re.M))


def _brief(doc: dict) -> list[tuple]:
    return [(f["kind"], f["op"], f["seq"], f["culprits"], f["ambiguous"]) for f in
            doc["findings"]]


def _reference(fw: Framework) -> list:
    """The same job unpatched (commcheck not even imported), for the losses."""
    return start_job(WORKERS / fw.script, {**OFFLINE, **dict(fw.env), "FW_PATCH": "0"},
                     nnodes=1, nproc=2)


def _clean_part(fw: Framework, run: Run, reference: list[str] | None, findings: int) -> None:
    """What a clean run must show: no finding but the ``findings`` of the faults (each
    asserted by its own test), every rank's records complete, every loss the unpatched
    one's (where ``reference`` ran), every gather and bucket recorded."""
    assert len(run.doc["findings"]) == findings, _brief(run.doc)
    assert run.rc == (1 if findings else 0)
    s = run.doc["summary"]
    assert s["ranks_said_goodbye"] == 2 and s["unmatched"] == 0
    assert s["dropped_on_ranks"] == 0 and s["not_checked_on_ranks"] == 0
    losses = _losses(run.outputs[0])
    assert len([x for x in losses if x.startswith("LOSS")]) == 2 * fw.steps, run.outputs[0]
    if reference is not None:
        assert losses == _losses(reference[0])
    with stored(run.db) as conn:
        done = dict(conn.execute("SELECT op, COUNT(*) FROM records WHERE t_done > 0 "
                                 "GROUP BY op"))
    assert done.get(fw.gather_op) == 2 * fw.gathers, done
    assert done.get(fw.ddp_op) == 2 * fw.steps, done  # one bucket a step, DDP's or the hook


# accelerate_fp16's clean run is test_ddp.py's FP16 hook job (the same hook, its sums checked)
CLEAN_BESIDE_FAULTS = ("lightning", "accelerate")


def test_clean_trainer_run_has_no_findings_and_the_unpatched_losses(tmp_path):
    fw = FRAMEWORKS["trainer"]
    col, patched = _patched(tmp_path, fw)
    unpatched = _reference(fw)
    run = _collect(col, _finish(patched))
    _clean_part(fw, run, _finish(unpatched), findings=0)


@pytest.fixture(scope="module", params=list(FRAMEWORKS))
def faulty(request, tmp_path_factory) -> tuple[Framework, Run, list[str] | None]:
    """The job with both faults and, where it is the clean case for the losses, the
    unpatched job run beside it (side by side: nothing shared)."""
    fw = FRAMEWORKS[request.param]
    tmp = tmp_path_factory.mktemp(f"faulty-{request.param}")
    col, procs = _patched(tmp, fw, fw.faults)
    unpatched = _reference(fw) if request.param in CLEAN_BESIDE_FAULTS else None
    run = _collect(col, _finish(procs))
    return fw, run, _finish(unpatched) if unpatched else None


def test_beside_the_faults_no_finding_and_the_unpatched_losses(faulty):
    """Where the faulty job is not the clean case for the losses (trainer, accelerate_fp16)
    the rest still holds: no other finding, nothing dropped, every call recorded."""
    fw, run, reference = faulty
    _clean_part(fw, run, reference, findings=2)


def test_corrupted_ddp_bucket_names_its_rank(faulty):
    fw, run, _ = faulty
    on_ddp = [f for f in run.doc["findings"] if f["op"] in DDP_OPS]
    assert len(on_ddp) == 1, _brief(run.doc)
    f = on_ddp[0]
    assert f["kind"] in ("value_mismatch", "reduction_error"), _brief(run.doc)
    assert f["culprits"] == [1] and not f["ambiguous"], _brief(run.doc)
    assert f["detail"]["injected"] is True
    # the framework's frame, and the user's line that led there (issue 18 item 5)
    assert f"← {fw.line('bucket')} " in f["callsite"], f["callsite"]
    assert run.rc == 1
    if fw.ddp_op == "ddp_bucket":  # a tie at two ranks, settled by the sums the hook left
        assert f["kind"] == "value_mismatch" and f["detail"]["tie"]["by"] == "reduction"
        assert f["detail"]["tie"]["decided"] is True, f["detail"]["tie"]
        assert re.fullmatch(r"rank 1 output sum \S+, inputs reduce to \S+; rank 0 output sum "
                            r"\S+ is within the tolerance \S+",
                            f["detail"]["tie"]["evidence"]), f["detail"]["tie"]


def test_corrupted_received_chunk_is_one_link_corruption(faulty):
    fw, run, _ = faulty
    rest = [f for f in run.doc["findings"] if f["op"] not in DDP_OPS]
    assert [(f["kind"], f["op"], f["culprits"]) for f in rest] == [
        ("link_corruption", fw.gather_op, [1])], _brief(run.doc)
    assert rest[0]["detail"]["links"] == [[0, 1]] and rest[0]["detail"]["injected"] is True
    assert f"← {fw.line('gather')} " in rest[0]["callsite"], rest[0]["callsite"]
