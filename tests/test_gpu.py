"""CUDA checks (``pytest -m gpu``): log() never syncs; a 1-rank NCCL commit."""

from __future__ import annotations

import os
import socket

import pytest

torch = pytest.importorskip("torch")

from metricbus import MetricBus  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_log_under_sync_debug_error() -> None:
    """log() of CUDA tensors raises nothing under set_sync_debug_mode('error')."""
    bus = MetricBus(dist=None)
    x = torch.randn(64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.bool):
            bus.log("x", x.to(dtype))
        bus.log("w", x, weight=x.abs())
        bus.log("s", x[0], weight=2.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = bus.commit()
    assert out["x"] == out["x"]


def test_one_rank_nccl_commit() -> None:
    """A 1-rank NCCL group commits with the buffer on the current CUDA device."""
    import torch.distributed as tdist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    tdist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        bus = MetricBus(dist="torch")
        bus.log("loss", torch.tensor([1.0, 3.0], device="cuda"))
        bus.log("acc", 0.5)
        assert bus.commit() == {"acc": 0.5, "loss": 2.0}
        bus.close()
    finally:
        tdist.destroy_process_group()
