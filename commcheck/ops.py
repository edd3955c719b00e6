"""The op vocabulary shared by both sides of the wire.

Each wrapped collective is described declaratively: which argument is read, which is
written, how outputs split into per-rank chunks, and which arguments name the reduce op
and the root. Adding an op is adding an :class:`OpSpec` to ``OPS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Family(str, Enum):
    """What the engine may assume about an op's outputs."""

    REPLICATED = "replicated"  # every rank ends with the same output (all_reduce, broadcast)
    GATHERED = "gathered"  # output chunk j is what group rank j sent
    REDUCE_SCATTERED = "reduce_scattered"  # output = sum over ranks of input chunk (own rank)


class Split(str, Enum):
    """How a tensor argument is cut into per-rank chunks (for pairwise checks)."""

    NONE = "none"  # one tensor, no chunks
    LIST = "list"  # a list of tensors, one per group rank
    FLAT = "flat"  # one tensor, cut into group-size equal pieces of its flat bytes


@dataclass(frozen=True)
class OpSpec:
    name: str  # canonical op name, recorded on the wire
    family: Family
    input: str  # argument name of what the op reads
    output: str  # argument name of what the op writes
    input_split: Split = Split.NONE
    output_split: Split = Split.NONE
    reduce_arg: str | None = None
    root_arg: str | None = None  # global rank argument
    group_root_arg: str | None = None  # group-rank alternative (group_src / group_dst)
    aliases: tuple[str, ...] = ()  # deprecated names that call this op's function
    # What is worth computing (DESIGN.md §2 "what each op costs"): inputs of in-place
    # reductions need sums, not hashes; outputs need sums only where a reduction is checked.
    hash_input: bool = True
    summarize_output: bool = False

    @property
    def in_place(self) -> bool:
        return self.input == self.output


OPS: tuple[OpSpec, ...] = (
    OpSpec("all_reduce", Family.REPLICATED, "tensor", "tensor", reduce_arg="op",
           hash_input=False, summarize_output=True),
    OpSpec("broadcast", Family.REPLICATED, "tensor", "tensor", root_arg="src",
           group_root_arg="group_src"),
    OpSpec("all_gather", Family.GATHERED, "tensor", "tensor_list", output_split=Split.LIST),
    OpSpec("all_gather_single", Family.GATHERED, "input_tensor", "output_tensor",
           output_split=Split.FLAT, aliases=("all_gather_into_tensor",)),
    OpSpec("reduce_scatter_single", Family.REDUCE_SCATTERED, "input", "output",
           input_split=Split.FLAT, reduce_arg="op", aliases=("reduce_scatter_tensor",),
           hash_input=False, summarize_output=True),
)

BY_NAME: dict[str, OpSpec] = {n: s for s in OPS for n in (s.name, *s.aliases)}
