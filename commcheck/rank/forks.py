"""A forked child (a DataLoader worker, say) inherits the parent's ring mapped in memory:
it must never write it. What holds such a resource registers here to let it go in the
child, without the registration keeping it alive."""

from __future__ import annotations

import os
import weakref
from typing import Protocol


class ForkSafe(Protocol):
    def forked(self) -> None: ...


def release_in_children(owner: ForkSafe) -> None:
    """Call ``owner.forked()`` in every child forked after this, while ``owner`` lives."""
    ref = weakref.ref(owner)
    pid = os.getpid()

    def after_fork() -> None:
        o = ref()
        if o is not None and os.getpid() != pid:
            o.forked()

    os.register_at_fork(after_in_child=after_fork)
