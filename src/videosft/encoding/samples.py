"""What a window becomes for the model: its frames under the token budget, the chat, the
processor's tensors and the labels, each checked.

For each window: decode only its frames with decord, resize them under the budget ourselves
(the Qwen3-VL video processor ignores ``max_pixels``), and run the model's processor with
``do_resize=False``, ``do_sample_frames=False`` and frame times on the window's own clock (the
window starts at 0 s, like the answer). Every sample is checked: the processor's
``video_grid_thw`` equals the planned grid (the budget took effect), the visual tokens equal the
grid over merge², the video tokens are laid out as the published models saw them
(:mod:`videosft.encoding.layout`), the ``<t seconds>`` markers match the frames' times, the answer is whole
and supervised. The preprocess stage stores what :func:`build_sample` makes (the frames the processor was given,
from which :mod:`videosft.media.pixels` rebuilds its pixels); the predict stage
builds its prompts with the same function, so training and use see the same tokens.
"""

from __future__ import annotations

import dataclasses
import time

from ..config import View
from ..errors import Rejected
from ..media.budget import Budget
from ..media.pixels import stored_frames
from ..media.video import Clip, VideoFile
from .chat import assistant_labels, messages, prompt_timestamps, render_answer, template_kwargs
from .layout import VideoTokens, check_layout, layout_name, template_text

# Seconds of frame time per unit of VideoMetadata.frames_indices: the processor writes
# frames_indices / fps as each frame's time, so indices in milliseconds of window time make its
# <t seconds> markers the frames' presentation times minus the window start, also for variable
# frame rates.
TIME_BASE = 1000.0


class SampleError(Rejected):
    """A window that cannot become a training sample; it goes to the rejects list under its code."""


def processor_geometry(processor) -> dict:
    video = processor.video_processor
    return {
        "patch_size": int(video.patch_size),
        "merge_size": int(video.merge_size),
        "temporal_patch_size": int(video.temporal_patch_size),
    }




def tells_time_by_grid(processor) -> bool:
    """Whether the model learns time from a fixed step per frame pair (Qwen2.5-VL's
    ``second_per_grid_ts`` in its M-RoPE positions) rather than from ``<t seconds>`` markers in the
    prompt (Qwen3-VL, Qwen3.5)."""
    return "second_per_grid_ts" in processor.model_input_names


def encode(processor, clip: Clip, text: str):
    from transformers.video_utils import VideoMetadata

    count = len(clip.local_times)
    if tells_time_by_grid(processor):  # its step comes from the metadata's sampled_fps: the clip's mean rate
        span = clip.local_times[-1] - clip.local_times[0]
        fps, indices = ((count - 1) / span if span > 0 else TIME_BASE), list(range(count))
    else:  # its markers are frames_indices / fps: milliseconds of window time
        fps, indices = TIME_BASE, [int(round(t * TIME_BASE)) for t in clip.local_times]
    metadata = VideoMetadata(total_num_frames=count, fps=fps, frames_indices=indices, height=clip.plan.height,
                             width=clip.plan.width)
    return processor(
        text=[text],
        videos=[clip.frames],
        video_metadata=[metadata],
        videos_kwargs={"do_resize": False, "do_sample_frames": False, "return_metadata": True},
        return_tensors="pt",
    )


def frame_pair_times(local_times: list[float], temporal_patch_size: int) -> list[float]:
    """Mean time of each group of frames the model sees as one (unrounded)."""
    pairs = [local_times[i:i + temporal_patch_size] for i in range(0, len(local_times), temporal_patch_size)]
    return [sum(p) / len(p) for p in pairs]


# A <t seconds> marker is its pair's time rounded to 0.1 s (from millisecond frame indices): within
# half a step of the true time. Comparing with the true time, not with our own rounding of it, keeps
# a tie such as 8.15 (written 8.1 or 8.2 depending on float error) from failing a right sample.
MARKER_TOLERANCE = 0.05 + 0.001


