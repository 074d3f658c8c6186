"""Whether a rank file that already holds bytes can take a writer's appends.

It can when it starts with metricbus's magic (or one the reader forgives: at most two damaged bytes) and its first
header is of a format this metricbus writes. Anything else (a foreign file under a journal's name, a journal
written by a newer metricbus) is refused before the first commit: appended to, it would return commits that no
reader can read back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from metricbus.errors import JournalError
from metricbus.journal.checksum import crc32
from metricbus.journal.format import FRAME, MAGIC
from metricbus.journal.scan import UnreadableError, check_header, check_magic

_HEADER_LIMIT = 1 << 20  # a header frame is JSON of a run's identity and rules: far below this


def check_appendable(fd: int, path: Path, size: int) -> None:
    """Raise JournalError when the file ``path`` (open as ``fd``, ``size`` bytes, at least the magic's) is not one
    a writer may append to (see the module docstring). A first header that cannot be read (damage) passes: the
    reader skips it, and the header the writer appends makes the file readable."""
    try:
        check_magic(path, os.pread(fd, len(MAGIC), 0))
    except UnreadableError as exc:
        raise JournalError(
            f"{exc}; a bus appends only to its own journal files: move that file away, or give this bus another "
            "journal directory"
        ) from None
    at = len(MAGIC)
    for _ in range(2):  # the header, then its copy
        head = os.pread(fd, FRAME.size, at)
        if len(head) < FRAME.size:
            return
        length, crc = FRAME.unpack(head)
        if length > min(_HEADER_LIMIT, size - at - FRAME.size):
            return
        payload = os.pread(fd, length, at + FRAME.size)
        at += FRAME.size + length
        if crc32(payload) != crc or payload[:1] != b"H":
            continue
        try:
            header = json.loads(payload[1:])
        except ValueError:
            continue
        try:
            check_header(path, header)
        except TypeError:
            continue
        except JournalError as exc:
            raise JournalError(f"{exc}; this metricbus cannot append to it either") from None
        return
