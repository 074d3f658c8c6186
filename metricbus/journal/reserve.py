"""Disk blocks reserved ahead of a journal file's end, so a commit's ``write`` does not allocate them.

On Linux, ``fallocate(fd, FALLOC_FL_KEEP_SIZE, end, CHUNK_BYTES)`` allocates the next ``CHUNK_BYTES`` past the
end of the file without changing its size: readers see exactly the frames written, and a crash leaves no zeros to
tell from a torn frame (only allocated blocks past the end, which the next writer's close frees). A commit's
``write`` into reserved blocks skips ext4's delayed-allocation bookkeeping: 2.00 µs against 2.25 µs for a 2.9 KB
append on this machine (``/tmp/wprobe4.py``, 20,000 writes, four runs). :func:`trim` frees what is left past the
end at close.

Elsewhere (another OS, a libc without ``fallocate``, a file system that refuses it) nothing is reserved and the
journal writes as before; so does a writer that could not lock its file (a file system without ``flock``): it could
not trim what it reserved (another writer may be appending), so those blocks would stay allocated for good.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable

CHUNK_BYTES = 4 << 20  # reserved at a time: one fallocate per ~1,400 commits of 2.9 KB
_KEEP_SIZE = 0x01  # FALLOC_FL_KEEP_SIZE (linux/falloc.h)

Reserve = Callable[[int, int, int], bool]  # (fd, offset, length) -> whether the blocks are reserved


@functools.cache
def reserver() -> Reserve | None:
    """The function that reserves blocks past a file's end, or None where this platform has none (loaded on the
    first journal's open, not at import)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
    except (ImportError, OSError):  # a Python built without ctypes (libffi), or no C library to load
        return None
    # 64-bit offsets: fallocate64 (glibc, 32-bit builds included); else fallocate where off_t is 64-bit (musl,
    # 64-bit glibc); a 32-bit off_t would misread the arguments
    fallocate = getattr(libc, "fallocate64", None)
    if fallocate is None:
        fallocate = getattr(libc, "fallocate", None)
        if fallocate is None or ctypes.sizeof(ctypes.c_long) < 8:
            return None
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fallocate.restype = ctypes.c_int

    def reserve(fd: int, offset: int, length: int) -> bool:
        return bool(fallocate(fd, _KEEP_SIZE, offset, length) == 0)

    return reserve


def trim(fd: int) -> None:
    """Free the blocks reserved past the end of the file (a truncation to its own size; best effort). Only for a
    writer holding the file's lock: another writer's append between the size read and the truncation would be cut."""
    with contextlib.suppress(OSError):  # else only space past the end stays allocated; a next writer's close frees it
        os.ftruncate(fd, os.fstat(fd).st_size)
