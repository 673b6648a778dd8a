"""Batches for the model: collated on the host, with their multimodal positions, and for training
read from the sample store and prepared one batch ahead on a host thread while the device runs the
current step.

Left inside the forward, the Qwen models compute their multimodal RoPE positions from the token
ids on the device with a few `.item()` calls per frame pair: about 280 host-device
synchronisations per 128-frame sample, each one draining the device's queue. The positions depend
only on the token ids and the video grid, so the host computes them here with the model's own
function and hands them to the forward.
"""

from __future__ import annotations

import itertools
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable

from ..encoding.chat import IGNORE_INDEX
from ..media.frame_workers import FrameWorkers, decode_processes as processes_for
from ..media.pixels import EncodedFrames, pixel_values_videos, pixels_of_frames

# A host batch made for a GPU, or shared by a sequence-parallel group, carries each sample's stored frames
# (EncodedFrames until BatchesAhead decodes the ones its rank needs, then their window ids and tensors)
# instead of its pixels: the processor runs where the batch goes (BatchesAhead.take).
FRAMES = "video_frames"


def collate(rows: list[dict], pad_id: int, video_processor, left: bool = False, frames_only: bool = False) -> dict:
    """Host tensors for a list of samples; pixels are rebuilt from the stored frames by
    ``video_processor`` (:mod:`videosft.media.pixels`) and stay float16 (the model casts them to its own
    dtype on the device: float16 widens exactly, so the model sees the same values).
    ``left`` pads on the left, as batched generation needs (every prompt ends where answers begin).
    ``frames_only`` keeps the stored frames, not decoded yet (``FRAMES``), instead of the pixels."""
    import torch

    length = max(len(row["input_ids"]) for row in rows)

    def pad(values: list, fill) -> list:
        padding = [fill] * (length - len(values))
        return padding + values if left else values + padding

    def padded(key: str, fill: int, dtype):
        return torch.tensor([pad(row[key], fill) for row in rows], dtype=dtype)

    batch = {
        "input_ids": padded("input_ids", pad_id, torch.long),
        "labels": padded("labels", IGNORE_INDEX, torch.long),
        "attention_mask": torch.tensor([pad([1] * len(row["input_ids"]), 0) for row in rows]),
        "mm_token_type_ids": padded("mm_token_type_ids", 0, torch.int),
        "video_grid_thw": torch.tensor([row["video_grid_thw"] for row in rows], dtype=torch.long),
    }
    if frames_only:
        batch[FRAMES] = [EncodedFrames.of(row) for row in rows]
    else:
        batch["pixel_values_videos"] = torch.cat([pixel_values_videos(row, video_processor) for row in rows])
    if rows[0].get("second_per_grid") is not None:  # Qwen2.5-VL's time step; without it the model assumes 1 s
        batch["second_per_grid_ts"] = torch.tensor([row["second_per_grid"] for row in rows])
    return batch


