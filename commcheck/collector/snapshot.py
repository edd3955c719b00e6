"""The collector's restart point: its engine, pickled into the database at every commit.

A restarted collector (or ``commcheck analyze`` on a collector database) loads the engine
as it was at the last commit instead of replaying every message body ever delivered. The
snapshot is bounded by the open window (the fast path's tables keep only rows in use); the
bodies grew with the run (~230 bytes a record, kept forever) and writing them cost ~40 % of
the collector's ingest time.

Only commcheck's own classes, a few containers and numpy's array reconstruction may be
loaded (:class:`_Unpickler`): a database handed over by someone else cannot make
``commcheck analyze`` run code. A snapshot written by another commcheck version is refused
with one line; the engine's layout is not a stable format.
"""

from __future__ import annotations

import io
import pickle

from .. import __version__
from ..engine import Engine

FORMAT = 3  # 3: liveness and last completed calls in RankState; 2: typed findings, engine split
_HEADER = f"commcheck-snapshot {FORMAT} {__version__}\n".encode()

_ALLOWED = {
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "dict"),
    ("builtins", "list"), ("builtins", "tuple"), ("builtins", "float"), ("builtins", "int"),
    ("collections", "Counter"), ("collections", "OrderedDict"),
    ("collections", "defaultdict"), ("collections", "deque"), ("copyreg", "_reconstructor"),
    ("builtins", "object"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy._core.numeric", "_frombuffer"), ("numpy.core.numeric", "_frombuffer"),
    # rebuild(cls, fields) = cls(**fields): how msgspec pickles keyword-only Structs (the
    # engine's findings and their details); cls itself passes find_class
    ("msgspec._utils", "rebuild"),
}


class SnapshotError(Exception):
    pass


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):  # noqa: ANN201 - pickle's signature
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module.startswith("commcheck.engine.") or module.startswith("numpy.dtypes"):
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        raise SnapshotError(f"snapshot refers to {module}.{name}, which a snapshot may not "
                            f"load")


def dump(engine: Engine) -> bytes:
    return _HEADER + pickle.dumps(engine, protocol=5)


def load(blob: bytes) -> Engine:
    """The engine of ``blob``; :class:`SnapshotError` with one line if it cannot be used."""
    head, _, body = bytes(blob[:200]).partition(b"\n")
    if not head.startswith(b"commcheck-snapshot "):
        raise SnapshotError("not a commcheck engine snapshot")
    if head + b"\n" != _HEADER:
        theirs = head.decode(errors="replace").split(" ", 1)[1]
        raise SnapshotError(f"snapshot written by commcheck (format, version) {theirs}; this "
                            f"is {FORMAT} {__version__}: use a new --db, or the same "
                            f"commcheck version")
    try:
        engine = _Unpickler(io.BytesIO(memoryview(blob)[len(_HEADER):])).load()
    except SnapshotError:
        raise
    except Exception as e:  # a damaged blob can fail in any of pickle's ways
        raise SnapshotError(f"damaged snapshot ({type(e).__name__}: {e})") from None
    if not isinstance(engine, Engine):
        raise SnapshotError("snapshot does not hold an engine")
    return engine
