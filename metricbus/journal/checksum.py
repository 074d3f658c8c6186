"""The journal's frame checksum: CRC-32, zlib's polynomial and values, computed by python-isal where it is installed.

``crc32(data, value=0)`` is ``zlib.crc32`` (same signature, same results: the format is unchanged). ISA-L's (``isal``,
the extra ``metricbus[fast]``, in the dev install) folds with carry-less multiplication: ~6x zlib's speed on a
commit's ~3 KB "P" frame here (77 ns against 492), which makes replay ~1.4x faster (the README's figures; in the
commit loop the difference is within the noise). Without ``isal`` the journal reads and writes the same bytes at
zlib's speed. ``IMPLEMENTATION`` says which one this process uses.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

Crc32 = Callable[..., int]


def _pick() -> tuple[Crc32, str]:
    try:
        from isal.isal_zlib import crc32 as fast
    except ImportError:  # the extra is not installed (or has no build for this platform): zlib's
        return zlib.crc32, "zlib"
    if fast(b"123456789") != zlib.crc32(b"123456789") or fast(b"9", 0xCBF43926) != zlib.crc32(b"9", 0xCBF43926):
        return zlib.crc32, "zlib"  # never seen: an isal whose crc32 is not zlib's would write unreadable frames
    return fast, "isal"


crc32: Crc32
crc32, IMPLEMENTATION = _pick()
