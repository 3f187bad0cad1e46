"""The overlapped verifier's copies (GPU only): a host-to-device copy from pinned memory is queued without
waiting for work queued before it, and results staged to pinned host memory read correctly once the stream
passes. (A test that a small copy from pageable memory *does* wait, the suspected reason the first two
overlap attempts launched late, failed on the GPU and was removed: that suspicion is refuted.)"""
import time

import pytest
import torch

from minedraft_ray.engine.spec import VerifyResult
from minedraft_ray.engine.runner import to_device

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


def _queue_busy_work() -> torch.cuda.Event:
    """~0.1 s of matrix products queued on the stream; returns an event recorded after them."""
    x = torch.randn(8192, 8192, device=CUDA)
    torch.cuda.synchronize()
    for _ in range(6):
        x = x @ x * 1e-4
    done = torch.cuda.Event()
    done.record()
    return done


def test_cuda_pinned_copy_does_not_wait_for_queued_work():
    to_device([0], CUDA)   # the first pinned allocation sets up the host allocator (22 ms on the H200)
    busy = _queue_busy_work()
    t0 = time.perf_counter()
    ids = to_device([3, 1, 2], CUDA)
    queued_in = time.perf_counter() - t0
    assert not busy.query(), "the copy call returned only after the queued work finished"
    assert queued_in < 0.02, queued_in
    assert ids.tolist() == [3, 1, 2]


def test_cuda_staged_results_read_after_the_stream_passes():
    tokens = torch.tensor([[5, 6, -1], [7, -1, -1]], device=CUDA)
    result = VerifyResult(tokens, torch.tensor([2, 1], device=CUDA))
    busy = _queue_busy_work()
    staged = result.staged()
    assert not busy.query() and staged.tokens.is_pinned()
    end = torch.cuda.Event()
    end.record()
    end.synchronize()
    assert staged.to_host() == ([[5, 6], [7]], None)
