"""Fixtures shared by the test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

SYNCS = ("item", "cpu", "tolist", "__float__", "__bool__", "__int__", "numpy")  # what copies a tensor to the host


@pytest.fixture
def no_host_sync(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make every host-sync call on a tensor raise (skipped without torch)."""
    torch = pytest.importorskip("torch")

    def fail(*_a: object, **_k: object) -> None:
        raise AssertionError("host sync in log()")

    for name in SYNCS:
        monkeypatch.setattr(torch.Tensor, name, fail)
    yield
    monkeypatch.undo()