def collate_pack(rows: list[dict], video_processor, positions, frames_only: bool = False) -> dict:
    """One row of several samples, no padding (``train.pack_tokens``), with what keeps them apart:

    * ``position_ids`` (4, 1, tokens): each sample's multimodal positions, computed alone by the
      model's ``positions`` function (they restart at each sample), under a first row of text
      positions 0, 1, ... restarting at each sample. From that row transformers' Qwen models build a
      block-diagonal causal mask for their full-attention layers (``find_packed_sequence_indices``;
      no attention mask is given, so none of padding overrides it).
    * ``cu_seq_lens_q``: where each sample starts, and the total; Qwen3.5's Gated-DeltaNet layers
      restart their recurrent state and convolution there (:mod:`videosft.kernels.gated_deltanet`).
    * labels: each sample's own, with its first token unsupervised, so no position predicts across
      a boundary (a sample's first token is never a target of its own either).
    * the pixels and grids of every sample's video, in order, as in a padded batch.
    """
    import torch

    if positions is None:
        raise ValueError("packed samples need the model's multimodal position function (host_positions)")
    alone = [collate([row], 0, video_processor, frames_only=frames_only) for row in rows]
    labels = []
    for row in rows:
        labels += [IGNORE_INDEX] + list(row["labels"][1:])
    lengths = [len(row["input_ids"]) for row in rows]
    multimodal = torch.cat([positions(batch) for batch in alone], dim=-1)
    text = torch.cat([torch.arange(n) for n in lengths]).view(1, 1, -1).to(multimodal.dtype)
    batch = {
        "input_ids": torch.cat([b["input_ids"] for b in alone], dim=1),
        "labels": torch.tensor([labels], dtype=torch.long),
        "mm_token_type_ids": torch.cat([b["mm_token_type_ids"] for b in alone], dim=1),
        "video_grid_thw": torch.cat([b["video_grid_thw"] for b in alone]),
        "position_ids": torch.cat([text, multimodal]),
        "cu_seq_lens_q": torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.long),
    }
    if frames_only:
        batch[FRAMES] = [b[FRAMES][0] for b in alone]
    else:
        batch["pixel_values_videos"] = torch.cat([b["pixel_values_videos"] for b in alone])
    if "second_per_grid_ts" in alone[0]:
        batch["second_per_grid_ts"] = torch.cat([b["second_per_grid_ts"] for b in alone])
    return batch


def tokens_in(batch: dict) -> int:
    """The batch's real tokens (a pack has no padding, hence no attention mask)."""
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()


def host_positions(model) -> Callable[[dict], object] | None:
    """The model's own multimodal position function, to run on host tensors; None for a model
    without one (it then computes positions in its forward, as before)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    compute = getattr(getattr(base, "model", None), "compute_3d_position_ids", None)
    if compute is None:
        return None

    def positions(batch: dict):
        extra = {"second_per_grid_ts": batch["second_per_grid_ts"]} if "second_per_grid_ts" in batch else {}
        return compute(input_ids=batch["input_ids"], inputs_embeds=None, image_grid_thw=None,
                       video_grid_thw=batch["video_grid_thw"], attention_mask=batch["attention_mask"],
                       cache=None, mm_token_type_ids=batch["mm_token_type_ids"], **extra)

    return positions


def prepare(rows: list[dict], pad_id: int, video_processor, positions, pin: bool, pack: bool = False,
            frames_only: bool = False) -> dict:
    if pack:
        batch = collate_pack(rows, video_processor, positions, frames_only)
    else:
        batch = collate(rows, pad_id, video_processor, frames_only=frames_only)
    if positions is not None and not pack:
        position_ids = positions(batch)
        if position_ids is not None:
            batch["position_ids"] = position_ids
    return pinned(batch) if pin else batch


def pinned(batch: dict) -> dict:
    """The batch's tensors (decoded frames too) page-locked, so that copies to the device run asynchronously."""
    import torch

    def pin(value):
        if torch.is_tensor(value):
            return value.pin_memory()
        if isinstance(value, list) and value and isinstance(value[0], tuple):  # decoded frames
            return [(name, frames.pin_memory()) for name, frames in value]
        return value

    return {key: pin(value) for key, value in batch.items()}


