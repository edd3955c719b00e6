"""The probe's live cross-replica check: gradients and parameters as replicated records.

After data-parallel reduction every replica must hold bit-identical gradients, and after
the step bit-identical parameters. Each selected parameter becomes one record per step and
phase, keyed by (``grad:<name>`` or ``param:<name>``, replica ranks, step), fingerprinted
like a collective's output and sent through the rank's commcheck channel; the engine's
majority vote then names the diverging rank, parameter and step (``grad_divergence``,
``param_divergence``), and NaN/Inf in a gradient becomes a ``nan_inf`` naming it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ..rank.runtime import active_session
from .events import ProbeEvent

if TYPE_CHECKING:
    from ..rank.session import Session


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

    @classmethod
    def for_active_session(cls, replica_group: Any = None) -> LiveCheck | None:
        session = active_session()
        if session is None or not (dist.is_available() and dist.is_initialized()):
            return None
        return cls(session, replica_group)

    def __call__(self, event: ProbeEvent) -> None:
        self.session.check_replicas(event.phase, event.step, self.ranks,
                                    list(zip(event.names, event.tensors, strict=True)))