def encode_window(window: dict, video: VideoFile, processor, cfg: View, budget: Budget, geometry: dict):
    """Decode, resize and encode one window under ``budget``; check that the budget took effect."""
    started = time.perf_counter()
    clip = video.clip(window["window_start"], window["window_end"], budget, **geometry)
    decode_seconds = time.perf_counter() - started
    answer = render_answer(window["keep_local"])
    layout = layout_name(cfg.prompt.video_layout, tells_time_by_grid(processor))
    text = processor.apply_chat_template(messages(cfg.prompt, window["query"], answer), tokenize=False,
                                         **template_kwargs(processor))
    encoded = encode(processor, clip, template_text(text, layout))
    input_ids = encoded["input_ids"][0].tolist()
    grid = tuple(int(v) for v in encoded["video_grid_thw"][0])
    if grid != clip.plan.grid:
        raise SampleError(
            "budget_not_applied", f"the processor produced video_grid_thw {list(grid)} but the budget planned "
            f"{list(clip.plan.grid)}: the budget did not take effect"
        )
    visual_tokens = sum(token == processor.video_token_id for token in input_ids)
    if visual_tokens != clip.plan.visual_tokens:
        raise SampleError("budget_not_applied", f"{visual_tokens} video tokens in the prompt, grid implies {clip.plan.visual_tokens}")
    pairs = grid[0]
    check_layout(input_ids, VideoTokens.of(processor.tokenizer), processor.tokenizer.decode, layout,
                 [visual_tokens // pairs] * pairs)
    expected = frame_pair_times(clip.local_times, geometry["temporal_patch_size"])
    if tells_time_by_grid(processor):
        check_grid_times(float(encoded["second_per_grid_ts"][0]), expected)
    else:
        markers = prompt_timestamps(processor.tokenizer.decode(input_ids))
        if len(markers) != len(expected) or any(abs(a - b) > MARKER_TOLERANCE for a, b in zip(markers, expected)):
            raise SampleError("frame_times", f"prompt frame times {markers} differ from the window's frame times "
                              f"{[round(t, 3) for t in expected]}")
    return clip, encoded, input_ids, grid, visual_tokens, answer, decode_seconds


def check_grid_times(step: float, pair_times: list[float]) -> None:
    """Qwen2.5-VL places frame pair k at k x ``step`` from the first: every pair's real time must be
    within half a step of that, else the model's clock and the answer's disagree (a variable frame
    rate that a fixed step cannot follow)."""
    worst = max(abs(t - pair_times[0] - k * step) for k, t in enumerate(pair_times))
    if worst > step / 2:
        raise SampleError("variable_frame_rate", f"frame pairs are {worst:.3f} s off the fixed step of {step:.3f} s that Qwen2.5-VL "
                          f"assumes (pair times {[round(t, 3) for t in pair_times]}); the frame rate varies too "
                          "much in this window for a model that tells time by a fixed step")


def fitted_budget(budget: Budget, input_tokens: int, visual_tokens: int, pairs: int, max_length: int) -> Budget | None:
    """The largest per-pair budget under which the sample fits ``max_length``, or None if none does."""
    per_pair = (max_length - (input_tokens - visual_tokens)) // pairs
    if per_pair < budget.min_tokens:
        return None
    return dataclasses.replace(budget, max_tokens=min(per_pair, budget.max_tokens),
                               max_tokens_from=f"fitted to data.max_length={max_length}")


def build_sample(window: dict, video: VideoFile, processor, cfg: View, budget: Budget, geometry: dict,
                 keep_pixels: bool = False) -> dict:
    """The window's sample; its frames stored as the sample store keeps them or, with ``keep_pixels`` (a
    prompt to answer now, never stored), the processor's ``pixel_values_videos`` themselves (float16, as
    :mod:`videosft.media.pixels` makes them of stored frames): no lossless images to encode and decode
    again and no second pass of the processor."""
    max_length = cfg.data.max_length
    clip, encoded, input_ids, grid, visual_tokens, answer, decode_seconds = encode_window(
        window, video, processor, cfg, budget, geometry)
    # Never truncate: lower this sample's per-frame budget until it fits (policy fit), or reject it.
    for _ in range(3):
        if len(input_ids) <= max_length or cfg.data.overlong != "fit":
            break
        smaller = fitted_budget(budget, len(input_ids), visual_tokens, grid[0], max_length)
        if smaller is None or smaller.max_tokens >= budget.max_tokens:
            break
        budget = smaller
        clip, encoded, input_ids, grid, visual_tokens, answer, seconds = encode_window(
            window, video, processor, cfg, budget, geometry)
        decode_seconds += seconds
    if len(input_ids) > max_length:
        raise SampleError(
            "too_long", f"{len(input_ids)} tokens exceed data.max_length={max_length} ({visual_tokens} visual"
            + (", even at the smallest per-frame budget video.min_tokens" if cfg.data.overlong == "fit" else "")
            + "); lower the video budget or raise data.max_length"
        )
    tokenizer = processor.tokenizer
    labels = assistant_labels(input_ids, tokenizer, answer, cfg.prompt.think_block)
    supervised = sum(label != -100 for label in labels)
    return {
        "window_id": window["window_id"],
        "split": window["split"],
        "video": window["video"],
        "query": window["query"],
        "window_start": window["window_start"],
        "window_end": window["window_end"],
        "keep_local": window["keep_local"],
        "answer": answer,
        "frame_indices": clip.frame_indices,
        "frame_times": clip.local_times,
        "video_grid_thw": list(grid),
        "source_size": [clip.source_height, clip.source_width],
        "frame_size": [clip.plan.height, clip.plan.width],
        "decoding": clip.decoding,
        "visual_tokens": visual_tokens,
        "text_tokens": len(input_ids) - visual_tokens,
        "input_tokens": len(input_ids),
        "supervised_tokens": supervised,
        "decode_seconds": decode_seconds,
        "budget_max_tokens": budget.max_tokens,
        "second_per_grid": float(encoded["second_per_grid_ts"][0]) if "second_per_grid_ts" in encoded else None,
        "input_ids": input_ids,
        "labels": labels,
        "mm_token_type_ids": encoded["mm_token_type_ids"][0].tolist(),
        **({"pixel_values_videos": encoded["pixel_values_videos"].half()} if keep_pixels
           else stored_frames(clip.frames)),
    }
