"""Frames decoded by worker processes: the same frames as decoding in the caller, and a damaged
sample's error with its name. (What the processes buy, the launching thread's time, is a GPU
benchmark's: bench/perf_guard.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from videosft.errors import InputError
from videosft.media.frame_workers import FrameWorkers, decode_processes
from videosft.media.pixels import EncodedFrames, stored_frames


def encoded(window_id: str, count: int, seed: int, size: int = 32) -> EncodedFrames:
    frames = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (count, 3, size, size), dtype=np.uint8))
    stored = stored_frames(frames)
    return EncodedFrames(tuple(stored["frames"]), tuple(stored["frames_shape"]), window_id)


@pytest.fixture(scope="module")
def workers():
    pool = FrameWorkers(2)
    yield pool
    pool.close()


@pytest.mark.parametrize("count", [1, 2, 5])
def test_workers_decode_the_same_frames_as_the_caller(workers, count):
    """Parts of uneven size (5 frames over 2 processes), and fewer frames than processes."""
    frames = encoded("a", count, count)
    decoded = workers.decode(frames)
    assert decoded.dtype == torch.uint8 and decoded.is_contiguous()
    assert torch.equal(decoded, frames.decode())


def test_a_damaged_sample_fails_with_its_name_and_the_pool_goes_on(workers):
    good = encoded("good", 4, 0)
    damaged = EncodedFrames(good.images, (4, 3, 32, 48), "w-17")  # the store's shape disagrees with its images
    with pytest.raises(InputError, match="sample w-17: its frames decode to \\[2, 3, 32, 32\\]"):
        workers.decode(damaged)
    assert torch.equal(workers.decode(good), good.decode())


def test_processes_none_on_cpu_a_share_of_the_cores_on_a_gpu_unless_configured(monkeypatch):
    import os

    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert decode_processes(None, on_gpu=False) == 0
    assert decode_processes(None, on_gpu=True) == max(1, min(4, cores - 2))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(10 * cores))  # more ranks than cores: still one each on a GPU
    assert decode_processes(None, on_gpu=True) == 1
    assert decode_processes(3, on_gpu=False) == 3 and decode_processes(0, on_gpu=True) == 0
