"""A bucket reduced by torch's averaging comm hooks at two ranks (issue 29 part 4): its
records carry the input's sum before the hook and the output's after, named by the hook's
numerics (``AVG``, ``AVG_FP16``, ``AVG_BF16``), so the tie is settled by the inputs, with a
tolerance that knows the compression; any other hook stays a tie. Hand-made records through
both engines, and the hooks as the rank side tells them apart."""

from __future__ import annotations

import pytest
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as d
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from commcheck.engine.verdicts import compressed_tolerance, reduction_tolerance
from commcheck.rank.ddp import hook_numerics
from commcheck.wire import F_IN_SUMMARY, F_OUT_HASH, F_OUT_SUMMARY

from ..records import rec
from .test_verdict_ties import IN_SUMS, PAIR, run_pair

pytestmark = pytest.mark.timeout(30)
MEAN = (IN_SUMS[0] + IN_SUMS[1]) / 2
SUMS = F_IN_SUMMARY | F_OUT_HASH | F_OUT_SUMMARY


def _bucket(out_sums: dict[int, float], redop: str, flags: int = SUMS, numel: int = 1000):
    return {r: [rec(op="ddp_bucket", ranks=PAIR, redop=redop, numel_in=numel,
                    numel_out=numel, flags=flags, in_summary=(IN_SUMS[r], 2.0, 0, 0),
                    out_summary=(out_sums[r], 2.0, 0, 0),
                    out=(7, 7) if out_sums[r] != out_sums[0] else (1, 1))]
            for r in PAIR}


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "exact"])
@pytest.mark.parametrize("redop", ["AVG", "AVG_FP16", "AVG_BF16"])
def test_a_corrupted_hooked_bucket_at_two_ranks_names_its_rank(redop, fast):
    _, findings = run_pair(_bucket({0: MEAN + 1e-4, 1: -1.43e37}, redop), fast)
    [f] = findings
    assert (f.kind, f.op, f.culprits, f.ambiguous) == ("value_mismatch", "ddp_bucket", [1],
                                                       False)
    assert f.detail.tie.by == "reduction" and f.detail.tie.decided
    assert f.detail.tie.evidence.startswith("rank 1 output sum -1.43e+37, inputs reduce to "
                                            "-0.76; rank 0 output sum -0.76 is within the "
                                            "tolerance "), f.detail.tie.evidence


def test_an_unknown_hook_stays_a_tie_with_its_reason():
    """A user's own hook (no reduction op recorded, no input sum): only its result is known
    to agree."""
    _, findings = run_pair(_bucket({0: MEAN, 1: -1.43e37}, "", flags=F_OUT_HASH))
    [f] = findings
    assert (f.culprits, f.ambiguous) == ([0, 1], True)
    assert f.detail.tie.evidence == "no record says which output is right"


def test_fp16_rounding_is_no_evidence_but_bf16_knows_it_is_coarser():
    """An fp16-compressed mean is off by fp16 rounding: inside its tolerance, and further
    than float32's would allow."""
    n, absmax = 1000, 4.0
    fp16 = compressed_tolerance("float16", 2, n, absmax)
    assert fp16 > reduction_tolerance("float32", 2, n, absmax) * 1000
    assert compressed_tolerance("bfloat16", 2, n, absmax) > fp16  # 8 bits of mantissa
    off = fp16 / 2
    _, findings = run_pair(_bucket({0: MEAN, 1: MEAN + off}, "AVG_FP16"))
    [f] = findings
    assert f.ambiguous and "cannot be told from rounding" in f.detail.tie.evidence


def test_torchs_averaging_hooks_are_told_apart_from_the_others():
    assert hook_numerics(d.allreduce_hook) == "AVG"
    assert hook_numerics(d.fp16_compress_hook) == "AVG_FP16"
    assert hook_numerics(d.bf16_compress_hook) == "AVG_BF16"
    assert hook_numerics(d.fp16_compress_wrapper(d.allreduce_hook)) == "AVG_FP16"
    assert hook_numerics(d.bf16_compress_wrapper(d.allreduce_hook)) == "AVG_BF16"
    assert hook_numerics(d.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook)) is None
    assert hook_numerics(powerSGD_hook.powerSGD_hook) is None
    assert hook_numerics(lambda state, bucket: None) is None
