"""The one wrapper sequence every commcheck wrapper runs (DESIGN.md §3, rule 1).

For a call (:func:`wrap`)::

    step aside? → bind → Session.before → skip? → cover → real call → uncover → after

* *step aside*: under a tracer or inside another wrapped call the wrapper is only the
  original call (:mod:`.guard`).
* *bind* names the call's arguments; ``"group"`` (default: the world) is the process group
  the coverage tally (:mod:`.bypass`) counts the call on. ``None``: neither recorded nor
  covered (the real call rejects its arguments, or only the calls it makes are recorded).
* *before* records the entry (:meth:`.Session.before`); a ``skip`` fault returns what the
  site's ``skip`` hook fakes, or, where a result cannot be faked, calls through unrecorded.
* *cover*/*uncover* bracket the real call, which runs isolated (calls it makes pass through
  the wrappers) unless the site wants them recorded too (a user's DDP comm hook). A call
  that raised before its backend was given any work was rejected by torch: its entry
  record is closed as rejected (:meth:`.Session.reject`), never left dangling; one that
  raised after has its error said (:meth:`.Session.failed`), its entry left open.
* *after* takes the real result and returns what the caller gets: the same value, or a
  wrapper that behaves identically (a tracked Work, a chained future).

Each commcheck stage is guarded: an internal error is counted (:meth:`.Session.fail`,
logged once) and the call goes on, unrecorded from there. The real call is never guarded:
its result, Work, in-place effects and exceptions reach the caller unchanged. A call
adds no allocation here beyond what the hooks allocate.

A ``_coalescing_manager`` block is the same sequence around the body of a ``with``
statement instead of a call (:func:`wrap_block`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch.distributed.distributed_c10d as c10d

from ..wire.ops import OpSpec
from . import guard
from .hotpath import SLOW
from .session import SKIP, Session


def wrap(orig: Callable, session: Session, spec: OpSpec | None, *,
         bind: Callable[[tuple, dict], dict | None],
         after: Callable[[object, object], object] | None = None,
         skip: Callable[[dict], object] | None = None,
         aside: Callable[[], bool] | None = None,
         isolate: bool = True, rebind: bool = False,
         fast: Callable[[tuple, dict], object] | None = None,
         express: Callable[[Callable, tuple, dict], object] | None = None) -> Callable:
    """``orig`` wrapped in the sequence; ``spec`` None: covered, never recorded.

    ``after(call, result)`` returns what the caller gets (absent: the result itself);
    ``skip(bound)`` returns what a skipped call returns (absent: the site cannot skip, the
    call runs unrecorded); ``aside()`` True: call ``orig`` and nothing else; ``isolate``:
    calls made by ``orig`` pass through the wrappers; ``rebind``: ``bind`` names
    ``orig``'s parameters, so arguments a ``shape`` fault narrowed are passed on by keyword;
    ``fast``: the op's one-pass path (:mod:`.hotpath`), tried first; ``express``: its
    steady state in one native call, tried before that (it returns SLOW or the result).
    """
    before, tally, fail, reject = session.before, session.tally, session.fail, session.reject
    run = session.hotpath.run

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        if aside is not None and aside():
            return orig(*args, **kwargs)
        if express is not None:
            result = express(orig, args, kwargs)
            if result is not SLOW:
                return result
        if fast is not None:
            try:
                plan = fast(args, kwargs)
            except Exception as e:
                fail(e)
                plan = SLOW
            if plan is not SLOW:
                return run(orig, args, kwargs, plan)
        bound = call = None
        try:
            bound = bind(args, kwargs)
            if bound is not None and spec is not None:
                call = before(spec, bound)
                if call is SKIP:
                    call = None  # where a result cannot be faked, the call runs unrecorded
                    if skip is not None:
                        return skip(bound)
                elif rebind and call is not None and call.args is not bound:
                    args, kwargs = (), call.args  # a ``shape`` fault narrowed the input
        except Exception as e:
            fail(e)
        pg = None if bound is None else bound.get("group") or c10d.GroupMember.WORLD
        busy = guard.isolate() if isolate else None
        covered = tally.enter(pg)
        raised: BaseException | None = None
        try:
            result = orig(*args, **kwargs)
        except BaseException as e:
            raised = e
            raise
        finally:
            if isolate:
                guard.restore(busy)
            grown = tally.leave(pg, covered)
            if raised is not None and call is not None:
                reject(call, grown, raised)
            raised = None  # no cycle through this frame
        if call is None or after is None:
            return result
        try:
            return after(call, result)
        except Exception as e:
            fail(e)
            return result

    wrapper.__commcheck_original__ = orig  # type: ignore[attr-defined]
    return wrapper


def wrap_block(orig: Callable, session: Session, *, begin: Callable[..., object],
               end: Callable[[object, object], None],
               drop: Callable[[object], None]) -> Callable:
    """The sequence around a ``with`` block that ``orig`` (a context manager) opens.

    ``begin(*args, **kwargs)`` starts the block and returns its process group (None: not
    tracked); ``end(pg, cm)`` runs when the block ended, ``drop(pg)`` when its body or
    ``orig`` raised. Calls in the body are recorded by their own wrappers; the whole block
    is one covered region.
    """
    tally, fail = session.tally, session.fail

    @contextlib.contextmanager
    @functools.wraps(orig)
    def wrapper(*args, **kwargs) -> Iterator:
        pg = None
        try:
            pg = begin(*args, **kwargs)
        except Exception as e:
            fail(e)
        covered = tally.enter(pg)
        try:
            with orig(*args, **kwargs) as cm:
                yield cm
        except BaseException:
            _guarded(session, drop, pg)
            raise
        finally:
            tally.leave(pg, covered)
        _guarded(session, end, pg, cm)

    wrapper.__commcheck_original__ = orig  # type: ignore[attr-defined]
    return wrapper


def _guarded(session: Session, stage: Callable, pg: object, *args: object) -> None:
    """Run a block's closing stage for a tracked block; count what it raises."""
    if pg is None:
        return
    try:
        stage(pg, *args)
    except Exception as e:
        session.fail(e)