class BatchesAhead:
    """Reads and prepares the batch after this one on a host thread while the device works on this one.

    Batches are named by their samples' positions; ``read`` turns positions into rows (the sample
    store's reader, so that only the rows of the batches near at hand are ever in memory).
    `take(positions)` returns the device batch (read and prepared now if it was not announced), and
    `announce(positions)` starts reading and preparing the next one. Announcing a different batch
    than the one later taken is harmless: the stale one is discarded.

    With ``pixels_on_device`` (the default on a GPU) the host thread only decodes the frames; `take`
    makes their pixels on the device, so the processor's float work (about 0.6 s on 16 cores for a
    128-frame sample) no longer runs on the host beside the step (+0.9% tokens/s at 128 frames on one
    H200, bench/RESULTS.md). With ``shard`` (train.sequence_parallel) the frames stay encoded until this
    rank's part of the batch is cut, so each rank decodes only its own frame pairs' frames. With
    ``decode_processes`` the frames are decoded by that many worker processes (None: as many as the
    cores allow on a GPU, none on CPU; :mod:`videosft.media.frame_workers`): decoding in this thread
    holds Python's lock part of the time, which the step's launching thread then waits for.
    """

    def __init__(self, read: Callable[[list[int]], list[dict]], pad_id: int, video_processor, device, positions=None,
                 pack: bool = False, pixels_on_device: bool | None = None,
                 shard: Callable[[dict], dict] | None = None, decode_processes: int | None = 0):
        self.read, self.pad_id, self.video_processor, self.device, self.positions = \
            read, pad_id, video_processor, device, positions
        self.pack = pack  # each batch is one pack of its rows (collate_pack)
        self.pin = device.type == "cuda"
        self.pixels_on_device = self.pin if pixels_on_device is None else pixels_on_device
        self.shard = shard  # this rank's part of each batch (train.sequence_parallel), made on the host
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batches-ahead")
        self.decode_processes = processes_for(decode_processes, self.pin)  # None: as the cores allow
        self.workers = FrameWorkers(self.decode_processes) if self.decode_processes else None
        self.pending: tuple[list[int], Future] | None = None

    def _read_and_prepare(self, positions: list[int]) -> dict:
        import torch

        # frames stay encoded until this rank's part is known: a rank that shares the sample decodes only its own
        frames_only = self.pixels_on_device or self.shard is not None or self.workers is not None
        batch = prepare(self.read(positions), self.pad_id, self.video_processor, self.positions, False, self.pack,
                        frames_only)
        if self.shard:
            batch = self.shard(batch)
        if FRAMES in batch:
            batch[FRAMES] = [(frames.window_id, self.decode(frames)) for frames in batch[FRAMES]]
            if not self.pixels_on_device:
                batch["pixel_values_videos"] = self.pixels(batch.pop(FRAMES), batch["video_grid_thw"])
        return pinned(batch) if self.pin else batch

    def decode(self, frames: EncodedFrames):
        return frames.decode() if self.workers is None else self.workers.decode(frames, pin=self.pin)

    def pixels(self, frames: list, grids, device=None):
        """``pixel_values_videos`` of decoded frames ((window id, frames) per video), made on ``device``."""
        import torch

        return torch.cat([pixels_of_frames(decoded if device is None else decoded.to(device, non_blocking=self.pin),
                                           grid, self.video_processor, name)
                          for (name, decoded), grid in zip(frames, grids.tolist())])

    def announce(self, positions: list[int]) -> None:
        self.pending = (list(positions), self.pool.submit(self._read_and_prepare, list(positions)))

    def take(self, positions: list[int]) -> dict:
        import torch

        if self.pending is not None and self.pending[0] == list(positions):
            host = self.pending[1].result()
        else:
            host = self._read_and_prepare(list(positions))
        self.pending = None
        batch = {key: value.to(self.device, non_blocking=self.pin) if torch.is_tensor(value) else value
                 for key, value in host.items() if key != FRAMES}
        if FRAMES in host:
            batch["pixel_values_videos"] = self.pixels(host[FRAMES], host["video_grid_thw"], self.device)
        return batch

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.workers is not None:
            self.workers.close()


def made_ahead(items: Iterable, make: Callable, workers: int = 1):
    """``make(item)`` for each item, in order, made on host threads ahead of the caller: while the caller
    works on one, the next ``workers`` are being made (decord, the image processor and the tokenizer spend
    their time outside the interpreter's lock). ``items`` is read lazily, one ahead of what is made. An
    error of ``make`` reaches the caller at its item; what was not started by then never is."""
    items = iter(items)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="made-ahead")
    try:
        pending = deque(pool.submit(make, item) for item in itertools.islice(items, workers))
        while pending:
            made = pending.popleft().result()
            pending.extend(pool.submit(make, item) for item in itertools.islice(items, 1))
            yield made
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
