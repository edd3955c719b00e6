"""Setting attributes on torch modules so that every change can be undone, and cheap binding
of call arguments to parameter names."""

from __future__ import annotations

import inspect
from collections.abc import Callable


def binder(orig: Callable, names: tuple[str, ...] = ()) -> Callable[[tuple, dict],
                                                                     dict | None]:
    """A cheap ``inspect.Signature.bind`` for plain positional-or-keyword signatures:
    ``orig``'s, or the parameter ``names`` given (torch's own, where ``orig`` may be a shim
    whose signature says nothing); then only the arguments passed are bound.

    Returns None for calls the real function will reject anyway; those pass through.
    """
    if names:
        params: dict = dict.fromkeys(names)
        defaults: dict = {}
    else:
        params = dict(inspect.signature(orig).parameters)
        names = tuple(params)
        defaults = {k: p.default for k, p in params.items() if p.default is not p.empty}

    def bind(args: tuple, kwargs: dict) -> dict | None:
        if len(args) > len(names) or not kwargs.keys() <= params.keys():
            return None
        bound = dict(defaults)
        bound.update(zip(names, args, strict=False))
        bound.update(kwargs)
        return bound

    return bind


class Installer:
    """Remembers every attribute it replaced (and any other change it is told how to undo),
    so :meth:`undo` puts the originals back."""

    def __init__(self) -> None:
        self.saved: list[tuple[object, str, object]] = []
        self.undos: list[Callable[[], object]] = []

    def set(self, obj: object, name: str, value: object) -> None:
        # A class keeps its own attribute as stored (a pybind method's descriptor: getattr
        # would give the unbound builtin, which restored would no longer bind ``self``).
        own = vars(obj).get(name) if isinstance(obj, type) else None
        self.saved.append((obj, name, own if own is not None else getattr(obj, name)))
        setattr(obj, name, value)

    def defer(self, undo: Callable[[], object]) -> None:
        """Have :meth:`undo` also call ``undo`` (a change that is not an attribute)."""
        self.undos.append(undo)

    def undo(self) -> None:
        for obj, name, value in reversed(self.saved):
            setattr(obj, name, value)
        self.saved.clear()
        while self.undos:
            self.undos.pop()()
