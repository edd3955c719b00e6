"""The op vocabulary shared by both sides of the wire.

Each wrapped collective is described declaratively: which argument is read, which is
written, how each side is cut into per-rank chunks, which arguments name the reduce op and
the root, and which invariants the engine may check. Adding an op is adding an
:class:`OpSpec` to ``OPS``; the capture side and the engine both read this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Split(str, Enum):
    """How a tensor argument is cut into per-rank chunks (for pairwise checks)."""

    NONE = "none"  # one tensor, no chunks
    LIST = "list"  # a list of tensors, one per group rank
    FLAT = "flat"  # one tensor, cut into group-size equal pieces of its flat bytes
    ROOT = "root"  # one tensor exchanged with the root: a single chunk owned by the root


class Reduction(str, Enum):
    """Which output is the reduction of which inputs (for the float64 checksum)."""

    NONE = "none"
    ALL = "all"  # every rank's output = reduction of every rank's whole input
    ROOT = "root"  # the root's output = reduction of every rank's whole input
    SCATTER = "scatter"  # rank i's output = reduction of every rank's input chunk for i


@dataclass(frozen=True)
class OpSpec:
    name: str  # canonical op name, recorded on the wire
    input: str  # argument name of what the op reads
    output: str  # argument name of what the op writes
    input_split: Split = Split.NONE
    output_split: Split = Split.NONE
    replicated: bool = False  # every rank ends with bit-identical output
    reduction: Reduction = Reduction.NONE
    reduce_arg: str | None = None
    root_arg: str | None = None  # global rank argument
    group_root_arg: str | None = None  # group-rank alternative (group_src / group_dst)
    input_on_root_only: bool = False  # only the root's input is read (broadcast, scatter)
    output_on_root_only: bool = False  # only the root's output is written (gather, reduce)
    aliases: tuple[str, ...] = ()  # deprecated names that call this op's function
    # What is worth computing: inputs of in-place reductions need sums, not hashes;
    # outputs need sums only where a reduction is checked.
    hash_input: bool = True
    summarize_output: bool = False

    @property
    def in_place(self) -> bool:
        return self.input == self.output


OPS: tuple[OpSpec, ...] = (
    OpSpec("all_reduce", "tensor", "tensor", replicated=True, reduction=Reduction.ALL,
           reduce_arg="op", hash_input=False, summarize_output=True),
    OpSpec("broadcast", "tensor", "tensor", output_split=Split.ROOT, replicated=True,
           root_arg="src", group_root_arg="group_src", input_on_root_only=True),
    OpSpec("all_gather", "tensor", "tensor_list", output_split=Split.LIST, replicated=True),
    OpSpec("all_gather_single", "input_tensor", "output_tensor", output_split=Split.FLAT,
           replicated=True, aliases=("all_gather_into_tensor",)),
    OpSpec("reduce_scatter_single", "input", "output", input_split=Split.FLAT,
           reduction=Reduction.SCATTER, reduce_arg="op", aliases=("reduce_scatter_tensor",),
           hash_input=False, summarize_output=True),
)

BY_NAME: dict[str, OpSpec] = {n: s for s in OPS for n in (s.name, *s.aliases)}
