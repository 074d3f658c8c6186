"""The journal's CRC-32 (``metricbus.journal.checksum``): zlib's values whichever implementation computes them, and
the same journal files with either."""

from __future__ import annotations

import importlib.util
import sys
import zlib
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metricbus.journal import checksum, compact, format, frames, read_journal
from metricbus.replay import emitted
from tests.test_journal_hot_columns import run


def fresh_checksum(monkeypatch: pytest.MonkeyPatch, *, isal: bool) -> ModuleType:
    """The checksum module loaded anew, with ``isal`` importable or not (the installed one is left as it is)."""
    if not isal:
        monkeypatch.setitem(sys.modules, "isal", None)  # an import of it raises ImportError
        monkeypatch.setitem(sys.modules, "isal.isal_zlib", None)
    spec = importlib.util.spec_from_file_location("checksum_probe", checksum.__file__)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dev_install_has_the_fast_one() -> None:
    """The dev install (the extra "fast") gives ISA-L's, so the tests run the journal as users of the extra do."""
    assert checksum.IMPLEMENTATION == "isal"
    assert checksum.crc32 is not zlib.crc32


def test_without_isal_it_is_zlibs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the extra, zlib's own, with nothing else changed."""
    module = fresh_checksum(monkeypatch, isal=False)
    assert module.IMPLEMENTATION == "zlib"
    assert module.crc32 is zlib.crc32


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=5000), value=st.integers(min_value=0, max_value=2**32 - 1), cut=st.integers(0, 5000))
def test_the_values_are_zlibs(data: bytes, value: int, cut: int) -> None:
    """Any bytes from any start value, and chained over two pieces, as zlib.crc32 computes them."""
    crc32 = checksum.crc32
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data, value) == zlib.crc32(data, value)
    head, tail = data[:cut], data[cut:]
    assert crc32(tail, crc32(head)) == zlib.crc32(data)


def test_every_buffer_the_journal_hands_it() -> None:
    """bytes, bytearray, read-only and sliced memoryviews, a numpy array: what the writer and the reader pass."""
    raw = np.random.default_rng(0).random((12, 50))
    data = raw.tobytes()
    for buffer in (data, bytearray(data), memoryview(data)[17:], memoryview(bytearray(data))[3:-5].toreadonly(), raw):
        assert checksum.crc32(buffer) == zlib.crc32(buffer)
    with pytest.raises(BufferError):  # as zlib's: a strided view is refused, not read wrong
        checksum.crc32(memoryview(data)[::2])


def zlib_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """The journal's writer and reader with zlib's crc32 (each module's own name for it)."""
    monkeypatch.setattr(compact, "_crc32", zlib.crc32)
    monkeypatch.setattr(format, "_crc32", zlib.crc32)
    monkeypatch.setattr(format, "crc32", zlib.crc32)
    monkeypatch.setattr(frames, "crc32", zlib.crc32)


def test_a_journal_is_the_same_bytes_with_either(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Varied commits ("P", "S" and "R" frames, name tables, checkpoints) written with ISA-L's CRC and with zlib's:
    the same file, and each reads back with the other's (the clock frozen: a header holds when its run began)."""
    monkeypatch.setattr("metricbus.journal.writer.CHECKPOINT_BYTES", 4000)
    monkeypatch.setattr("metricbus.journal.writer.time.time_ns", lambda: 1_765_000_000_000_000_000)
    fast, fast_out, _ = run(tmp_path / "isal", range(40))
    with monkeypatch.context() as patched:
        zlib_everywhere(patched)
        slow, slow_out, _ = run(tmp_path / "zlib", range(40))
        read_by_zlib = dict(emitted(read_journal(tmp_path / "isal")))
    assert fast == slow
    assert repr(fast_out) == repr(slow_out)  # repr: NaN equal to NaN
    assert repr(read_by_zlib) == repr(fast_out)
    assert repr(dict(emitted(read_journal(tmp_path / "zlib")))) == repr(fast_out)
