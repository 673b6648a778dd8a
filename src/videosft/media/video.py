"""Decoding one window of a video with decord, as a player shows it: on its clock (edit lists applied) and
at its display geometry (non-square pixels, as DV, HDV, DVD and broadcast files have, widened or
narrowed to square ones before the token budget sees the frame)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from .budget import Budget, Plan, frame_count, plan
from ..errors import Rejected


@dataclass
class Clip:
    """The frames of one window, with the times the model is told (seconds from window start)."""

    frames: object  # torch uint8 (T, 3, H, W), resized to the plan: channels first, as the processor works
    frame_indices: list[int]  # indices into the source video
    local_times: list[float]  # frame times (player's clock) minus the window start
    plan: Plan
    source_height: int  # as a player shows it (non-square pixels widened or narrowed)
    source_width: int
    decoding: str  # which decoder gave the frames (open_reader)


class VideoFile:
    """An open video: frame timestamps read once, on the player's clock; frames decoded on demand."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if self.path.is_file() and self.path.stat().st_size == 0:
            raise Rejected("video_empty", f"{path} is an empty file (0 bytes); copy or download it again")
        try:
            self.facts = stream_facts(self.path)
            self.start, self.pixel_aspect = self.facts.start, self.facts.pixel_aspect
            self.reader, self.decoding = open_reader(self.path, self.facts.interlaced)
            frame_times = np.asarray(self.reader.get_frame_timestamp(np.arange(len(self.reader))))
        except Exception as error:  # decord raises bare RuntimeErrors / DECORDErrors, PyAV its own
            raise undecodable(path, error) from None
        # a file cut off: (seconds that decode, seconds its container states)
        self.truncated = (self.reader.decodable_seconds, self.reader.stated_seconds) \
            if getattr(self.reader, "cut_off", False) else None
        if len(self.reader) < 2:
            raise Rejected("too_few_frames", f"{path} has {len(self.reader)} frame(s); a video needs at least 2")
        self.timestamps = frame_times[:, 0] + self.start
        self.duration = float(frame_times[-1, 1]) + self.start

    def with_own_reader(self) -> "VideoFile":
        """This video with a decoder of its own, for another thread (a decoder is not to be shared between
        threads); the container's facts and frame times are not read again."""
        other = copy.copy(self)
        try:
            other.reader, other.decoding = open_reader(self.path, self.facts.interlaced)
        except Exception as error:
            raise undecodable(self.path, error) from None
        return other

    def window_frames(self, start: float, end: float) -> np.ndarray:
        """Indices of the frames whose presentation time lies in ``[start, end)``."""
        eps = 1e-6
        return np.flatnonzero((self.timestamps >= start - eps) & (self.timestamps < end - eps))

    def clip(self, start: float, end: float, budget: Budget, patch_size: int, merge_size: int,
             temporal_patch_size: int) -> Clip:
        import torch
        from torchvision.transforms.v2 import functional as tvf

        if self.truncated and end > self.duration + 1e-6:
            decodable, stated = self.truncated
            raise Rejected("video_truncated", f"{self.path} is truncated: decodable up to {decodable:.2f} s of "
                           f"{stated:.2f} s; window [{start:.3f}, {end:.3f}] s reaches past it (copy the whole file "
                           "again to use it)")
        candidates = self.window_frames(start, end)
        if len(candidates) < 2:
            raise Rejected("too_few_frames", f"window [{start:.3f}, {end:.3f}] s of {self.path} has {len(candidates)} "
                           "frame(s); a window needs at least 2")
        window_fps = len(candidates) / (end - start)
        picks = np.linspace(0, len(candidates) - 1, frame_count(len(candidates), window_fps, budget))
        indices = candidates[picks.round().astype(int)]
        try:
            raw = self.frames(indices.tolist())
        except Exception as error:
            raise Rejected("video_undecodable", f"frames {indices[0]}-{indices[-1]} of {self.path} could not be "
                           f"decoded ({str(error).splitlines()[0]}); check the file or re-encode it") from None
        height, width = self.display_size(int(raw.shape[1]), int(raw.shape[2]))  # known once decoded
        frame_plan = plan(len(candidates), window_fps, height, width, budget, patch_size, merge_size,
                          temporal_patch_size)
        tensor = torch.from_numpy(raw).permute(0, 3, 1, 2)
        if (frame_plan.height, frame_plan.width) != tuple(raw.shape[1:3]):
            tensor = tvf.resize(tensor, [frame_plan.height, frame_plan.width],
                                interpolation=tvf.InterpolationMode.BICUBIC, antialias=True)
        return Clip(
            frames=tensor.contiguous(),  # resize returns channels-last strides, which slow the processor by a third
            frame_indices=indices.tolist(),
            local_times=[float(t - start) for t in self.timestamps[indices]],
            plan=frame_plan,
            source_height=height,
            source_width=width,
            decoding=self.decoding,
        )


    def frames(self, indices: list[int]) -> np.ndarray:
        """Frames (N, H, W, 3) RGB at ``indices``; where decord fails on a file it opened (a damaged
        stretch), PyAV takes over for this and later reads."""
        try:
            return self.reader.get_batch(indices).asnumpy()
        except Exception:
            if self.decoding != "decord":
                raise
        from .pyav_reader import PyAVReader

        self.reader, self.decoding = PyAVReader(self.path), "pyav (decord failed on a read)"
        return self.reader.get_batch(indices).asnumpy()

    def display_size(self, height: int, width: int) -> tuple[int, int]:
        """The size a player shows coded frames of ``height`` x ``width`` at: the width scaled by the
        pixel aspect ratio (a 720x480 DVD frame with 32:27 pixels shows 853 wide), the height kept."""
        return height, max(2, round(width * self.pixel_aspect))


