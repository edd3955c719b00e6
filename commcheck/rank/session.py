"""Rank-side state of one patched process: identity, groups, step, in-flight calls, and
the ring its records are written to.

``before`` runs on the training thread before the real collective (pre-call faults,
metadata, the entry record — written to the ring before the call — input fingerprints:
in-place ops overwrite their input), ``finish`` after it completed (post-call faults,
output fingerprints, the completion record into the ring). The node's relay ships the ring
(:mod:`commcheck.rank.ring`). Nothing here raises into the caller: :meth:`Session.fail`
counts and logs once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..wire import (
    F_ASYNC,
    F_IN_HASH,
    F_IN_SUMMARY,
    F_INJECTED,
    F_OUT_HASH,
    F_OUT_SUMMARY,
    F_REJECTED,
    MAX_ERROR_LEN,
    NO_ROOT,
    PHASE_ENTRY,
    SIDE_IN,
    SIDE_OUT,
    Record,
)
from ..wire.ops import BY_NAME, P2P, RESULT, OpSpec, dtype_name, redop_name
from ..wire.ring import Identity, RingError, destination, proc_start_time
from . import inject
from .bypass import Tally, describe
from .callsite import callsite
from .config import Config
from .cut import owners, shape, tensors, units
from .groups import Group, Groups
from .hotpath import HotPath
from .prints import SidePrint
from .relay_launch import relay_settings
from .ring import RingWriter

log = logging.getLogger("commcheck")

# Ops that c10d itself queues (instead of issuing) inside a ``_coalescing_manager`` block.
COALESCED_IN_PYTHON = frozenset({"all_reduce", "all_gather_single", "reduce_scatter_single"})
# A backend's source location leading its message: "[.../gloo/transport/tcp/pair.cc:553] "
_SOURCE_AT = re.compile(r"^\[[^\]\s]*:\d+\]\s*")
# callsite ← _entry_record ← _open_call ← before ← the wrapper ← the user's frame
_USER_FRAME = 5


class Skip:
    """``before`` asks the wrapper not to call the collective at all (``skip`` fault)."""


SKIP = Skip()


def resolve_run_id(cfg: Config, env: dict[str, str]) -> str:
    run = cfg.run_id or env.get("TORCHELASTIC_RUN_ID", "")
    if not run or run == "none":
        run = f"{env.get('MASTER_ADDR', 'local')}:{env.get('MASTER_PORT', '0')}"
    restarts = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return run if restarts in ("", "0") else f"{run}#restart{restarts}"


def _input_arg(spec: OpSpec, args: dict) -> object:
    return args.get(spec.input) if spec.input else None


def _output_arg(spec: OpSpec, args: dict) -> object:
    """The output argument; None where the output is the returned value."""
    return args.get(spec.output) if spec.output and spec.output != RESULT else None


def _first_tensor(spec: OpSpec, args: dict) -> torch.Tensor | None:
    """The call's first tensor, input side first (its dtype is the call's)."""
    inp = _input_arg(spec, args)
    if isinstance(inp, torch.Tensor):
        return inp
    found = tensors(inp) or tensors(_output_arg(spec, args))
    return found[0] if found else None


def _measure(x: object) -> tuple[tuple[int, ...], int, torch.Tensor | None]:
    """(shape, total numel, first tensor) of an argument, cheaply for a lone tensor."""
    if isinstance(x, torch.Tensor):
        return tuple(x.shape), x.numel(), x
    found = tensors(x)
    return shape(x), sum(t.numel() for t in found), found[0] if found else None


def error_text(exc: BaseException) -> str:
    """"Type: first line of the message", without a backend's leading source location,
    at most ``MAX_ERROR_LEN`` characters: what the report says a crashed rank raised."""
    lines = str(exc).strip().splitlines()
    first = _SOURCE_AT.sub("", lines[0]).strip() if lines else ""
    error = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return error if len(error) <= MAX_ERROR_LEN else error[:MAX_ERROR_LEN - 1] + "…"


class _Ready:
    """An entry record: metadata only, ready at once."""

    __slots__ = ("record",)

    def __init__(self, record: Record):
        self.record = record

    def ready(self) -> bool:
        return True

    def finalize(self) -> Record:
        return self.record


@dataclass
class Block:
    """A ``_coalescing_manager`` block: calls in it complete when the block's work does."""

    device: object = None
    calls: list[Call] = field(default_factory=list)


