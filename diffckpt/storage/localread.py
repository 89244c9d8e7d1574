"""Reading part of a local file straight into memory that is already where the bytes belong.

A restore reads a base's tensors into the live parameters and optimizer state
(:mod:`diffckpt.basereads`): read into a buffer and then copied, every byte would cross memory
twice, and the copy would hold the GIL. ``preadv`` reads into the destination itself, with the
GIL released, so several reads run at once while the replay thread works.
"""

from __future__ import annotations

import os

__all__ = ["read_file_into"]


def read_file_into(path: str, start: int, out: memoryview) -> int:
    """Read bytes ``[start, start + len(out))`` of the file at ``path`` into ``out``; return how
    many were read (fewer where the file ends first). Short reads are continued."""
    out = out.cast("B") if out.format != "B" or out.ndim != 1 else out
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        done = 0
        while done < out.nbytes:
            if hasattr(os, "preadv"):
                n = os.preadv(fd, [out[done:]], start + done)
            else:  # no preadv (macOS before 11): read, then copy in
                data = os.pread(fd, out.nbytes - done, start + done)
                out[done : done + len(data)] = data
                n = len(data)
            if n == 0:
                break
            done += n
        return done
    finally:
        os.close(fd)
