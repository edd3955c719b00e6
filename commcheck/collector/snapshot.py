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

Arrays travel out of band (pickle protocol 5): the blob is the header, ``B``, the count
and lengths of the array buffers, the pickle stream, then the buffers, joined once. Pickling
the ~25 MiB open window of a 1024-rank job in band grew the stream by reallocation and
copied every array into it: ~40 % of the dump's time, at every commit.
"""

from __future__ import annotations

import io
import pickle
import struct

from .. import __version__
from ..engine import Engine

FORMAT = 4  # 4: arrays out of band; 3: liveness and last completed calls in RankState;
# 2: typed findings, engine split
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


_OOB = b"B"  # a pickle stream starts with its PROTO opcode (0x80): never this


def dump(engine: Engine) -> bytes:
    buffers: list[pickle.PickleBuffer] = []
    stream = pickle.dumps(engine, protocol=5, buffer_callback=buffers.append)
    raw = [b.raw() for b in buffers]
    index = struct.pack(f"<I{len(raw)}Q", len(raw), *(r.nbytes for r in raw))
    return b"".join([_HEADER, _OOB, index, stream, *raw])


def _split(body: memoryview) -> tuple[memoryview, list[bytearray] | None]:
    """The pickle stream of a blob's body, and its out-of-band buffers (writable copies: the
    engine writes into its arrays); None for a stream pickled in band."""
    if body[:1] != _OOB:
        return body, None
    (count,) = struct.unpack_from("<I", body, 1)
    at = 5 + 8 * count
    lengths = struct.unpack_from(f"<{count}Q", body, 5)
    end = len(body) - sum(lengths)
    if end < at:
        raise ValueError("shorter than its buffers")
    buffers, pos = [], end
    for n in lengths:
        buffers.append(bytearray(body[pos:pos + n]))
        pos += n
    return body[at:end], buffers


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
        stream, buffers = _split(memoryview(blob)[len(_HEADER):])
        engine = _Unpickler(io.BytesIO(stream), buffers=buffers).load()
    except SnapshotError:
        raise
    except Exception as e:  # a damaged blob can fail in any of pickle's ways
        raise SnapshotError(f"damaged snapshot ({type(e).__name__}: {e})") from None
    if not isinstance(engine, Engine):
        raise SnapshotError("snapshot does not hold an engine")
    return engine
