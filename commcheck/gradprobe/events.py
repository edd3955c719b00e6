"""What the probe hands to a sink (the live cross-replica check, or a user's callable)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class ProbeEvent:
    """What a ``sink`` sees: live tensors of one optimizer step, on the training thread.

    ``phase="grad"`` fires in the step pre-hook with the gradients (``main_grad`` if present),
    ``phase="param"`` in the post-hook with the updated parameters. The tensors are not copies:
    a sink must fingerprint or enqueue them immediately and must not block.
    """

    phase: Literal["grad", "param"]
    step: int
    rank: int
    names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]


Sink = Callable[[ProbeEvent], None]
