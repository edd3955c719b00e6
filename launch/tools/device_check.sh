#!/bin/bash
# The checks that need a GPU machine, as one script (docs/performance.md, "On a GPU
# machine"): commcheck's device-tensor path under real CUDA, and the figures this project's
# 2-core VM cannot give (per-call wall time where an idle core does not halt, ingest with
# cores to spare). Run from the repository root on a machine with torch+CUDA:
#
#     bash launch/tools/device_check.sh [OUTDIR [PARTS]]
#
# PARTS (default "gpu cpu ingest"): gpu = the device path (unit tests, two GPU jobs, per-call
# cost with the Triton fold and with the torch ops); verdicts = the unit tests and the two
# jobs alone; cpu = per-call host time on the CPU; ingest = `commcheck bench collector`
# with the straggler analysis off and on.
#
# pyzmq and msgspec, where the image lacks them, come from .whl/ (see the device notes in
# docs/performance.md). Every step prints one PASS/FAIL or its figures; the log is OUTDIR/log.
set -u
OUT_DIR=${1:-${OUT:-/tmp/commcheck-device}}
PARTS=${2:-gpu cpu ingest}
mkdir -p "$OUT_DIR"
exec > >(tee "$OUT_DIR/log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
PY=${PY:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/commcheck-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/commcheck-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
step() { echo; echo "== $* ($(date +%T), load $(cut -d' ' -f1 /proc/loadavg))"; }
part() { [[ " $PARTS " == *" $1 "* ]]; }

step machine
nproc; grep -m1 "model name" /proc/cpuinfo
cat /sys/devices/system/cpu/cpuidle/current_driver /sys/devices/system/cpu/cpuidle/current_governor \
    /sys/module/haltpoll/parameters/guest_halt_poll_ns 2>/dev/null
nvidia-smi -L 2>/dev/null
$PY -c "import torch, zmq, msgspec; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'zmq', zmq.__version__)" || exit 1

step build the C kernel in place
$PY setup.py -q build_ext --inplace >"$OUT_DIR/build.log" 2>&1 && echo built || echo "FAIL build (see build.log); first-use build instead"

if part gpu || part verdicts; then
step unit: the device fingerprint under CUDA, and the rest of the fingerprint tests
timeout 300 $PY -m pytest -q -p no:cacheprovider -rs tests/unit/test_fingerprint.py 2>&1 | tail -4

report_culprits() {  # db, expected culprit set as "2" or ""
    $PY -m commcheck report "$1" --json >"$OUT_DIR/$(basename "$1" .db).json" 2>/dev/null
    $PY - "$OUT_DIR/$(basename "$1" .db).json" "$2" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
# Stragglers apart: ranks that time-share one GPU take turns being slower (docs/performance.md)
found = [f for f in doc["findings"] if f["kind"] != "straggler"]
got = sorted({r for f in found for r in f["culprits"]})
kinds = sorted({f["kind"] for f in found})
want = [int(x) for x in sys.argv[2].split(",") if x]
s = doc["summary"]
print(("PASS" if got == want else "FAIL"), "culprits", got, "want", want, "kinds", kinds,
      "| summary", {k: s[k] for k in ("records", "verified", "unmatched") if k in s})
for f in doc["findings"]:
    if f["kind"] == "straggler":
        d = f["detail"]
        print(f"  straggler: rank {d.get('rank')} steps {d.get('start_step')}-{d.get('end_step')},"
              f" {d.get('median_gap_ms')} ms behind, {d.get('wall_pct')} % of the others' wall")
EOF
}

step GPU job: 4 ranks on one GPU over gloo, CUDA tensors, bit flip on rank 2 at step 300, the Triton fold built by then
COMMCHECK_INJECT="bitflip:rank=2,op=all_reduce,call=1200,bit=30" timeout 240 \
    $PY -m commcheck run --db "$OUT_DIR/gloo_cuda.db" --nproc-per-node 4 \
    launch/examples/train_demo.py --device cuda --steps 400 >"$OUT_DIR/gloo_cuda.txt" 2>&1
echo "exit $?"; report_culprits "$OUT_DIR/gloo_cuda.db" 2

step GPU job: NCCL, one rank, clean
timeout 180 $PY -m commcheck run --db "$OUT_DIR/nccl_clean.db" --nproc-per-node 1 \
    launch/examples/train_demo.py --device cuda --backend nccl --steps 400 \
    >"$OUT_DIR/nccl_clean.txt" 2>&1
echo "exit $?"; report_culprits "$OUT_DIR/nccl_clean.db" ""
fi

if part gpu; then
for triton in 1 0; do
    step per call on the GPU: NCCL world of one, through the relay, COMMCHECK_TRITON=$triton
    COMMCHECK_TRITON=$triton timeout 240 $PY launch/bench/bench_hotpath.py --device cuda \
        --backend nccl --relay --no-stages --calls 400 --rounds 7 \
        --ops all_reduce,all_gather_single,broadcast --sizes 4096,65536,1048576,67108864 \
        2>&1 | grep -v bypassed
done
fi

if part cpu; then
step per call on the CPU: gloo world of one, interleaved with the unwrapped call, Express and the Python path
ALL=all_reduce,broadcast,all_gather_single,reduce_scatter_single,all_gather
for i in 1 2; do
    timeout 150 $PY launch/bench/bench_hotpath.py --calls 2000 --rounds 11 --sizes 4096,65536 \
        --ops $ALL --python --no-stages 2>&1 | grep -v bypassed
done
step per call on the CPU through the relay to a real collector
for i in 1 2; do
    timeout 150 $PY launch/bench/bench_hotpath.py --relay --calls 2000 --rounds 11 \
        --sizes 4096,65536 --ops $ALL --python --no-stages 2>&1 | grep -v bypassed
done
fi

if part ingest; then
step collector ingest, analysis off and on, alternating
for i in 1 2 3; do
    for s in off on; do
        echo -n "straggler $s: "
        timeout 120 $PY -m commcheck bench collector --ranks 1024 --records 2000000 \
            $([ $s = off ] && echo --straggler off) 2>&1 | grep -i "records/s\|error" | tail -2
    done
done
fi
step done
