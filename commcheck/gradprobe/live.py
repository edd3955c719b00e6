"""The probe's live cross-replica check: gradients and parameters as replicated records.

After data-parallel reduction every replica must hold bit-identical gradients, and after
the step bit-identical parameters. Each selected parameter becomes one record per step and
phase, keyed by (``grad:<name>`` or ``param:<name>``, replica ranks, step), fingerprinted
like a collective's output and sent through the rank's commcheck channel; the engine's
majority vote then names the diverging rank, parameter and step (``grad_divergence``,
``param_divergence``), and NaN/Inf in a gradient becomes a ``nan_inf`` naming it.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from ..rank.callsite import callsite
from ..rank.groups import Group
from ..rank.prints import SidePrint
from ..rank.runtime import active_session
from ..rank.session import Call, Session
from ..wire import SIDE_OUT, Record
from ..wire.ops import BY_NAME
from .events import ProbeEvent


def replica_ranks(replica_group: Any = None) -> tuple[int, ...]:
    """Ranks of this rank's data-parallel replica group: the world, a ProcessGroup, or a
    ``(DeviceMesh, dim_name)`` pair."""
    if isinstance(replica_group, tuple):
        mesh, dim = replica_group
        replica_group = mesh.get_group(dim)
    return tuple(sorted(dist.get_process_group_ranks(replica_group or dist.group.WORLD)))


class LiveCheck:
    """A GradProbe sink; cheap on the training thread (CPU: hash now; device: enqueue)."""

    def __init__(self, session: Session, replica_group: Any = None):
        self.session = session
        self.ranks = replica_ranks(replica_group)
        self.rank = dist.get_rank()

    @classmethod
    def for_active_session(cls, replica_group: Any = None) -> LiveCheck | None:
        session = active_session()
        if session is None or not (dist.is_available() and dist.is_initialized()):
            return None
        return cls(session, replica_group)

    def __call__(self, event: ProbeEvent) -> None:
        session = self.session
        if session.ring is None and not session.start():
            return
        spec = BY_NAME[event.phase]
        site = callsite(2)
        now = time.time()
        index = self.ranks.index(self.rank)
        for name, tensor in zip(event.names, event.tensors, strict=True):
            group = Group(f"{event.phase}:{name}", self.ranks, index)
            rec = Record(group_name=group.name, group_ranks=self.ranks, seq=event.step,
                         op=event.phase, dtype=str(tensor.dtype).removeprefix("torch."),
                         callsite=site, step=event.step, t_enter=now, t_exit=now,
                         numel_in=tensor.numel(), numel_out=tensor.numel(),
                         out_shape=tuple(tensor.shape))
            call = Call(spec=spec, group=group, record=rec, args={}, output=tensor)
            call.out = SidePrint.take(SIDE_OUT, [[tensor.detach()]], None, hash=True,
                                      summary=True)
            rec.algo = call.out.algo
            rec.t_done = time.time()
            session.ring.submit(call)
