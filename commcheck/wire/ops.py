"""The op vocabulary shared by both sides of the wire.

Each wrapped collective is described declaratively: which argument is read, which is
written, how each side is cut into per-rank chunks, which arguments name the reduce op, the
root or the peer, and which invariants the engine may check. Adding an op is adding an
:class:`OpSpec` to a table; the capture side and the engine both read it.

``OPS`` are functions of ``torch.distributed.distributed_c10d`` (patched there and on
``torch.distributed``); ``FUNCOL_OPS`` are functions of
``torch.distributed._functional_collectives`` recorded under the canonical name of the c10d
op with the same semantics; ``HOOK_OPS`` are recorded by commcheck's own hooks (DDP).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Split(str, Enum):
    """How one side of a call is cut into per-rank chunks (for pairwise checks)."""

    NONE = "none"  # one tensor, no chunks
    LIST = "list"  # a list of tensors, one per group rank
    # one tensor cut into group-size pieces along a dim (``*_dim`` argument, default 0), or
    # along dim 0 by a split-size argument (``*_sizes``) when the caller passed one
    FLAT = "flat"
    ROOT = "root"  # exchanged with one rank (root or p2p peer): a single chunk it owns
    MANY = "many"  # a list of independent tensors (coalesced ops): one unit, no chunks
    LISTS = "lists"  # a list (per group rank) of lists (one per coalesced tensor)


class Reduction(str, Enum):
    """Which output is the reduction of which inputs (for the float64 checksum)."""

    NONE = "none"
    ALL = "all"  # every rank's output = reduction of every rank's whole input
    ROOT = "root"  # the root's output = reduction of every rank's whole input
    SCATTER = "scatter"  # rank i's output = reduction of every rank's input chunk for i


class P2P(str, Enum):
    NONE = "none"
    SEND = "send"
    RECV = "recv"


RESULT = "<result>"  # ``output`` of functional collectives: the returned tensor

# Entry-record fields every member of a collective must agree on (desync), by default. An
# op's ``agree`` holds only what torch itself requires its ranks to agree on.
AGREE_ALL = ("op", "dtype", "numel_in", "numel_out", "redop", "root", "in_splits",
             "out_splits")


@dataclass(frozen=True)
class OpSpec:
    name: str  # canonical op name, recorded on the wire
    input: str  # argument name of what the op reads ("" for metadata-only ops)
    output: str  # argument name of what the op writes, or RESULT
    input_split: Split = Split.NONE
    output_split: Split = Split.NONE
    replicated: bool = False  # every rank ends with bit-identical output
    reduction: Reduction = Reduction.NONE
    reduce_arg: str | None = None
    root_arg: str | None = None  # global rank argument (root, or peer for p2p)
    group_root_arg: str | None = None  # group-rank alternative (group_src / group_dst)
    root_default: int | None = None  # global root when neither argument is given
    input_on_root_only: bool = False  # only the root's input is read (broadcast, scatter)
    output_on_root_only: bool = False  # only the root's output is written (gather, reduce)
    input_sizes: str | None = None  # split-size argument cutting a FLAT input along dim 0
    output_sizes: str | None = None
    input_dim: str | None = None  # dim argument a FLAT input is cut along
    output_dim: str | None = None
    p2p: P2P = P2P.NONE
    aliases: tuple[str, ...] = ()  # other names of the same function (deprecated, async)
    # What is worth computing: inputs of in-place reductions need sums, not hashes;
    # outputs need sums only where a reduction is checked.
    hash_input: bool = True
    summarize_output: bool = False
    mismatch_kind: str = "value_mismatch"  # finding kind when replicated outputs differ (a
    #                                        commcheck.engine.Kind value; wire/ imports no engine)
    # Entry-record fields that must be equal on every member (see AGREE_ALL); ops whose
    # sides legitimately differ per rank (root-only lists, uneven splits, p2p) agree on less.
    agree: tuple[str, ...] = AGREE_ALL
    # torch's own parameters, in order: calls are bound by these whatever object the name
    # holds when patched (a ``(*args, **kwargs)`` shim hides the real signature)
    params: tuple[str, ...] = ()

    @property
    def in_place(self) -> bool:
        return self.input == self.output


_NO_OUT = tuple(f for f in AGREE_ALL if f != "numel_out")
_NO_IN = tuple(f for f in AGREE_ALL if f != "numel_in")
_UNEVEN = ("op", "dtype", "redop", "root")  # per-rank sizes may differ (all_to_all)
_P2P = ("dtype",)  # sender and receiver: numel_in of one is numel_out of the other

OPS: tuple[OpSpec, ...] = (
    OpSpec("all_reduce", "tensor", "tensor", replicated=True, reduction=Reduction.ALL,
           reduce_arg="op", hash_input=False, summarize_output=True,
           params=('tensor', 'op', 'group', 'async_op')),
    OpSpec("broadcast", "tensor", "tensor", output_split=Split.ROOT, replicated=True,
           root_arg="src", group_root_arg="group_src", input_on_root_only=True,
           params=('tensor', 'src', 'group', 'async_op', 'group_src')),
    OpSpec("reduce", "tensor", "tensor", reduction=Reduction.ROOT, reduce_arg="op",
           root_arg="dst", group_root_arg="group_dst", output_on_root_only=True,
           hash_input=False, summarize_output=True,
           params=('tensor', 'dst', 'op', 'group', 'async_op', 'group_dst')),
    # Uneven all_gather (NCCL): each rank's input is its own slot of the common output list.
    OpSpec("all_gather", "tensor", "tensor_list", output_split=Split.LIST, replicated=True,
           agree=_NO_IN, params=('tensor_list', 'tensor', 'group', 'async_op')),
    OpSpec("all_gather_single", "input_tensor", "output_tensor", output_split=Split.FLAT,
           replicated=True, aliases=("all_gather_into_tensor", "_all_gather_base"),
           params=('output_tensor', 'input_tensor', 'group', 'async_op')),
    OpSpec("gather", "tensor", "gather_list", input_split=Split.ROOT,
           output_split=Split.LIST, root_arg="dst", group_root_arg="group_dst",
           root_default=0, output_on_root_only=True, agree=_NO_OUT,
           params=('tensor', 'gather_list', 'dst', 'group', 'async_op', 'group_dst')),
    OpSpec("scatter", "scatter_list", "tensor", input_split=Split.LIST,
           output_split=Split.ROOT, root_arg="src", group_root_arg="group_src",
           root_default=0, input_on_root_only=True, agree=_NO_IN,
           params=('tensor', 'scatter_list', 'src', 'group', 'async_op', 'group_src')),
    OpSpec("reduce_scatter_single", "input", "output", input_split=Split.FLAT,
           reduction=Reduction.SCATTER, reduce_arg="op",
           aliases=("reduce_scatter_tensor", "_reduce_scatter_base"),
           hash_input=False, summarize_output=True,
           params=('output', 'input', 'op', 'group', 'async_op')),
    # Rank i's output is slot i of the input lists, which every rank shapes alike: outputs
    # may differ in size between ranks (uneven slots), inputs may not.
    OpSpec("reduce_scatter", "input_list", "output", input_split=Split.LIST,
           reduction=Reduction.SCATTER, reduce_arg="op", hash_input=False,
           summarize_output=True, agree=_NO_OUT,
           params=('output', 'input_list', 'op', 'group', 'async_op')),
    OpSpec("all_to_all", "input_tensor_list", "output_tensor_list", input_split=Split.LIST,
           output_split=Split.LIST, agree=_UNEVEN,
           params=('output_tensor_list', 'input_tensor_list', 'group', 'async_op')),
    OpSpec("all_to_all_single", "input", "output", input_split=Split.FLAT,
           output_split=Split.FLAT, input_sizes="input_split_sizes",
           output_sizes="output_split_sizes", agree=_UNEVEN,
           params=('output', 'input', 'output_split_sizes', 'input_split_sizes',
                   'group', 'async_op')),
    OpSpec("all_reduce_coalesced", "tensors", "tensors", input_split=Split.MANY,
           output_split=Split.MANY, replicated=True, reduction=Reduction.ALL,
           reduce_arg="op", hash_input=False, summarize_output=True,
           params=('tensors', 'op', 'group', 'async_op')),
    OpSpec("all_gather_coalesced", "input_tensor_list", "output_tensor_lists",
           input_split=Split.MANY, output_split=Split.LISTS, replicated=True,
           params=('output_tensor_lists', 'input_tensor_list', 'group', 'async_op')),
    OpSpec("send", "tensor", "", root_arg="dst", group_root_arg="group_dst", p2p=P2P.SEND,
           aliases=("isend",), agree=_P2P,
           params=('tensor', 'dst', 'group', 'tag', 'group_dst')),
    OpSpec("recv", "", "tensor", output_split=Split.ROOT, root_arg="src",
           group_root_arg="group_src", p2p=P2P.RECV, aliases=("irecv",), agree=_P2P,
           params=('tensor', 'src', 'group', 'tag', 'group_src')),
    OpSpec("barrier", "", "",
           params=('group', 'async_op', 'device_ids', 'timeout')),
    OpSpec("monitored_barrier", "", "",
           params=('group', 'timeout', 'wait_all_ranks')),
)

FUNCOL_OPS: tuple[OpSpec, ...] = (
    OpSpec("all_reduce", "self", RESULT, replicated=True, reduction=Reduction.ALL,
           reduce_arg="reduceOp", summarize_output=True, hash_input=False),
    OpSpec("broadcast", "self", RESULT, output_split=Split.ROOT, replicated=True,
           group_root_arg="src", input_on_root_only=True),
    OpSpec("all_gather_single", "self", RESULT, output_split=Split.FLAT, replicated=True,
           output_dim="gather_dim",
           aliases=("all_gather_tensor", "all_gather_single_autograd",
                    "all_gather_tensor_autograd")),
    OpSpec("reduce_scatter_single", "self", RESULT, input_split=Split.FLAT,
           reduction=Reduction.SCATTER, reduce_arg="reduceOp", input_dim="scatter_dim",
           hash_input=False, summarize_output=True,
           aliases=("reduce_scatter_tensor", "reduce_scatter_single_autograd",
                    "reduce_scatter_tensor_autograd")),
    OpSpec("all_to_all_single", "self", RESULT, input_split=Split.FLAT,
           output_split=Split.FLAT, input_sizes="input_split_sizes",
           output_sizes="output_split_sizes", aliases=("all_to_all_single_autograd",),
           agree=_UNEVEN),
    # Coalesced functional ops take and return lists. Gathered and scattered lists carry no
    # per-rank chunks here, so they are checked as replicated (gather) or for agreement and
    # NaN/Inf only (reduce-scatter); all_reduce keeps its reduction check.
    OpSpec("all_reduce_coalesced", "self", RESULT, input_split=Split.MANY,
           output_split=Split.MANY, replicated=True, reduction=Reduction.ALL,
           reduce_arg="reduceOp", hash_input=False, summarize_output=True),
    OpSpec("all_gather_single_coalesced", "self", RESULT, input_split=Split.MANY,
           output_split=Split.MANY, replicated=True,
           aliases=("all_gather_into_tensor_coalesced",)),
    OpSpec("reduce_scatter_single_coalesced", "inputs", RESULT, input_split=Split.MANY,
           output_split=Split.MANY, reduce_arg="reduceOp", hash_input=False,
           aliases=("reduce_scatter_tensor_coalesced",)),
)

# The reduction ops a ``ddp_bucket`` record names when its hook is one of torch's averaging
# hooks (rank/ddp.py, hook_numerics): the mean, and the dtype the hook compressed the
# bucket to on the way (None: none). Such a record carries its input's and output's sums.
HOOK_REDOPS: dict[str, str | None] = {"AVG": None, "AVG_FP16": "float16",
                                      "AVG_BF16": "bfloat16"}

HOOK_OPS: tuple[OpSpec, ...] = (
    # DDP's default numerics (divide by world size, then sum) for one gradient bucket.
    OpSpec("ddp_allreduce", "tensor", "tensor", replicated=True, reduction=Reduction.ALL,
           reduce_arg="op", hash_input=False, summarize_output=True),
    # A bucket reduced by the user's own comm hook: only its result is known to agree.
    OpSpec("ddp_bucket", "", "tensor", replicated=True),
    # DDP's used-parameter map (find_unused_parameters), all-reduced by the reducer in C++
    # after the last bucket: read back once reduced, it must agree across replicas.
    OpSpec("ddp_used_map", "", "tensor", replicated=True),
    # DDP's module buffers, broadcast from one rank before (or after) the forward pass.
    OpSpec("ddp_buffers", "", "tensors", output_split=Split.MANY, replicated=True),
    # The gradient probe's live check: each parameter's gradient after data-parallel
    # reduction, and the parameter after the step, must agree across replicas.
    OpSpec("grad", "", "grad", replicated=True, summarize_output=True,
           mismatch_kind="grad_divergence"),
    OpSpec("param", "", "param", replicated=True, summarize_output=True,
           mismatch_kind="param_divergence"),
)

# c10d specs win where a functional op is recorded under the c10d name (same semantics).
BY_NAME: dict[str, OpSpec] = {n: s for s in (*FUNCOL_OPS, *HOOK_OPS, *OPS)
                              for n in (s.name, *s.aliases)}


_DTYPE_NAMES: dict[object, str] = {}


def dtype_name(dtype: object) -> str:
    """A tensor dtype as records name it ("float32", "bfloat16", ...); cached per dtype
    (every recorded call asks)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def redop_name(op: object) -> str:
    """A reduction as records name it ("SUM", "MAX", ...): a ``ReduceOp``/``RedOpType``, or a
    functional collective's string."""
    if isinstance(op, str):  # functional collectives: "sum", "avg", ...
        return op.upper()
    return getattr(op, "name", None) or str(op).rsplit(".", 1)[-1]