@dataclass(slots=True)
class Call:
    """One collective in flight on this rank."""

    spec: OpSpec
    group: Group | None  # None: a receive from any source, resolved at completion
    record: Record
    args: dict
    output: object
    counterpart: int = NO_ROOT  # root, or the p2p peer
    pg_group: Group | None = None
    inp: SidePrint | None = None
    out: SidePrint | None = None
    faults: list[inject.Fault] = field(default_factory=list)
    block: Block | None = None
    source: Callable[[], int] | None = None  # global source rank of an any-source receive

    def ready(self) -> bool:
        return (self.inp is None or self.inp.ready()) and (self.out is None or self.out.ready())

    def finalize(self) -> Record:
        r = self.record
        for side in (self.inp, self.out):
            if side is None:
                continue
            h, s, chunks = side.resolve()
            if side.side == SIDE_IN:
                r.in_hash, r.in_summary = h, s
                r.flags |= (F_IN_HASH if side.hashed else 0) | \
                    (F_IN_SUMMARY if side.summarized else 0)
            else:
                r.out_hash, r.out_summary = h, s
                r.flags |= (F_OUT_HASH if side.hashed else 0) | \
                    (F_OUT_SUMMARY if side.summarized else 0)
            r.chunks.extend(chunks)
        self.output = None
        self.args = {}
        return r


