"""The one wording of collectives that bypassed the wrappers, for a rank's exit line, the
live view and the report alike (from the goodbye's ``bypassed:<group>`` and
``bypassed_ddp:<group>`` counters)."""

from __future__ import annotations

from collections.abc import Mapping

DDP_OWN = ("DDP's own C++ traffic (construction: parameter check and state broadcast; "
           "bucket rebuild)")
OTHER = ("a DDP model built before patch() or with COMMCHECK_DDP=0 and not watched, "
         "functional point-to-point ops or CUDA-graph replays in compiled code, a framework "
         "that bound c10d functions before patch(), or C++/c10d torch.ops callers")


def causes(bypassed: Mapping[str, int], ddp_own: Mapping[str, int]) -> str:
    """What the bypassed collectives (by group) were, as far as the ranks could tell:
    ``ddp_own`` (by group) is the part that was DDP's own traffic."""
    total = sum(bypassed.values())
    own = sum(min(ddp_own.get(g, 0), n) for g, n in bypassed.items())
    if own >= total:
        return f"all {DDP_OWN}"
    if own:
        return f"{own} {DDP_OWN}; {total - own} from {OTHER}"
    return OTHER
