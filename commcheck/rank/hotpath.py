"""The common call in one pass: a synchronous collective on one contiguous CPU tensor.

Most calls a training step makes are the plain form (``all_reduce(t)``, ``broadcast(t,
src)``, ``all_gather_single(out, inp)``, ``reduce_scatter_single(out, inp)``, ``send``,
``recv``). For those this path writes the same two records the general sequence writes
(:mod:`.wrap` → :class:`.Session`), without its objects: no Record, Call or SidePrint, the
record kept as the list of its field values, fingerprints and ring writes by one native
call each (:mod:`commcheck.native.hot`). Anything else — async calls, faults to inject,
coalescing blocks, tensor subclasses, device or strided tensors, an unknown group, a large
summarised piece that is not float32 (see :func:`_pieces_ok`) — returns :data:`SLOW` before
doing any work, and the general sequence runs. A large input that the call does not write
(all_gather's, reduce_scatter's) is fingerprinted while the collective runs
(:func:`_overlapped`). ``tests/integration/test_hotpath.py`` pins that both paths write the
same records.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..native import hot as native_hot
from ..native.loader import FP_CODES
from ..wire import (
    F_IN_HASH,
    F_IN_SUMMARY,
    F_OUT_HASH,
    F_OUT_SUMMARY,
    NO_ROOT,
    PHASE_COMPLETE,
    PHASE_ENTRY,
    SIDE_IN,
    SIDE_OUT,
    Record,
)
from ..wire.ops import OpSpec, dtype_name, redop_name
from ..wire.ring import FIELD_INDEX
from . import guard
from .callsite import site_at, tables
from .fingerprint import _SMALL, ALGO_XXH3, fingerprint_cpu

if TYPE_CHECKING:
    from .bypass import Seen, Tally
    from .config import Config
    from .groups import Group, Groups
    from .inject import Fault, Injector
    from .ring import RingWriter

# "not this path": from a prepare, the general sequence runs the call; from an Express
# call, this path's prepare and run do
SLOW = object()
LEARN = 8  # calls in a row that must give the backend the same work before it is assumed
FAST_OPS = frozenset({"all_reduce", "broadcast", "all_gather", "all_gather_single",
                      "reduce_scatter_single", "send", "recv"})
# the ops native/express.c takes, by its kinds
EXPRESS = {"all_reduce": 0, "broadcast": 1, "all_gather_single": 2, "reduce_scatter_single": 3,
           "all_gather": 4}
_TENSOR = torch.Tensor
_ZERO_HASH = (0, 0)
_ZERO_SUMMARY = (0.0, 0.0, 0, 0)
# callsite ← the op's path ← the wrapper ← the user's frame
_USER_FRAME = 3
# indices into a record's field values (commcheck.wire.Record's order)
(_SEQ, _ALGO, _FLAGS, _T_EXIT, _T_DONE, _IN_HASH, _OUT_HASH, _IN_SUMMARY, _OUT_SUMMARY,
 _CHUNKS, _PHASE) = (FIELD_INDEX[f] for f in (
     "seq", "algo", "flags", "t_exit", "t_done", "in_hash", "out_hash", "in_summary",
     "out_summary", "chunks", "phase"))


def _even_list(outs: object, inp: torch.Tensor, size: int) -> bool:
    """all_gather's output list as the path takes it: one plain tensor per member, each of
    the input's dtype and shape (uneven lists, which NCCL allows, take the general path)."""
    if type(outs) is not list or len(outs) != size:
        return False
    dtype, shape = inp.dtype, inp.shape
    for o in outs:  # noqa: SIM110 (all() over a generator costs 0.3 µs a call here)
        if not (_plain(o) and o.dtype == dtype and o.shape == shape):
            return False
    return True


def _put_input(v: list, inp: tuple | None, hash_in: bool, summ: bool) -> int:
    """The input side's fingerprint into the record's values; its flags (0 without one)."""
    if inp is None:
        return 0
    v[_IN_HASH], v[_IN_SUMMARY] = inp
    v[_ALGO] = ALGO_XXH3 if hash_in else ""
    return (F_IN_HASH if hash_in else 0) | (F_IN_SUMMARY if summ else 0)


