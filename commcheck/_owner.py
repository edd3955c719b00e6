"""The one rule for a directory commcheck keeps things in, shared by the data files
(``wire/private.py``: rings, locks, dumps, spills) and the native libraries
(``native/private.py``): it is ours or root's, and nobody else may swap its entries, that
is nobody else may write into it unless its sticky bit is set (others may then add names
but not rename or remove ours). Each side says a refusal in its own words; the rule is
here once. A leaf module: it imports nothing of commcheck (docs/design.md §1)."""

from __future__ import annotations

import os
import stat

NOT_DIR = "not a directory"
FOREIGN = "foreign owner"
OPEN = "open to others"


def dir_fault(st: os.stat_result, me: int, *, root: bool = True, sticky: bool = True) -> str:
    """Why the directory (its ``stat``) may not hold what is ``me``'s: "" when it may, else
    :data:`NOT_DIR`, :data:`FOREIGN` or :data:`OPEN`. ``root=False``: only ``me`` may own
    it; ``sticky=False``: nobody else may write into it at all, sticky bit or not (a
    folder that is ours alone)."""
    if not stat.S_ISDIR(st.st_mode):
        return NOT_DIR
    if st.st_uid != me and not (root and st.st_uid == 0):
        return FOREIGN
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (sticky and st.st_mode & stat.S_ISVTX):
        return OPEN
    return ""
