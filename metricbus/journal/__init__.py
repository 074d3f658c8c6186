"""The journal: every commit's micro-level summaries, appended durably per rank, readable by any later version.

Layout: a directory; rank ``r`` writes ``rank-{r:05d}.mbj`` (a single-controller bus writes every worker's
partials into its own file, each entry tagged with the worker's rank), locked by its one writer, whose PID is in
``rank-{r:05d}.mbj.lock``. Delivery cursors live in ``cursors/``.

One concept per module: :mod:`~metricbus.journal.format` (the bytes), :mod:`~metricbus.journal.writer`,
:mod:`~metricbus.journal.reader` (``read_journal`` in memory, ``stream_journal`` a commit at a time) and
:mod:`~metricbus.journal.cursors`.
"""

from __future__ import annotations

from metricbus.errors import JournalWarning
from metricbus.journal.cursors import CursorStore, adapter_key
from metricbus.journal.format import (
    FORMAT_VERSION,
    FSYNC_INTERVAL_S,
    FSYNC_MODES,
    MAGIC,
    SUFFIX,
    check_fsync,
    lock_file,
    rank_file,
    run_from_json,
    run_to_json,
    spec_from_json,
    spec_to_json,
)
from metricbus.journal.reader import (
    Commit,
    Gap,
    Journal,
    JournalStream,
    RankFile,
    RawPart,
    read_journal,
    read_rank_file,
    stream_journal,
)
from metricbus.journal.writer import JournalWriter, open_journal

__all__ = [
    "FORMAT_VERSION",
    "FSYNC_INTERVAL_S",
    "FSYNC_MODES",
    "MAGIC",
    "SUFFIX",
    "Commit",
    "CursorStore",
    "Gap",
    "Journal",
    "JournalStream",
    "JournalWarning",
    "JournalWriter",
    "RankFile",
    "RawPart",
    "adapter_key",
    "check_fsync",
    "lock_file",
    "open_journal",
    "rank_file",
    "read_journal",
    "read_rank_file",
    "run_from_json",
    "run_to_json",
    "spec_from_json",
    "spec_to_json",
    "stream_journal",
]
