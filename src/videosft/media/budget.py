"""The visual token budget: how many frames a window gets and how large each frame is.

The rules follow qwen-vl-utils (``smart_nframes``, ``smart_resize`` and the pixel bounds of
``fetch_video``) so a budget means here what it means in the Qwen reference code; the factor
is patch size x spatial merge, read from the model's processor, never assumed. Budgets are in
merged visual tokens per frame pair, like qwen-vl-utils' VIDEO_MIN/MAX_TOKEN_NUM, and those
environment variables override the config when set.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

from ..config import View
from ..errors import ConfigError

FRAME_FACTOR = 2  # frames per temporal patch; frame counts are even
MAX_ASPECT_RATIO = 200
ENV_MIN_TOKENS = "VIDEO_MIN_TOKEN_NUM"
ENV_MAX_TOKENS = "VIDEO_MAX_TOKEN_NUM"


@dataclass(frozen=True)
class Budget:
    fps: float
    min_frames: int
    max_frames: int
    min_tokens: int
    max_tokens: int
    min_tokens_from: str
    max_tokens_from: str

    def as_dict(self) -> dict:
        return asdict(self)


def resolve_budget(video_cfg: View, environ: dict | None = None) -> Budget:
    """The budget in force: config values, overridden by VIDEO_MIN/MAX_TOKEN_NUM when set."""
    environ = os.environ if environ is None else environ

    def pick(key: str, env: str) -> tuple[int, str]:
        raw = environ.get(env)
        if raw is None or raw == "":
            return int(getattr(video_cfg, key)), f"config video.{key}"
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(f"environment variable {env}={raw!r} is not an integer") from None
        if value < 1:
            raise ConfigError(f"environment variable {env}={value} must be at least 1")
        return value, f"environment {env}"

    min_tokens, min_from = pick("min_tokens", ENV_MIN_TOKENS)
    max_tokens, max_from = pick("max_tokens", ENV_MAX_TOKENS)
    if min_tokens > max_tokens:
        raise ConfigError(f"token budget min {min_tokens} ({min_from}) exceeds max {max_tokens} ({max_from})")
    if video_cfg.min_frames > video_cfg.max_frames:
        raise ConfigError(f"video.min_frames {video_cfg.min_frames} exceeds video.max_frames {video_cfg.max_frames}")
    return Budget(
        fps=float(video_cfg.fps),
        min_frames=int(video_cfg.min_frames),
        max_frames=int(video_cfg.max_frames),
        min_tokens=min_tokens,
        max_tokens=max_tokens,
        min_tokens_from=min_from,
        max_tokens_from=max_from,
    )


def round_by(number: float, factor: int) -> int:
    return round(number / factor) * factor


def ceil_by(number: float, factor: int) -> int:
    return math.ceil(number / factor) * factor


def floor_by(number: float, factor: int) -> int:
    return math.floor(number / factor) * factor


def frame_count(total_frames: int, video_fps: float, budget: Budget) -> int:
    """How many frames to sample from a clip of ``total_frames`` at ``video_fps`` (even)."""
    min_frames = ceil_by(budget.min_frames, FRAME_FACTOR)
    max_frames = floor_by(budget.max_frames, FRAME_FACTOR)
    wanted = total_frames / video_fps * budget.fps
    count = floor_by(min(max(wanted, min_frames), max_frames, total_frames), FRAME_FACTOR)
    if not FRAME_FACTOR <= count <= total_frames:
        raise ValueError(
            f"clip has {total_frames} frame(s); at least {FRAME_FACTOR} are needed for one temporal patch"
        )
    return count


def pixel_bounds(budget: Budget, factor: int, frames: int, total_pixels: float | None = None) -> tuple[int, int]:
    """Per-frame (min_pixels, max_pixels) as qwen-vl-utils' fetch_video derives them."""
    min_pixels = budget.min_tokens * factor * factor
    max_pixels = budget.max_tokens * factor * factor
    if total_pixels is not None:
        max_pixels = min(max_pixels, total_pixels / frames * FRAME_FACTOR)
    return min_pixels, max(max_pixels, int(min_pixels * 1.05))


def frame_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width), multiples of ``factor``, closest to the input within the pixel bounds."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} exceeds {MAX_ASPECT_RATIO}")
    h_bar = max(factor, round_by(height, factor))
    w_bar = max(factor, round_by(width, factor))
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        # qwen-vl-utils can floor a thin frame's short side to 0; one patch is the least there is
        h_bar = max(factor, floor_by(height / beta, factor))
        w_bar = max(factor, floor_by(width / beta, factor))
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = ceil_by(height * beta, factor)
        w_bar = ceil_by(width * beta, factor)
    return h_bar, w_bar


@dataclass(frozen=True)
class Plan:
    frames: int
    height: int
    width: int
    grid: tuple[int, int, int]  # video_grid_thw the processor must report
    visual_tokens: int


def plan(total_frames: int, video_fps: float, height: int, width: int, budget: Budget,
         patch_size: int, merge_size: int, temporal_patch_size: int) -> Plan:
    """Frames, frame size and the expected ``video_grid_thw`` for one clip."""
    factor = patch_size * merge_size
    frames = frame_count(total_frames, video_fps, budget)
    low, high = pixel_bounds(budget, factor, frames)
    out_h, out_w = frame_size(height, width, factor, low, high)
    grid = (frames // temporal_patch_size, out_h // patch_size, out_w // patch_size)
    return Plan(frames, out_h, out_w, grid, grid[0] * grid[1] * grid[2] // (merge_size * merge_size))