def _entry(group: Group, op: str, dtype: str, redop: str, root: int, callsite: str,
           numel_in: int, numel_out: int, in_shape: tuple, out_shape: tuple, step: int,
           t_enter: float, peer: int = -1) -> list:
    """An entry record's field values, in ``wire.Record``'s order (the one place this path
    spells it; ``tests/unit/test_record_layout.py`` holds it to the Record), with the
    group's next sequence number."""
    values = [group.name, group.ranks, 0, op, dtype, redop, root, "", callsite, 0,
              numel_in, numel_out, in_shape, out_shape, step, t_enter, 0.0, 0.0, _ZERO_HASH,
              _ZERO_HASH, _ZERO_SUMMARY, _ZERO_SUMMARY, [], PHASE_ENTRY, peer, (), ()]
    values[_SEQ] = group.take_seq()
    return values


def _input_taker(gather: bool, side: Callable, pieces: Callable) -> Callable:
    """``take(taken, inp, members, hash, summary)``: a gather's input side (one fingerprint)
    or a reduce_scatter's (one per destination's piece) into ``taken`` as (hash, summary),
    chunks."""
    if gather:
        def take(taken: list, inp_t: torch.Tensor, members: list, hash_in: bool,
                 summ: bool) -> None:
            taken[0] = side(inp_t, hash_in, summ)
    else:
        def take(taken: list, inp_t: torch.Tensor, members: list, hash_in: bool,
                 summ: bool) -> None:
            h, sm, taken[1] = pieces(inp_t, FP_CODES[inp_t.dtype], members, SIDE_IN,
                                     hash_in, summ)
            taken[0] = (h, sm)
    return take


