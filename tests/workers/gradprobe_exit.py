"""A script that never calls ``stop()``: STEPS optimizer steps under the gradient probe,
with a writer slowed by DELAY_S a step so that steps are still queued when the script ends
(normally, or by the signal the test sends once it printed "stepped N")."""

from __future__ import annotations

import os
import sys
import time

import torch

from commcheck.gradprobe import GradProbe
from commcheck.gradprobe import writer as writer_mod

STEPS = int(os.environ.get("STEPS", "6"))
DELAY_S = float(os.environ.get("DELAY_S", "0.2"))
_write = writer_mod.DumpWriter._write


def slow_write(self, job):
    time.sleep(DELAY_S)
    _write(self, job)


writer_mod.DumpWriter._write = slow_write
model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
probe = GradProbe(model, level="L1", dump_path=os.environ["DUMP"])
for _ in range(STEPS):
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
print(f"stepped {STEPS}", flush=True)
if os.environ.get("WAIT"):
    time.sleep(60)  # the test signals us here
sys.exit(0)