class Session:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.faults = inject.parse(cfg.inject)
        self.groups = Groups()
        self.tally = Tally()
        self.step = 0
        self.errors = 0
        self.not_checked = 0
        self.not_checked_by: dict[str, int] = {}  # reason -> calls (where one is known)
        self.ring: RingWriter | None = None  # where records leave the rank, once started
        self.injector: inject.Injector | None = None
        self.rank = -1
        self.blocks: dict[object, Block] = {}
        self._unwaited: weakref.WeakSet = weakref.WeakSet()
        self._stop_hooks: list[Callable[[], None]] = []
        self._goodbye_hooks: list[Callable[[dict[str, int]], None]] = []
        self.hotpath = HotPath(self)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> bool:
        """Open the ring once the default group exists; safe to call repeatedly."""
        if self.ring is not None:
            return True
        if not self.cfg.enabled_output or not (dist.is_available() and dist.is_initialized()):
            return False
        env = dict(os.environ)
        self.rank = dist.get_rank()
        cfg = self.cfg
        run = resolve_run_id(cfg, env)
        node = int(env.get("GROUP_RANK", "-1") or -1)
        local_world = int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
        pid = os.getpid()
        ident = Identity(run=run, rank=self.rank, host=cfg.host or socket.gethostname(),
                         world=dist.get_world_size(), node=node, pid=pid,
                         dest=destination(cfg.collector, cfg.dump_dir),
                         local_rank=int(env.get("LOCAL_RANK", "-1") or -1),
                         local_world=local_world, pid_start=proc_start_time(pid) or 0)
        relay = relay_settings(cfg, run, node, local_world)
        try:
            writer = RingWriter.create(cfg.ring_dir, ident, cfg.ring_bytes, relay,
                                       cfg.queue_records)
        except (OSError, RingError) as e:
            log.warning("commcheck: cannot create the record ring in %s: %s; nothing is "
                        "recorded", cfg.ring_dir or "/dev/shm", e)
            self.cfg = dataclasses.replace(cfg, collector="", dump_dir="")
            return False
        self.injector = inject.Injector(self.faults, self.rank)
        self.ring = writer
        writer.start()
        return True

    def on_stop(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` at stop, before the goodbye (e.g. to count what never completed)."""
        self._stop_hooks.append(hook)

    def on_goodbye(self, hook: Callable[[dict[str, int]], None]) -> None:
        """Run ``hook(counters)`` at stop with the goodbye's counters, to add to them."""
        self._goodbye_hooks.append(hook)

    def stop(self, at_exit: bool = False) -> None:
        """Finish what completed, say goodbye (with how the process is ending: ``at_exit``
        from the exit handlers, else from ``destroy_process_group``), deliver."""
        ring, self.ring = self.ring, None
        if ring is None:
            return
        ring.at_exit = at_exit
        for work in list(self._unwaited):
            try:
                work.finish_if_completed()
            except Exception as e:
                self.fail(e)
        for hook in self._stop_hooks:
            try:
                hook()
            except Exception as e:
                self.fail(e)
        for hook in self._goodbye_hooks:
            try:
                hook(ring.counters)
            except Exception as e:
                self.fail(e)
        ring.counters["internal_errors"] = self.errors
        ring.counters["not_checked"] = self.not_checked
        ring.counters["hotpath"] = self.hotpath.calls
        ring.counters["hotpath_overlapped"] = self.hotpath.overlapped
        ring.counters["hotpath_express"] = self.hotpath.express_calls
        for reason, n in self.not_checked_by.items():
            ring.counters[f"not_checked:{reason}"] = n
        if self.not_checked_by:
            log.warning("commcheck: rank %d: %d calls were not checked (%s)", self.rank,
                        self.not_checked, ", ".join(f"{k}: {v}" for k, v in
                                                    self.not_checked_by.items()))
        try:
            unseen = self.tally.unseen()
        except Exception as e:
            self.fail(e)
            unseen = {}
        ring.counters["bypassed"] = sum(unseen.values())
        own = self.tally.ddp_own()
        for name, n in unseen.items():
            ring.counters[f"bypassed:{name}"] = n
            if own.get(name):
                ring.counters[f"bypassed_ddp:{name}"] = min(n, own[name])
        if unseen:
            log.warning("commcheck: rank %d: %s", self.rank, describe(unseen, own))
        ring.close(self.cfg.linger)

    def skipped(self, reason: str) -> None:
        """A call the wrappers saw and cannot check, counted with its reason."""
        self.not_checked += 1
        self.not_checked_by[reason] = self.not_checked_by.get(reason, 0) + 1

    def reject_record(self, rec: Record, group: Group, grown: int | None,
                      exc: BaseException) -> None:
        """:meth:`reject` for a call the hot path recorded (it keeps no Call)."""
        self.reject(Call(None, group, rec, {}, None), grown, exc)  # type: ignore[arg-type]

    def reject(self, call: Call, grown: int | None, exc: BaseException | None = None) -> None:
        """The real call raised ``exc``. ``grown == 0``: torch rejected it before its
        backend saw any work, so no peer waits in it: close the entry with a rejected,
        fingerprint-free record (the engine compares nothing of it) and count it. Otherwise
        (work was issued, or unknown) the entry stays, as for a rank that failed inside a
        collective, and the error is said (:meth:`failed`)."""
        try:
            if grown != 0:
                if exc is not None:
                    self.failed(call, exc)
                return
            if call.group is None:
                return
            rec = call.record
            call.inp = call.out = None
            call.block = None
            rec.flags |= F_REJECTED
            rec.t_exit = rec.t_done = time.time()
            self.skipped("rejected")
            if self.ring is not None:
                self.ring.submit(call)
        except Exception as e:
            self.fail(e)

    def failed(self, call: Call, exc: BaseException) -> None:
        """The call raised ``exc`` after torch accepted it (a peer died under it, a
        timeout): its type and the first line of its message go to the collector, so the
        report says this rank crashed in it rather than waits in it."""
        try:
            if call.group is None or self.ring is None or not isinstance(exc, Exception):
                return
            self.ring.write_failure(call.record, error_text(exc))
        except Exception as e:
            self.fail(e)

    def fail(self, exc: BaseException) -> None:
        self.errors += 1
        if self.errors == 1:
            log.warning("commcheck: internal error (counted, training unaffected): %r", exc)

    def on_step(self) -> None:
        self.step += 1

    # -- per call --------------------------------------------------------------------------

    def before(self, spec: OpSpec, args: dict) -> Call | Skip | None:
        """Record the entry of a call; None: not recorded, SKIP: a ``skip`` fault."""
        if self.ring is None and not self.start():
            return None
        pg = args.get("group") or c10d._get_default_group()
        pg_group = self._checkable_group(spec, args, pg)
        if pg_group is None:
            return None
        faults = self.injector.count(spec.name) if self.injector else []
        injected = False
        if faults:
            args, injected = self._inject_before(spec, args, faults)
            if args is SKIP:
                return SKIP
        call = self._open_call(spec, args, pg, pg_group, faults)
        if call is None:
            return None
        if injected:
            call.record.flags |= F_INJECTED
        self._send_entry(call, faults)
        self._fingerprint_input(call)
        return call

    def _checkable_group(self, spec: OpSpec, args: dict, pg: object) -> Group | None:
        """The call's process group; None (counted) for what cannot be checked."""
        first = _first_tensor(spec, args)
        if first is not None and torch.overrides.has_torch_function((first,)):
            self.not_checked += 1  # tensor subclasses (DTensor)
            return None
        if first is not None and first.is_cuda and torch.cuda.is_current_stream_capturing():
            self.skipped("cuda_graph_capture")  # replays run no Python: never recorded
            return None
        if first is not None and first.layout is not torch.strided:
            self.skipped("sparse")  # sparse and other layouts have no flat bytes to hash
            return None
        pg_group = self.groups.resolve(pg)
        if pg_group is not None and pg not in self.blocks and \
                pg in c10d._world.pg_coalesce_state:
            self.not_checked += 1  # a block opened through an unpatched _coalescing_manager
            return None
        return pg_group

    def _inject_before(self, spec: OpSpec, args: dict,
                       faults: list[inject.Fault]) -> tuple[dict | Skip, bool]:
        """Pre-call faults: SKIP, or the arguments to call with and whether one applied."""
        injected = False
        for fault in faults:
            if fault.kind == "skip":
                return SKIP, injected
            first = _first_tensor(spec, args)
            if fault.kind == "nan" and first is not None:
                inject.Injector.poison(fault, first)
                injected = True
            elif fault.kind == "shape" and isinstance(args.get(spec.input), torch.Tensor):
                args = dict(args)
                args[spec.input] = inject.Injector.narrow(args[spec.input])
                if spec.in_place:
                    args[spec.output] = args[spec.input]
                injected = True
        return args, injected

    def _open_call(self, spec: OpSpec, args: dict, pg: object, pg_group: Group,
                   faults: list[inject.Fault]) -> Call | None:
        """Key the call (its group, or for p2p its directed pair) and start its record."""
        counterpart = self._root(spec, args, pg_group)
        group: Group | None = pg_group
        if spec.p2p is not P2P.NONE:
            group = self.pair(spec, pg, counterpart, int(args.get("tag") or 0))
            if group is None and counterpart != NO_ROOT:
                self.not_checked += 1  # a message to oneself: nobody to compare with
                return None
        call = Call(spec, group, self._entry_record(spec, args, group, counterpart), args,
                    _output_arg(spec, args), counterpart, pg_group,
                    faults=[f for f in faults if not f.before] if faults else [])
        block = self.blocks.get(pg)
        if block is not None and (block.device is not None or spec.name in COALESCED_IN_PYTHON):
            call.block = block
        return call

    def _entry_record(self, spec: OpSpec, args: dict, group: Group | None,
                      counterpart: int) -> Record:
        """The record as the call enters: key, metadata and shapes; no fingerprints yet."""
        inp, out = _input_arg(spec, args), _output_arg(spec, args)
        in_shape, numel_in, first = _measure(inp)
        out_shape, numel_out, first_out = _measure(out)
        first = first if first is not None else first_out
        rec = Record(
            group_name=group.name if group else "", group_ranks=group.ranks if group else (),
            seq=group.take_seq() if group else 0, op=spec.name,
            dtype=dtype_name(first.dtype) if first is not None else "",
            callsite=callsite(_USER_FRAME) if self.cfg.callsite else "", step=self.step,
            t_enter=time.time(), in_shape=in_shape, out_shape=out_shape,
            numel_in=numel_in, numel_out=numel_out,
        )
        self._describe_arguments(rec, spec, args, counterpart)
        return rec

    @staticmethod
    def _describe_arguments(rec: Record, spec: OpSpec, args: dict, counterpart: int) -> None:
        """What the arguments say beyond the tensors: reduction, root or peer, split sizes."""
        if spec.reduce_arg:
            rec.redop = redop_name(args.get(spec.reduce_arg) or dist.ReduceOp.SUM)
        if spec.p2p is P2P.NONE:
            rec.root = counterpart
        else:
            rec.peer = counterpart
        if spec.input_sizes and args.get(spec.input_sizes):
            rec.in_splits = tuple(int(x) for x in args[spec.input_sizes])
        if spec.output_sizes and args.get(spec.output_sizes):
            rec.out_splits = tuple(int(x) for x in args[spec.output_sizes])

    def _send_entry(self, call: Call, faults: list[inject.Fault]) -> None:
        """Ship the entry record now: a rank that hangs in the call leaves its entry behind."""
        if call.group is None or self.ring is None:
            return
        rec = call.record  # no fingerprints or chunks yet: encoded as the entry in place
        phase, rec.phase = rec.phase, PHASE_ENTRY
        try:
            self.ring.write_record(rec)
        finally:
            rec.phase = phase
        if any(f.kind == "shape" for f in faults):
            # The mismatched call may abort the process (gloo does): give the relay
            # time to deliver the entry record, as a hung rank's would be.
            time.sleep(max(0.25, 3 * self.cfg.flush_interval))

    def _fingerprint_input(self, call: Call) -> None:
        spec, group = call.spec, call.group or call.pg_group
        inp = _input_arg(spec, call.args)
        if not (isinstance(inp, torch.Tensor) or tensors(inp)):
            return
        hash_in = self.cfg.hash and (spec.hash_input or self.cfg.hash_reduce_inputs)
        # A broadcast receiver's input is about to be overwritten: nothing to fingerprint.
        meaningful = not spec.input_on_root_only or call.counterpart == self.rank
        if not meaningful or not (hash_in or self.cfg.summary):
            return
        dim = int(call.args.get(spec.input_dim) or 0) if spec.input_dim else 0
        parts = units(inp, spec.input_split, group.size, dim, call.record.in_splits)
        call.inp = SidePrint.take(SIDE_IN, parts,
                                  owners(spec.input_split, group, call.counterpart),
                                  hash=hash_in, summary=self.cfg.summary)
        call.record.algo = call.inp.algo

    def _root(self, spec: OpSpec, args: dict, group: Group) -> int:
        """Global rank of the root (or p2p peer) the caller named; NO_ROOT if none."""
        if spec.root_arg and args.get(spec.root_arg) is not None:
            return int(args[spec.root_arg])
        if spec.group_root_arg and args.get(spec.group_root_arg) is not None:
            return group.members[int(args[spec.group_root_arg])]
        return NO_ROOT if spec.root_default is None else spec.root_default

    def pair(self, spec: OpSpec, pg: object, peer: int, tag: int) -> Group | None:
        """The directed-pair group of a p2p call; None for a self message or unknown peer."""
        if peer == NO_ROOT or peer == self.rank:
            return None
        src, dst = (self.rank, peer) if spec.p2p is P2P.SEND else (peer, self.rank)
        return self.groups.pair(src, dst, self._channel(pg, tag))

    def _channel(self, pg: object, tag: int) -> str:
        channel = f"#tag{tag}" if tag else ""
        if pg is not c10d._get_default_group():
            channel += f"@{pg.group_name}"  # type: ignore[attr-defined]
        return channel

    def after(self, call: Call, result: object) -> object:
        """Called with the real result; returns what the caller gets (same value/Work)."""
        call.record.t_exit = time.time()
        if call.block is not None:  # the output exists when the block ends
            call.block.calls.append(call)
            return result
        if isinstance(result, dist.Work):
            return self._finish_at_wait(call, result)
        if isinstance(result, torch._C.Future):  # async coalesced ops return futures
            return self._finish_with_future(call, result)
        if call.group is None and isinstance(result, int):
            call.source = lambda: result  # a receive from any source returns its sender
        self.finish(call)
        return result

    def _finish_at_wait(self, call: Call, work: dist.Work) -> dist.Work:
        """A Work that behaves like ``work`` and finishes the call when it completes."""
        from .work import TrackedWork

        call.record.flags |= F_ASYNC
        if call.group is None:
            call.source = lambda: call.pg_group.members[work._source_rank()]
        tracked = TrackedWork(work, lambda: self.finish(call), lambda e: self.failed(call, e))
        self._unwaited.add(tracked)
        return tracked

    def _finish_with_future(self, call: Call, fut: torch.futures.Future) -> torch.futures.Future:
        """``fut`` chained with finishing the call; the chained future has the same value."""
        call.record.flags |= F_ASYNC

        def finished(done: torch.futures.Future) -> object:
            value = done.value()
            self.finish(call)
            return value

        return fut.then(finished)

    def _resolve_source(self, call: Call) -> bool:
        """An any-source receive learns its sender at completion; key it now."""
        src = call.source() if call.source is not None else NO_ROOT
        pg = call.args.get("group") or c10d._get_default_group()
        call.group = self.pair(call.spec, pg, src, int(call.args.get("tag") or 0))
        if call.group is None:
            self.not_checked += 1
            return False
        rec = call.record
        rec.group_name, rec.group_ranks = call.group.name, call.group.ranks
        rec.seq, rec.peer, call.counterpart = call.group.take_seq(), src, src
        return True

    def finish(self, call: Call) -> None:
        try:
            rec, spec = call.record, call.spec
            if call.group is None and not self._resolve_source(call):
                return
            written = not spec.output_on_root_only or call.counterpart == self.rank
            if written and tensors(call.output):
                self._fingerprint_output(call)
            rec.t_done = time.time()
            if self.ring is not None:
                self.ring.submit(call)
        except Exception as e:
            self.fail(e)

    def _fingerprint_output(self, call: Call) -> None:
        rec, spec, group = call.record, call.spec, call.group
        dim = int(call.args.get(spec.output_dim) or 0) if spec.output_dim else 0
        parts = units(call.output, spec.output_split, group.size, dim, rec.out_splits)
        for fault in call.faults:
            inject.Injector.apply(fault, [u[0] for u in parts if u], group.rank_in_group)
            rec.flags |= F_INJECTED
        summarize = self.cfg.summary and spec.summarize_output
        if self.cfg.hash or summarize:
            call.out = SidePrint.take(SIDE_OUT, parts,
                                      owners(spec.output_split, group, call.counterpart),
                                      hash=self.cfg.hash, summary=summarize)
            rec.algo = rec.algo or call.out.algo

    # -- records of no collective -----------------------------------------------------------

    def check_replicas(self, op: str, step: int, ranks: tuple[int, ...],
                       named: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """Each ``(name, tensor)`` as one completed record that every rank of ``ranks`` must
        hold bit-identical, keyed (``<op>:<name>``, ``ranks``, ``step``) and fingerprinted
        like a collective's output, so that the engine's vote names a diverging replica: the
        gradient probe's live check (``op`` ``grad`` or ``param``). False where nothing was
        recorded (no ring, or an error, counted)."""
        try:
            if self.ring is None and not self.start():
                return False
            spec = BY_NAME[op]
            site = callsite(3)  # the caller's caller: the probe's hook
            now = time.time()
            index = ranks.index(self.rank)
            for name, tensor in named:
                group = Group(f"{op}:{name}", ranks, index)
                rec = Record(group_name=group.name, group_ranks=ranks, seq=step, op=op,
                             dtype=dtype_name(tensor.dtype), callsite=site, step=step,
                             t_enter=now, t_exit=now, numel_in=tensor.numel(),
                             numel_out=tensor.numel(), out_shape=tuple(tensor.shape))
                call = Call(spec=spec, group=group, record=rec, args={}, output=tensor)
                call.out = SidePrint.take(SIDE_OUT, [[tensor.detach()]], None, hash=True,
                                          summary=True)
                rec.algo = call.out.algo
                rec.t_done = time.time()
                self.ring.submit(call)
            return True
        except Exception as e:
            self.fail(e)
            return False

    # -- coalescing blocks -----------------------------------------------------------------

    def open_block(self, pg: object, device: object) -> None:
        self.blocks[pg] = Block(device)

    def close_block(self, pg: object, works: list | None) -> None:
        """The block ended: finish its calls now, or when its (async) work completes."""
        block = self.blocks.pop(pg, None)
        if block is None or not block.calls:
            return
        calls = block.calls

        def finish_all() -> None:
            for call in calls:
                self.finish(call)

        if works:
            from .work import TrackedWork

            for call in calls:
                call.record.flags |= F_ASYNC
            tracked = TrackedWork(works[-1], finish_all)
            self._unwaited.add(tracked)
            works[-1] = tracked
        else:
            finish_all()

    def drop_block(self, pg: object) -> None:
        """The block raised: its calls never ran as recorded; count them."""
        block = self.blocks.pop(pg, None)
        if block is not None:
            self.not_checked += len(block.calls)
