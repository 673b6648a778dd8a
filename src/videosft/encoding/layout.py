"""The tokens a video becomes in the prompt, rendered one way whatever transformers does, and checked.

Qwen3-VL and Qwen3.5 see a video as one block per frame pair, each after the pair's time::

    <0.3 seconds><|vision_start|><|video_pad|> x n<|vision_end|><1.3 seconds><|vision_start|>...

("blocks", the default). That is what the processor of the transformers release the Qwen3-VL
models were published with (4.57) and vLLM write, and what Qwen's own fine-tuning code trains on
(docs/video-layout.md has the evidence). transformers 5.x expands only the ``<|video_pad|>`` of the
chat template's ``<|vision_start|><|video_pad|><|vision_end|>``, so its output nests the blocks
inside one more ``<|vision_start|>`` ... ``<|vision_end|>`` pair ("nested", on purpose only).
Qwen2.5-VL has no markers: one block of every frame pair's tokens, its time in M-RoPE ("single").

:func:`template_text` prepares the chat template's text so that the installed processor's
expansion gives the chosen layout; :func:`check_layout` checks the token ids the model will see
against the layout rules, token by token, so a processor that expands otherwise fails loudly
instead of changing the training data.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import Rejected
from ..models.families import MARKER_LAYOUTS, QWEN_VISION, video_layouts

LAYOUTS = MARKER_LAYOUTS  # the layouts prompt.video_layout may name
VIDEO_START, VIDEO_PAD, VIDEO_END = QWEN_VISION.start, QWEN_VISION.pad, QWEN_VISION.end
PLACEHOLDER = VIDEO_START + VIDEO_PAD + VIDEO_END
MARKER = re.compile(r"^<(\d+(?:\.\d)?) seconds>$")


class LayoutError(Rejected):
    """The prompt's video tokens are not laid out as the layout rules say."""

    def __init__(self, message: str):
        super().__init__("video_layout", message)


def layout_name(layout: str, tells_time_by_grid: bool) -> str:
    """The layout a sample gets, as the families that tell time this way allow (videosft.models.families):
    Qwen2.5-VL's one block whatever is configured (it has no markers)."""
    if layout not in LAYOUTS:
        raise ValueError(f"video layout {layout!r} is not one of {LAYOUTS}")
    allowed = video_layouts(tells_time_by_grid)
    return layout if layout in allowed else allowed[0]


def template_text(text: str, layout: str) -> str:
    """The chat template's text, with its video placeholder made ready for the processor's expansion.

    For "blocks" the wrapper pair goes: the processor writes each frame pair's own pair. The chat
    template must have written exactly one placeholder (one video per sample)."""
    if text.count(PLACEHOLDER) != 1:
        raise LayoutError(f"the chat template wrote {text.count(PLACEHOLDER)} video placeholders "
                          f"{PLACEHOLDER!r}, not one")
    return text.replace(PLACEHOLDER, VIDEO_PAD) if layout == "blocks" else text


@dataclass(frozen=True)
class VideoTokens:
    start: int
    pad: int
    end: int

    @classmethod
    def of(cls, tokenizer) -> "VideoTokens":
        return cls(*(tokenizer.convert_tokens_to_ids(token) for token in (VIDEO_START, VIDEO_PAD, VIDEO_END)))


def check_layout(input_ids: list[int], tokens: VideoTokens, decode, layout: str, pair_tokens: list[int]) -> None:
    """The video region of ``input_ids`` is exactly ``layout`` with ``pair_tokens[k]`` visual tokens in
    frame pair k: for "blocks", per pair one ``<t seconds>`` marker then one vision block, nothing
    between, no vision token outside; "nested" the same inside one more start / end pair; "single"
    one block of all pairs' tokens. ``decode`` turns ids into text (the tokenizer's)."""
    starts = [i for i, token in enumerate(input_ids) if token == tokens.start]
    ends = [i for i, token in enumerate(input_ids) if token == tokens.end]
    pads = sum(token == tokens.pad for token in input_ids)
    if pads != sum(pair_tokens):
        raise LayoutError(f"{pads} video tokens in the prompt, the frame pairs need {sum(pair_tokens)}")
    if layout == "single":
        if len(starts) != 1 or len(ends) != 1 or input_ids[starts[0] + 1:ends[0]] != [tokens.pad] * pads:
            raise LayoutError(f"Qwen2.5-VL's video must be one block of {pads} video tokens; found "
                              f"{len(starts)} starts and {len(ends)} ends")
        return
    outer = layout == "nested"
    if len(starts) != len(pair_tokens) + outer or len(ends) != len(pair_tokens) + outer:
        raise LayoutError(f"{len(starts)} {VIDEO_START} and {len(ends)} {VIDEO_END} for {len(pair_tokens)} frame pairs "
                          f"in layout {layout!r} (expected {len(pair_tokens) + outer} of each)")
    blocks = list(zip(starts[outer:], ends[:len(ends) - outer]))
    previous = starts[0] if outer else None  # where the text before the next block begins
    for k, ((start, end), expected) in enumerate(zip(blocks, pair_tokens)):
        if input_ids[start + 1:end] != [tokens.pad] * expected:
            raise LayoutError(f"frame pair {k}: its vision block holds {end - start - 1} tokens, not {expected} "
                              "video tokens")
        if previous is None:  # the first block without an outer pair: its marker follows ordinary text
            previous = _marker_begin(input_ids, start, decode) - 1
            if input_ids[previous] == tokens.start:
                raise LayoutError("an extra vision start stands before the first frame pair's marker")
        between = decode(input_ids[previous + 1:start])
        if not MARKER.match(between):
            raise LayoutError(f"frame pair {k}: {between!r} stands before its vision block, not one "
                              "'<t seconds>' marker")
        previous = end
    if outer and ends[-1] != previous + 1:
        raise LayoutError(f"{decode(input_ids[previous + 1:ends[-1]])!r} stands between the last frame pair and "
                          f"the outer {VIDEO_END}")


def _marker_begin(input_ids: list[int], block_start: int, decode, longest: int = 16) -> int:
    """Index of the first id of the ``<t seconds>`` marker that ends at ``block_start`` (the
    shortest run of ids before it that decodes to a marker), or ``block_start`` if none does."""
    for begin in range(block_start - 1, max(block_start - longest, 0) - 1, -1):
        if MARKER.match(decode(input_ids[begin:block_start])):
            return begin
    return block_start
