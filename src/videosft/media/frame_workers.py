"""Stored frames decoded in worker processes, so that decoding never holds the trainer's interpreter lock.

On a GPU the train step is launched from Python: while the device runs one kernel the main thread
must already be issuing the next, and ZeRO-3's hooks run between them. The host thread that
prepares the next batch (:class:`videosft.training.batches.BatchesAhead`) decodes its frames
(lossless WebP, about 1 s of one core per 128-frame window), and Pillow's and torchvision's WebP
decoders hold Python's lock for part of each call: a thread of small torch calls ran 1.4-1.75x
slower beside one decoding thread on two otherwise idle cores, and unchanged beside one decoding
process (bench/RESULTS.md, the 128-frame regression). So the frames are decoded by worker processes
here, each writing its share of the frames into one shared-memory block the caller made; the
calling thread only waits for them, and the caller's copy out of the block (into page-locked memory
on a GPU) runs in torch, outside the lock.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import wait

from .pixels import EncodedFrames

# Beyond four the decode of one 128-frame window (a quarter of a step's time on one core each) is
# short of the step already; more processes would only take cores from the ranks' own threads.
MOST_PROCESSES = 4


def decode_processes(configured: int | None, on_gpu: bool) -> int:
    """Decoding processes per rank (train.decode_processes); left open (None): none on CPU (the step's
    own torch work is the bottleneck and keeps every core busy), on a GPU up to ``MOST_PROCESSES`` of
    the rank's share of the cores this process may use (Slurm's allocation included), two left for the
    rank's main and batch threads."""
    if configured is not None:
        return configured
    if not on_gpu:
        return 0
    share = len(os.sched_getaffinity(0)) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    return max(1, min(MOST_PROCESSES, share - 2))


class FrameWorkers:
    """A pool of processes that decode a sample's stored frames, each a consecutive part of them."""

    def __init__(self, processes: int):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        if processes < 1:
            raise ValueError(f"FrameWorkers needs at least one process, not {processes}")
        self.processes = processes
        # spawn: the trainer holds CUDA and threads of its own, which a forked child must not inherit
        self.pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"))

    def decode(self, frames: EncodedFrames, pin: bool = False):
        """The frames as torch uint8 ``(T, 3, H, W)``, equal to ``frames.decode()``; page-locked with ``pin``."""
        import torch
        from multiprocessing.shared_memory import SharedMemory

        size = math.prod(frames.shape)
        block = SharedMemory(create=True, size=max(1, size))
        try:
            part = max(1, -(-len(frames) // self.processes))
            futures = [self.pool.submit(decode_into, block.name, frames.shape, start, frames[start:start + part])
                       for start in range(0, len(frames), part)]
            wait(futures)  # every part finished (or failed) before the block goes away
            for future in futures:
                future.result()
            shared = torch.frombuffer(block.buf, dtype=torch.uint8, count=size).view(frames.shape)
            decoded = shared.pin_memory() if pin else shared.clone()
            del shared  # the block cannot close while a tensor still points into it
            return decoded
        finally:
            block.close()
            block.unlink()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def decode_into(block_name: str, shape: tuple, start: int, frames: EncodedFrames) -> None:
    """In a worker: decode ``frames`` into the shared block (the whole sample's ``shape``) from frame ``start``."""
    import numpy as np
    from multiprocessing.shared_memory import SharedMemory

    block = SharedMemory(block_name)
    try:
        whole = np.ndarray(shape, dtype=np.uint8, buffer=block.buf)
        whole[start:start + len(frames)] = frames.array()
        del whole
    finally:
        block.close()