def undecodable(path: Path, error: BaseException) -> Rejected:
    return Rejected("video_undecodable", f"{path} could not be decoded as a video ({str(error).splitlines()[0]}); "
                    "check the file or re-encode it")


def open_reader(path: Path, interlaced: bool):
    """decord's reader, or PyAV's (:mod:`videosft.media.pyav_reader`) for an interlaced stream or a file
    decord cannot open (AV1, a cut-off MP4); and which, for the sample's record."""
    import decord

    from .pyav_reader import PyAVReader

    if interlaced:
        return PyAVReader(path), "pyav, deinterlaced (bwdif)"
    try:
        return decord.VideoReader(str(path), num_threads=1), "decord"
    except Exception as error:  # decord's errors carry its C++ log; PyAV's say more
        reader = PyAVReader(path)
        return reader, f"pyav (decord: {str(error).splitlines()[0][:120]})"


@dataclass(frozen=True)
class StreamFacts:
    """What the container says of the video, read once per file (:func:`stream_facts`)."""
    start: float  # when a player shows the first frame, seconds
    pixel_aspect: Fraction  # the sample aspect ratio; 1 when square or unknown
    interlaced: bool  # the field order says so
    timecode: str | None  # the start timecode: the video stream's tag, a data (tmcd) stream's, the container's
    width: int  # coded size
    height: int
    audio_channels: int  # 0: no audio stream
    audio_rate: int


def stream_facts(path: Path) -> StreamFacts:
    """The container's facts of the video (:class:`StreamFacts`). An MP4/MOV edit list can delay the first
    frame (an empty edit of 1 s puts it at 1.0 s); decord counts from the first frame, so its times are
    shifted by this much. Other containers start the player's clock at the first frame."""
    import av

    from .pyav_reader import ffmpeg_log, said

    with ffmpeg_log() as logs:
        try:
            with av.open(str(path)) as container:
                if not container.streams.video:
                    raise ValueError("no video stream (an audio-only file?)")
                return _facts(container, container.streams.video[0])
        except av.error.FFmpegError as error:
            hint = " - the MP4's index is missing: cut off before its end, where the index was" \
                if "moov atom not found" in str(error) else ""
            raise ValueError(f"{str(error).split(': ')[0]}{said(logs)}{hint}") from None
        except AttributeError:  # PyAV gives a stream without parameters: nothing says what it holds
            raise ValueError("the video stream's parameters are missing (an MP4 cut off, with its index at the "
                             f"end?){said(logs)}") from None


def _facts(container, stream) -> StreamFacts:
    from .pyav_reader import INTERLACED, field_order

    aspect = stream.sample_aspect_ratio or stream.codec_context.sample_aspect_ratio
    mov = "mov" in container.format.name.split(",")
    places = [stream, *container.streams.data, container]
    audio = container.streams.audio[0].codec_context if container.streams.audio else None
    return StreamFacts(
        start=float(stream.start_time * stream.time_base) if mov and stream.start_time is not None else 0.0,
        pixel_aspect=Fraction(aspect) if aspect and aspect > 0 else Fraction(1),
        interlaced=field_order(stream) in INTERLACED,
        timecode=next((place.metadata["timecode"] for place in places if place.metadata.get("timecode")), None),
        width=stream.codec_context.width, height=stream.codec_context.height,
        audio_channels=audio.channels if audio is not None else 0, audio_rate=audio.sample_rate if audio is not None else 0)