def _pieces_ok(t: torch.Tensor, k: int, summary: bool) -> bool:
    """Whether ``t`` cut into ``k`` pieces may be fingerprinted by the native pieces call:
    always when the pieces are small or only hashed, and float32 ones of any size (the
    statistics kernel's sums, bit for bit). The general path sums a large piece of another
    dtype in torch, in another order."""
    return not summary or t.dtype is torch.float32 or -(-t.numel() // k) <= _SMALL


def _apart(inp: torch.Tensor, out: torch.Tensor | list[torch.Tensor]) -> bool:
    """Whether the input's bytes overlap none of the output's (a tensor or all_gather's
    list; all contiguous): only then may it be read while the collective writes (an
    all_gather into the buffer its input is a slice of, FSDP's way, must be read before)."""
    lo = inp.data_ptr()
    hi = lo + inp.nbytes
    for o in out if isinstance(out, list) else (out,):
        start = o.data_ptr()
        if start < hi and lo < start + o.nbytes:
            return False
    return True


def _plain(t: object) -> bool:
    """A dense, contiguous CPU tensor of a dtype the native kernel reads, not a subclass."""
    return (type(t) is _TENSOR and t.is_cpu and t.layout is torch.strided
            and t.is_contiguous() and not t.is_neg() and t.dtype in FP_CODES)


def _overlapped(orig: Callable, args: tuple, kwargs: dict, during: Callable[[], None]
                ) -> object:
    """The synchronous call as torch makes it (launch, then wait), with ``during`` run
    between the two (it must not raise: what goes wrong in it is commcheck's)."""
    work = orig(*args, **{**kwargs, "async_op": True})
    try:
        during()
    finally:
        if work is not None:  # None: this rank is not in the group (torch warned)
            work.wait()
    return None  # what the synchronous call returns


def _world_names() -> tuple[object, str, str]:
    """(c10d's world, the name of its default group, of its open coalescing blocks) for
    Express to read per call: the instance attributes behind ``GroupMember.WORLD`` and
    ``_world.pg_coalesce_state`` where this torch has them (a dict look-up, not a Python
    property's frame), else the properties."""
    world = c10d._world
    own = vars(world)
    default = "_default_pg" if own.get("_default_pg", SLOW) is c10d.GroupMember.WORLD \
        else "default_pg"
    blocks = "_pg_coalesce_state" if own.get("_pg_coalesce_state", SLOW) is \
        world.pg_coalesce_state else "pg_coalesce_state"
    return world, default, blocks


class SessionView(Protocol):
    """What this path reads of the rank's :class:`~commcheck.rank.session.Session` (which
    creates it, so it cannot name the class without a circle of imports)."""

    cfg: Config
    faults: list[Fault]
    groups: Groups
    tally: Tally
    ring: RingWriter | None
    blocks: dict
    injector: Injector | None
    step: int
    rank: int

    def pair(self, spec: OpSpec, pg: object, peer: int, tag: int) -> Group | None: ...

    def reject_record(self, rec: Record, group: Group, grown: int | None,
                      exc: BaseException) -> None: ...

    def fail(self, exc: BaseException) -> None: ...


class HotPath:
    """Per op, ``prepare(args, kwargs) -> Plan | SLOW`` (:meth:`make`), then :meth:`run`."""

    def __init__(self, session: SessionView):
        self.session = session
        self._calls = 0  # calls the Python half recorded
        self._express: list = []  # each op's native half (native_hot.module().Express)
        self.overlapped = 0  # of them, those whose input was read while the call ran
        self._redops: dict[object, str] = {}
        self._groups: dict[int, tuple[weakref.ref, Group]] = {}
        self._seen: dict[tuple[int, str], tuple[int, int]] = {}  # (works, calls in a row)
        self._works: dict[tuple[int, str], tuple[Seen, int]] = {}  # (tally entry, works)

    @property
    def calls(self) -> int:
        """Calls this path recorded, in Python or C (the goodbye's ``hotpath`` counter)."""
        return self._calls + self.express_calls

    @property
    def express_calls(self) -> int:
        """Of them, those taken whole in C (the goodbye's ``hotpath_express``)."""
        return sum(x.calls for x in self._express)

    def ready(self) -> RingWriter | None:
        """The rank's ring writer when this path may run now (it writes from C), else None."""
        s = self.session
        writer = s.ring
        if writer is None or s.blocks or not writer.native:
            return None
        return writer

    def make(self, spec: OpSpec) -> Callable | None:
        """``prepare(args, kwargs)`` for ``spec``: the plan :meth:`run` takes, or SLOW;
        None where ``spec`` has no such path."""
        if not self._takes(spec):
            return None
        if spec.p2p.value != "none":
            return self._p2p(spec)
        return self._collective(spec)

    def express(self, spec: OpSpec) -> Callable | None:
        """``call(orig, args, kwargs)``: a plain call of one tensor (all_reduce, broadcast),
        one flat pair (all_gather_single, reduce_scatter_single) or all_gather's even list
        in its steady state, taken whole in C (``native/express.c``: the same steps as
        :meth:`make`'s plan and :meth:`run`, reading the same state), else SLOW, and
        :meth:`make`'s path runs it; None where ``spec`` has no such call (another op, or
        no native module)."""
        kind = EXPRESS.get(spec.name)
        mod = native_hot.module()
        if kind is None or getattr(mod, "Express", None) is None or not self._takes(spec):
            return None
        s = self.session
        cfg = s.cfg
        reduces = spec.name in ("all_reduce", "reduce_scatter_single")
        hash_in = cfg.hash and cfg.hash_reduce_inputs if reduces else cfg.hash
        x = mod.Express(  # type: ignore[union-attr]
            kind, (spec.name, spec.input, spec.output), _SMALL,
            (hash_in, cfg.hash, cfg.summary, cfg.callsite), s,
            tuple(spec.params), frozenset(spec.params),
            {d: (code, dtype_name(d)) for d, code in FP_CODES.items()}, _TENSOR,
            torch.strided, _world_names(), self._groups, self._works, self._redops,
            redop_name(dist.ReduceOp.SUM), s.tally.local, guard._local, tables(), SLOW,
            self._raised, s.fail)
        self._express.append(x)
        return x.call

    def _takes(self, spec: OpSpec) -> bool:
        s = self.session
        return spec.name in FAST_OPS and s.cfg.hotpath and native_hot.module() is not None \
            and not any(f.op == spec.name for f in s.faults)  # the general path's to apply

    # -- pieces shared by the ops ----------------------------------------------------------

    def _redop(self, op: object) -> str:
        name = self._redops.get(op)
        if name is None:
            name = self._redops[op] = redop_name(op)
        return name

    def _group(self, pg: object) -> Group | None:
        """The Group of ``pg``, cached by id (a weakref tells a reused id apart)."""
        if c10d._world.pg_coalesce_state:
            return None  # a block opened through an unpatched _coalescing_manager
        got = self._groups.get(id(pg))
        if got is not None and got[0]() is pg:
            return got[1]
        group = self.session.groups.resolve(pg)
        if group is not None:
            self._groups[id(pg)] = (weakref.ref(pg), group)
        return group

    def run(self, orig: Callable, args: tuple, kwargs: dict, plan: tuple) -> object:
        """Entry record, the real call (covered and isolated), completion record. Only the
        real call raises into the caller."""
        pg, writer, values, finish, group, during = plan
        s = self.session
        self._calls += 1
        if during is not None:
            self.overlapped += 1
        injector = s.injector
        if injector is not None and injector.faults:  # its per-op counts name what ran
            injector.calls[values[3]] = injector.calls.get(values[3], 0) + 1
        writer.write_values(values)
        values[_PHASE] = PHASE_COMPLETE
        tally = s.tally
        key = (id(pg), values[3])
        known = self._works.get(key)
        busy = guard.isolate()
        if known is not None and known[0].ref() is pg and not tally.local.depth:
            entry = known[0]
            before = self._read(entry)  # read again only if the call raises
            try:
                result = orig(*args, **kwargs) if during is None else \
                    _overlapped(orig, args, kwargs, during)
            except BaseException as e:
                guard.restore(busy)
                self._raised(values, group, entry, before, e)
                raise
            guard.restore(busy)
            entry.covered += known[1]
        else:
            covered = tally.enter(pg)
            try:
                result = orig(*args, **kwargs) if during is None else \
                    _overlapped(orig, args, kwargs, during)
            except BaseException as e:
                guard.restore(busy)
                self._rejected(values, group, tally.leave(pg, covered), e)
                raise
            guard.restore(busy)
            self._learn(key, pg, tally.leave(pg, covered))
        try:
            values[_T_EXIT] = time.time()
            finish(values)
            values[_T_DONE] = time.time()
            writer.write_values(values)
        except Exception as e:
            s.fail(e)
        return result

    def _raised(self, values: list, group: Group, entry: Seen, before: int | None,
                exc: BaseException) -> None:
        """The real call raised on a learned group (read before it only): what it gave the
        backend, and the general sequence's handling of a call rejected (0) or failed in it.
        Express's too."""
        after = self._read(entry) if before is not None else None
        grown = None if after is None or before is None else after - before
        entry.covered += grown or 0
        self._rejected(values, group, grown, exc)

    @staticmethod
    def _read(entry: Seen) -> int | None:
        """The backend's work counter; None if it cannot be read (never raises)."""
        try:
            return entry.query()  # type: ignore[misc]  # set: only counted groups are learned
        except Exception:
            return None

    def _learn(self, key: tuple[int, str], pg: object, grown: int | None) -> None:
        """The bypass tally reads the backend's work counter around a call (two reads and
        the region's bookkeeping, ~1.5 µs). A plain call of one op on one group gives its
        backend the same number of works every time (gloo: 1; NCCL's counter skips p2p: 0),
        so once ``LEARN`` calls in a row agreed, the path reads only before the call, adds
        that number after it, and reads again only when the call raised (rejected before
        any work, or failed in it); the tally stays exact. Calls in a covered region
        (depth > 0) are the region's to count."""
        if grown is None:
            return
        seen = self._seen.get(key)
        if seen is None or seen[0] != grown:
            self._seen[key] = (grown, 1)
            return
        if seen[1] + 1 < LEARN:
            self._seen[key] = (grown, seen[1] + 1)
            return
        entry = self.session.tally.entry(pg)
        if entry is not None:
            self._works[key] = (entry, grown)

    def _rejected(self, values: list, group: Group, grown: int | None,
                  exc: BaseException) -> None:
        """The real call raised: the general sequence's handling, on a Record of it."""
        s = self.session
        try:
            rec = Record(*values[:_CHUNKS], [], *values[_CHUNKS + 1:])  # type: ignore[call-arg]
            s.reject_record(rec, group, grown, exc)
        except Exception as e:
            s.fail(e)

    def _binder(self, spec: OpSpec) -> Callable[[tuple, dict], tuple | None]:
        """``bind(args, kwargs)``: (the ring writer, the arguments by torch's parameter
        names), or None when the path may not run now or the call does not bind."""
        params, ready = tuple(spec.params), self.ready
        allowed = frozenset(params)
        native_bind = native_hot.module().bind  # type: ignore[union-attr]

        def bind(args: tuple, kwargs: dict) -> tuple | None:
            writer = ready()
            if writer is None:
                return None
            bound = native_bind(params, allowed, args, kwargs)
            return None if bound is None else (writer, bound)

        return bind

    # -- collectives -------------------------------------------------------------------------

    def _common(self, spec: OpSpec) -> tuple:
        """What every op's ``prepare`` binds once, as closure locals (no per-call lookups):
        binder, session, config, clock, GroupMember, call-site switch and function, an
        uncut side's fingerprint and the native pieces call."""
        session = self.session
        cfg = session.cfg
        mod = native_hot.module()
        assert mod is not None  # make() took no path without it
        site = site_at(_USER_FRAME, mod)  # C: adds no frame under prepare
        fp = mod.fingerprint

        def side(t: torch.Tensor, hash: bool, summary: bool):
            """An uncut side: the general path's fingerprint_cpu, in one native call when
            small."""
            if t.numel() <= _SMALL:
                return fp(t, FP_CODES[t.dtype], hash, summary)
            return fingerprint_cpu(t, hash, summary)

        return (self._binder(spec), session, cfg, time.time, c10d.GroupMember, cfg.callsite,
                site, side, mod.fingerprint_pieces)

    def _start(self, bind: Callable, world: object, args: tuple, kwargs: dict
               ) -> tuple | None:
        """(writer, bound arguments, process group, Group) of a synchronous collective this
        path may take, else None."""
        got = bind(args, kwargs)
        if got is None:
            return None
        writer, bound = got
        if bound.get("async_op"):
            return None
        pg = bound.get("group") or world.WORLD  # type: ignore[attr-defined]
        group = self._group(pg)
        return None if group is None else (writer, bound, pg, group)

    def _collective(self, spec: OpSpec) -> Callable:
        if spec.name == "all_reduce":
            return self._all_reduce(spec)
        if spec.name == "broadcast":
            return self._broadcast(spec)
        return self._gathered(spec)

    def _all_reduce(self, spec: OpSpec) -> Callable:
        name = spec.name
        bind, session, cfg, now, world, site_on, site, side, _ = self._common(spec)
        start = self._start

        def prepare(args: tuple, kwargs: dict) -> tuple | object:
            got = start(bind, world, args, kwargs)
            if got is None:
                return SLOW
            writer, bound, pg, group = got
            t = bound.get("tensor")
            if not _plain(t):
                return SLOW
            shape, n = tuple(t.shape), t.numel()
            values = _entry(group, name, dtype_name(t.dtype),
                            self._redop(bound.get("op") or dist.ReduceOp.SUM), NO_ROOT,
                            site() if site_on else "", n, n, shape, shape,
                            session.step, now())
            hash_in, summ = cfg.hash and cfg.hash_reduce_inputs, cfg.summary
            flags = (F_IN_HASH if hash_in else 0) | (F_IN_SUMMARY if summ else 0)
            # in place: the input is read before the call writes it
            inp = side(t, hash_in, summ) if hash_in or summ else None

            def finish(v: list) -> None:
                f = flags
                if inp is not None:
                    v[_IN_HASH], v[_IN_SUMMARY] = inp
                else:
                    f = 0
                if cfg.hash or summ:
                    v[_OUT_HASH], v[_OUT_SUMMARY] = side(t, cfg.hash, summ)
                    f |= (F_OUT_HASH if cfg.hash else 0) | (F_OUT_SUMMARY if summ else 0)
                    v[_ALGO] = ALGO_XXH3 if cfg.hash or hash_in else ""
                elif hash_in:
                    v[_ALGO] = ALGO_XXH3
                v[_FLAGS] = f

            return pg, writer, values, finish, group, None

        return prepare

    def _broadcast(self, spec: OpSpec) -> Callable:
        name = spec.name
        bind, session, cfg, now, world, site_on, site, side, pieces = self._common(spec)
        start = self._start

        def prepare(args: tuple, kwargs: dict) -> tuple | object:
            got = start(bind, world, args, kwargs)
            if got is None:
                return SLOW
            writer, bound, pg, group = got
            t = bound.get("tensor")
            n = t.numel() if _plain(t) else 0
            if not n:
                return SLOW
            if bound.get("src") is not None:
                root = int(bound["src"])
            elif bound.get("group_src") is not None:
                root = group.members[int(bound["group_src"])]
            else:
                return SLOW  # torch raises: the general path says so
            shape = tuple(t.shape)
            values = _entry(group, name, dtype_name(t.dtype), "", root,
                            site() if site_on else "", n, n, shape, shape,
                            session.step, now())
            hash_in, summ = cfg.hash, cfg.summary
            # in place: the root's input is read before the call
            inp = side(t, hash_in, summ) if root == session.rank and (hash_in or summ) \
                else None

            def finish(v: list) -> None:
                f = _put_input(v, inp, hash_in, summ)
                if cfg.hash:  # the output is the root's: one chunk, owned by it
                    v[_OUT_HASH], v[_OUT_SUMMARY], v[_CHUNKS] = pieces(
                        t, FP_CODES[t.dtype], [root], SIDE_OUT, True, False)
                    f |= F_OUT_HASH
                    v[_ALGO] = v[_ALGO] or ALGO_XXH3
                v[_FLAGS] = f

            return pg, writer, values, finish, group, None

        return prepare

    def _gathered(self, spec: OpSpec) -> Callable:
        """all_gather (one output tensor per rank), all_gather_single and
        reduce_scatter_single (one flat side cut per rank)."""
        name = spec.name
        bind, session, cfg, now, world, site_on, site, side, pieces = self._common(spec)
        start = self._start
        gather = name != "reduce_scatter_single"
        take_input = _input_taker(gather, side, pieces)

        def prepare(args: tuple, kwargs: dict) -> tuple | object:
            got = start(bind, world, args, kwargs)
            if got is None:
                return SLOW
            writer, bound, pg, group = got
            inp_t, out_t = bound.get(spec.input), bound.get(spec.output)
            if not _plain(inp_t):
                return SLOW
            n_in = inp_t.numel()
            if name == "all_gather":
                if not _even_list(out_t, inp_t, len(group.members)):
                    return SLOW
                n_out, out_shape = n_in * len(out_t), (len(out_t), *inp_t.shape)
            elif _plain(out_t):
                n_out, out_shape = out_t.numel(), tuple(out_t.shape)
            else:
                return SLOW
            if not n_in or not n_out or not (
                    gather or _pieces_ok(inp_t, len(group.members), cfg.summary)):
                return SLOW
            redop = "" if gather else self._redop(bound.get("op") or dist.ReduceOp.SUM)
            values = _entry(group, name, dtype_name(inp_t.dtype), redop, NO_ROOT,
                            site() if site_on else "", n_in, n_out, tuple(inp_t.shape),
                            out_shape, session.step, now())
            members = group.members
            summ = cfg.summary
            hash_in = cfg.hash if gather else cfg.hash and cfg.hash_reduce_inputs
            # the input's (hash, summary), its chunks, what failed taking them
            taken: list = [None, [], None]
            # A large input is read while the collective runs (out of place, nothing
            # writes it): on the training thread, beside gloo's, instead of before it.
            during = None
            if (hash_in or summ) and n_in > _SMALL and _apart(inp_t, out_t) and (
                    "async_op" not in bound or "async_op" in kwargs):

                def during() -> None:
                    try:
                        take_input(taken, inp_t, members, hash_in, summ)
                    except Exception as e:  # the completion record's to report
                        taken[2] = e
            elif hash_in or summ:
                take_input(taken, inp_t, members, hash_in, summ)

            def finish(v: list) -> None:
                if taken[2] is not None:
                    raise taken[2]
                f = _put_input(v, taken[0], hash_in, summ)
                chunks = taken[1]
                if gather:
                    if cfg.hash:
                        v[_OUT_HASH], v[_OUT_SUMMARY], out_chunks = pieces(
                            out_t, FP_CODES[inp_t.dtype], members, SIDE_OUT, True, False)
                        chunks = chunks + out_chunks
                        f |= F_OUT_HASH
                        v[_ALGO] = v[_ALGO] or ALGO_XXH3
                elif cfg.hash or summ:
                    v[_OUT_HASH], v[_OUT_SUMMARY] = side(out_t, cfg.hash, summ)
                    f |= (F_OUT_HASH if cfg.hash else 0) | (F_OUT_SUMMARY if summ else 0)
                    v[_ALGO] = v[_ALGO] or (ALGO_XXH3 if cfg.hash else "")
                v[_CHUNKS] = chunks
                v[_FLAGS] = f

            return pg, writer, values, finish, group, during

        return prepare

    # -- point to point ----------------------------------------------------------------------

    def _p2p(self, spec: OpSpec) -> Callable:
        name = spec.name
        bind, session, cfg, now, world, site_on, site, side, pieces = self._common(spec)
        sending = name == "send"

        def prepare(args: tuple, kwargs: dict) -> tuple | object:
            got = bind(args, kwargs)
            if got is None:
                return SLOW
            writer, bound = got
            t = bound.get("tensor")
            n = t.numel() if _plain(t) else 0
            if not n:
                return SLOW
            pg = bound.get("group") or world.WORLD
            pg_group = self._group(pg)
            if pg_group is None:
                return SLOW
            key = "dst" if sending else "src"
            if bound.get(key) is not None:
                peer = int(bound[key])
            elif bound.get(f"group_{key}") is not None:
                peer = pg_group.members[int(bound[f"group_{key}"])]
            else:
                return SLOW  # any source, or torch rejects it
            group = session.pair(spec, pg, peer, int(bound.get("tag") or 0))
            if group is None:
                return SLOW
            shape = tuple(t.shape)
            values = _entry(group, name, dtype_name(t.dtype), "", NO_ROOT,
                            site() if site_on else "", n if sending else 0,
                            0 if sending else n, shape if sending else (),
                            () if sending else shape, session.step, now(),
                            peer)
            hash_in, summ = cfg.hash, cfg.summary
            inp = side(t, hash_in, summ) if sending and (hash_in or summ) else None

            def finish(v: list) -> None:
                f = _put_input(v, inp, hash_in, summ)  # only a send has an input
                if not sending and cfg.hash:  # what arrived, owned by the sender
                    v[_OUT_HASH], v[_OUT_SUMMARY], v[_CHUNKS] = pieces(
                        t, FP_CODES[t.dtype], [peer], SIDE_OUT, True, False)
                    f = F_OUT_HASH
                    v[_ALGO] = ALGO_XXH3
                v[_FLAGS] = f

            return pg, writer, values, finish, group, None

        return prepare
