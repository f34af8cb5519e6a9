"""Reading a file that user input names (an image path in a data row, a recipe file), within bounds.

Only a regular file is read: a FIFO, a device, a directory or a socket is refused before it is opened, and again
on the open descriptor (it may have been swapped in between); the file is opened without blocking, and never more
than ``max_bytes + 1`` of it is read, whatever size it claims (``/proc`` files claim 0).
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass
class FileRefused(Exception):
    """The file is not read: ``not_a_file``, or ``too_large`` (``size``: its size or the bytes read past the bound)."""

    kind: Literal["not_a_file", "too_large"]
    size: int | None = None


def read_regular_file(path: str | Path, max_bytes: int, *, follow_symlinks: bool = True) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them; :class:`FileRefused` or the
    ``OSError`` of a file that cannot be opened or read. ``follow_symlinks=False``: a symlink at ``path`` itself
    is refused as ``not_a_file``, or as an ``OSError`` if it is swapped in after the check (for a path already
    resolved, so that a link made later is not followed)."""
    if not stat.S_ISREG(os.stat(path, follow_symlinks=follow_symlinks).st_mode):
        raise FileRefused("not_a_file")
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags if follow_symlinks else flags | getattr(os, "O_NOFOLLOW", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused("not_a_file")
        if st.st_size > max_bytes:
            raise FileRefused("too_large", st.st_size)
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise FileRefused("too_large", len(data))
    return data
