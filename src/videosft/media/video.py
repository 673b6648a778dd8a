"""Decoding one window of a video with decord, on the clock a player shows."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..encoding.budget import Budget, Plan, frame_count, plan
from ..errors import Rejected


@dataclass
class Clip:
    """The frames of one window, with the times the model is told (seconds from window start)."""

    frames: object  # torch uint8 (T, 3, H, W), resized to the plan: channels first, as the processor works
    frame_indices: list[int]  # indices into the source video
    local_times: list[float]  # frame times (player's clock) minus the window start
    plan: Plan
    source_height: int
    source_width: int


class VideoFile:
    """An open video: frame timestamps read once, on the player's clock; frames decoded on demand."""

    def __init__(self, path: Path):
        import decord

        self.path = Path(path)
        try:
            self.reader = decord.VideoReader(str(path), num_threads=1)
            frame_times = np.asarray(self.reader.get_frame_timestamp(np.arange(len(self.reader))))
            self.start = stream_start(self.path)
        except Exception as error:  # decord raises bare RuntimeErrors / DECORDErrors, PyAV its own
            raise Rejected("video_undecodable", f"{path} could not be decoded as a video "
                           f"({str(error).splitlines()[0]}); check the file or re-encode it") from None
        if len(self.reader) < 2:
            raise Rejected("too_few_frames", f"{path} has {len(self.reader)} frame(s); a video needs at least 2")
        self.timestamps = frame_times[:, 0] + self.start
        self.duration = float(frame_times[-1, 1]) + self.start

    def window_frames(self, start: float, end: float) -> np.ndarray:
        """Indices of the frames whose presentation time lies in ``[start, end)``."""
        eps = 1e-6
        return np.flatnonzero((self.timestamps >= start - eps) & (self.timestamps < end - eps))

    def clip(self, start: float, end: float, budget: Budget, patch_size: int, merge_size: int,
             temporal_patch_size: int) -> Clip:
        import torch
        from torchvision.transforms.v2 import functional as tvf

        candidates = self.window_frames(start, end)
        if len(candidates) < 2:
            raise Rejected("too_few_frames", f"window [{start:.3f}, {end:.3f}] s of {self.path} has {len(candidates)} "
                           "frame(s); a window needs at least 2")
        window_fps = len(candidates) / (end - start)
        picks = np.linspace(0, len(candidates) - 1, frame_count(len(candidates), window_fps, budget))
        indices = candidates[picks.round().astype(int)]
        try:
            raw = self.reader.get_batch(indices.tolist()).asnumpy()
        except Exception as error:
            raise Rejected("video_undecodable", f"frames {indices[0]}-{indices[-1]} of {self.path} could not be "
                           f"decoded ({str(error).splitlines()[0]}); check the file or re-encode it") from None
        height, width = int(raw.shape[1]), int(raw.shape[2])  # known once decoded: no extra decode at open
        frame_plan = plan(len(candidates), window_fps, height, width, budget, patch_size, merge_size,
                          temporal_patch_size)
        tensor = torch.from_numpy(raw).permute(0, 3, 1, 2)
        if (frame_plan.height, frame_plan.width) != (height, width):
            tensor = tvf.resize(tensor, [frame_plan.height, frame_plan.width],
                                interpolation=tvf.InterpolationMode.BICUBIC, antialias=True)
        return Clip(
            frames=tensor.contiguous(),  # resize returns channels-last strides, which slow the processor by a third
            frame_indices=indices.tolist(),
            local_times=[float(t - start) for t in self.timestamps[indices]],
            plan=frame_plan,
            source_height=height,
            source_width=width,
        )


def stream_start(path: Path) -> float:
    """When a player shows the first frame, in seconds. An MP4/MOV edit list can delay it (an
    empty edit of 1 s puts the first frame at 1.0 s); decord counts from the first frame, so its
    times are shifted by this much. Other containers start the player's clock at the first frame."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        if "mov" not in container.format.name.split(",") or stream.start_time is None:
            return 0.0
        return float(stream.start_time * stream.time_base)
