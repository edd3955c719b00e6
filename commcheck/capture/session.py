"""Rank-side state of one patched process: identity, groups, step, in-flight calls, sender.

``before`` runs on the training thread before the real collective (metadata, input
fingerprints — in-place ops overwrite their input), ``finish`` after it completed (fault
injection, output fingerprints, hand-off to the sender). Nothing here raises into the
caller: :meth:`Session.fail` counts and logs once.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..config import Config
from ..ops import OpSpec, Split
from ..transport import FileSink, Sender, ZmqSink, dump_path
from ..wire import (
    F_ASYNC,
    F_IN_HASH,
    F_IN_SUMMARY,
    F_INJECTED,
    F_OUT_HASH,
    F_OUT_SUMMARY,
    NO_ROOT,
    SIDE_IN,
    SIDE_OUT,
    BatchBuilder,
    Record,
)
from . import inject
from .callsite import callsite
from .groups import Group, Groups
from .prints import SidePrint

log = logging.getLogger("commcheck")


def resolve_run_id(cfg: Config, env: dict[str, str]) -> str:
    run = cfg.run_id or env.get("TORCHELASTIC_RUN_ID", "")
    if not run or run == "none":
        run = f"{env.get('MASTER_ADDR', 'local')}:{env.get('MASTER_PORT', '0')}"
    restarts = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return run if restarts in ("", "0") else f"{run}#restart{restarts}"


def _split(t: torch.Tensor | list[torch.Tensor], how: Split, n: int) -> list[torch.Tensor]:
    if how is Split.LIST:
        return list(t)
    if how is Split.FLAT:
        return list(t.reshape(-1).chunk(n)) if t.numel() else [t]
    return [t]


def _owners(how: Split, group: Group, root: int) -> list[int] | None:
    if how is Split.NONE:
        return None
    return [root] if how is Split.ROOT else group.members


@dataclass
class Call:
    """One collective in flight on this rank."""

    spec: OpSpec
    group: Group
    record: Record
    output: object
    inp: SidePrint | None = None
    out: SidePrint | None = None
    faults: list[inject.Fault] = field(default_factory=list)

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
        return r


class Session:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.faults = inject.parse(cfg.inject)
        self.groups = Groups()
        self.step = 0
        self.errors = 0
        self.not_checked = 0
        self.sender: Sender | None = None
        self.injector: inject.Injector | None = None
        self.rank = -1
        self._unwaited: weakref.WeakSet = weakref.WeakSet()

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> bool:
        """Open the channel once the default group exists; safe to call repeatedly."""
        if self.sender is not None:
            return True
        if not self.cfg.enabled_output or not (dist.is_available() and dist.is_initialized()):
            return False
        env = dict(os.environ)
        self.rank = dist.get_rank()
        world = dist.get_world_size()
        run = resolve_run_id(self.cfg, env)
        host = self.cfg.host or socket.gethostname()
        node = int(env.get("GROUP_RANK", "-1") or -1)
        builder = BatchBuilder(run, self.rank, host, world, node)
        if self.cfg.collector:
            sink = ZmqSink(self.cfg.collector)
        elif self.cfg.dump_dir:
            sink = FileSink(dump_path(self.cfg.dump_dir, run, self.rank))
        else:
            return False
        self.injector = inject.Injector(self.faults, self.rank)
        self.sender = Sender(builder, sink, self.cfg.batch_records, self.cfg.flush_interval,
                             self.cfg.queue_records)
        self.sender.start()
        return True

    def stop(self) -> None:
        """Finish what completed, say goodbye, deliver. Called at destroy and at exit."""
        sender, self.sender = self.sender, None
        if sender is None:
            return
        for work in list(self._unwaited):
            try:
                work.finish_if_completed()
            except Exception as e:
                self.fail(e)
        sender.counters["internal_errors"] = self.errors
        sender.counters["not_checked"] = self.not_checked
        sender.close(self.cfg.linger)

    def fail(self, exc: BaseException) -> None:
        self.errors += 1
        if self.errors == 1:
            log.warning("commcheck: internal error (counted, training unaffected): %r", exc)

    def on_step(self) -> None:
        self.step += 1

    # -- per call --------------------------------------------------------------------------

    def before(self, spec: OpSpec, args: dict) -> Call | None:
        if self.sender is None and not self.start():
            return None
        group = self.groups.resolve(args.get("group"))
        if group is None:
            return None
        pg = args.get("group") or c10d._get_default_group()
        inp, out = args.get(spec.input), args.get(spec.output)
        first = inp[0] if isinstance(inp, (list, tuple)) else inp
        if pg in c10d._world.pg_coalesce_state or not isinstance(first, torch.Tensor) or \
                torch.overrides.has_torch_function((first,)):
            self.not_checked += 1
            return None
        rec = Record(
            group_name=group.name, group_ranks=group.ranks, seq=group.take_seq(),
            op=spec.name, dtype=str(first.dtype).removeprefix("torch."),
            callsite=callsite(3) if self.cfg.callsite else "", step=self.step,
            t_enter=time.time(), in_shape=tuple(first.shape),
        )
        if isinstance(out, torch.Tensor):
            rec.out_shape = tuple(out.shape)
        elif isinstance(out, (list, tuple)) and out:
            rec.out_shape = (len(out), *out[0].shape)
        rec.numel_in = sum(t.numel() for t in inp) if isinstance(inp, (list, tuple)) \
            else first.numel()
        rec.numel_out = sum(t.numel() for t in out) if isinstance(out, (list, tuple)) \
            else out.numel()
        if spec.reduce_arg:
            op = args.get(spec.reduce_arg, dist.ReduceOp.SUM)
            rec.redop = getattr(op, "name", None) or str(op).rsplit(".", 1)[-1]
        root = self._root(spec, args, group)
        rec.root = root
        call = Call(spec, group, rec, out)
        call.faults = self.injector.count(spec.name) if self.injector else []
        hash_in = self.cfg.hash and (spec.hash_input or self.cfg.hash_reduce_inputs)
        # A broadcast receiver's input is about to be overwritten: nothing to fingerprint.
        meaningful = not spec.input_on_root_only or root == self.rank
        if meaningful and (hash_in or self.cfg.summary):
            call.inp = SidePrint.take(SIDE_IN, _split(inp, spec.input_split, group.size),
                                      _owners(spec.input_split, group, root), hash=hash_in,
                                      summary=self.cfg.summary)
            rec.algo = call.inp.algo
        return call

    def _root(self, spec: OpSpec, args: dict, group: Group) -> int:
        if spec.root_arg and args.get(spec.root_arg) is not None:
            return int(args[spec.root_arg])
        if spec.group_root_arg and args.get(spec.group_root_arg) is not None:
            by_group = {g: r for r, g in group.global_to_group.items()}
            return by_group[int(args[spec.group_root_arg])]
        return NO_ROOT

    def after(self, call: Call, result: object, async_op: bool) -> object:
        call.record.t_exit = time.time()
        if async_op and isinstance(result, dist.Work):
            from .work import TrackedWork

            call.record.flags |= F_ASYNC
            tracked = TrackedWork(result, lambda: self.finish(call))
            self._unwaited.add(tracked)
            return tracked
        self.finish(call)
        return result

    def finish(self, call: Call) -> None:
        try:
            rec, spec = call.record, call.spec
            outs = _split(call.output, spec.output_split, call.group.size)
            for fault in call.faults:
                inject.Injector.apply(fault, outs, call.group.rank_in_group)
                rec.flags |= F_INJECTED
            summarize = self.cfg.summary and spec.summarize_output
            written = not spec.output_on_root_only or rec.root == self.rank
            if written and (self.cfg.hash or summarize):
                call.out = SidePrint.take(SIDE_OUT, outs,
                                          _owners(spec.output_split, call.group, rec.root),
                                          hash=self.cfg.hash, summary=summarize)
                rec.algo = rec.algo or call.out.algo
            rec.t_done = time.time()
            if self.sender is not None:
                self.sender.submit(call)
        except Exception as e:
            self.fail(e)
