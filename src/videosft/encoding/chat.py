"""The conversation a sample is rendered into, its answer format, and the label mask.

Answer format (window-local seconds, one decimal, ascending, comma-separated)::

    1.5-3.0, 4.5-7.5        two ranges to keep
    none                    nothing to keep

The same module parses it back (:func:`parse_answer`), so training and evaluation can never
disagree on the format.
"""

from __future__ import annotations

import re

from ..config import View
from ..errors import Rejected
from ..models.families import CHATML

IGNORE_INDEX = -100
NOTHING = "none"
_RANGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*-\s*(\d+(?:\.\d+)?)\s*$")


def render_answer(ranges: list[list[float]] | list[tuple[float, float]]) -> str:
    if not ranges:
        return NOTHING
    return ", ".join(f"{start:.1f}-{end:.1f}" for start, end in ranges)


def parse_answer(text: str) -> list[tuple[float, float]] | None:
    """Ranges from an answer; ``[]`` for 'none'; ``None`` when the text is not in the format."""
    text = text.strip()
    if text == NOTHING:
        return []
    ranges = []
    for part in text.split(","):
        match = _RANGE.match(part)
        if not match:
            return None
        start, end = float(match.group(1)), float(match.group(2))
        if end <= start:
            return None
        ranges.append((start, end))
    return ranges or None


# A lenient reading, as lmms-eval's temporal-grounding tasks read answers: ranges anywhere in the
# text, "1.5-3.0", "1.5 to 3.0", "from 1.5s to 3.0s", "0:01.5 - 0:03", reversed bounds swapped.
_TIME = r"(\d+:)?(\d+(?:\.\d+)?)\s*(?:s|sec|secs|second|seconds)?"
_LENIENT_RANGE = re.compile(_TIME + r"\s*(?:-|–|—|to|and|until)\s*" + _TIME, re.IGNORECASE)
_NOTHING_WORDS = re.compile(r"^\W*(none|nothing|never|no)\b", re.IGNORECASE)


def _seconds(minutes: str | None, seconds: str) -> float:
    return (int(minutes[:-1]) * 60 if minutes else 0) + float(seconds)


def parse_answer_lenient(text: str) -> list[tuple[float, float]] | None:
    """Ranges read from an answer as a person would: every "a-b" / "a to b" in the text (seconds,
    with or without units, or m:ss), reversed bounds swapped, zero-length ranges dropped;
    ``[]`` for an answer that starts with none / nothing / never / no; ``None`` when neither
    is there. For a fair reading of a model that answers in prose; the fine-tune is held to
    :func:`parse_answer`."""
    ranges = []
    for match in _LENIENT_RANGE.finditer(text):
        start, end = _seconds(match.group(1), match.group(2)), _seconds(match.group(3), match.group(4))
        start, end = min(start, end), max(start, end)
        if end > start:
            ranges.append((start, end))
    if ranges:
        return ranges
    return [] if _NOTHING_WORDS.match(text.strip()) else None


def messages(prompt_cfg: View, query: str | None, answer: str | None = None) -> list[dict]:
    instruction = prompt_cfg.instruction.replace("{query}", query or prompt_cfg.default_query)
    turns = [
        {"role": "system", "content": prompt_cfg.system},
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": instruction}]},
    ]
    if answer is not None:
        turns.append({"role": "assistant", "content": answer})
    return turns


# Keyword arguments every chat template is rendered with. Qwen3 / Qwen3.5's hybrid-thinking
# templates (a family's ``thinking`` in videosft.models.families) write an empty think block in the
# last assistant turn, and end a generation prompt in it with enable_thinking=False; templates
# without thinking ignore the argument. The turn tokens and the block are every family's (CHATML):
# the labels are made from the tokenizer alone.
TEMPLATE_KWARGS = {"enable_thinking": False}


def template_kwargs(processor) -> dict:
    """:data:`TEMPLATE_KWARGS` the processor's chat template reads: transformers hands any other keyword to the
    processor's call instead, and warns about it on every sample."""
    template = processor.chat_template if isinstance(processor.chat_template, str) else str(processor.chat_template)
    return {key: value for key, value in TEMPLATE_KWARGS.items() if key in template}


EMPTY_THINK = CHATML.empty_think
THINK_BLOCK_PLACES = ("prompt", "answer")


def assistant_labels(input_ids: list[int], tokenizer, answer: str, think_block: str = "prompt") -> list[int]:
    """Labels that supervise only the last assistant turn: its answer tokens and ``<|im_end|>``.

    Where the chat template wrote an empty think block before the answer, ``think_block`` says
    whose it is: the prompt's (never supervised; generation starts after it) or the answer's
    (supervised with it; generation starts before it). docs/video-layout.md says why "prompt" is the
    default. Fails, naming what it found, if the answer is not there whole (truncated or re-tokenized).
    """
    if think_block not in THINK_BLOCK_PLACES:
        raise ValueError(f"prompt.think_block {think_block!r} is not one of {THINK_BLOCK_PLACES}")
    im_start = tokenizer.convert_tokens_to_ids(CHATML.turn_start)
    im_end = tokenizer.convert_tokens_to_ids(CHATML.turn_end)
    header = tokenizer(CHATML.assistant_header, add_special_tokens=False)["input_ids"]
    starts = [i for i, token in enumerate(input_ids) if token == im_start]
    if not starts:
        raise Rejected("answer_labels", "no <|im_start|> in the sample: the chat template did not render")
    begin = starts[-1] + 1
    if input_ids[begin:begin + len(header)] != header:
        raise Rejected("answer_labels", "the last turn is not the assistant's")
    begin += len(header)
    think = tokenizer(EMPTY_THINK, add_special_tokens=False)["input_ids"]
    expected = answer
    if input_ids[begin:begin + len(think)] == think:
        if think_block == "prompt":
            begin += len(think)
        else:
            expected = EMPTY_THINK + answer
    try:
        end = input_ids.index(im_end, begin)
    except ValueError:
        raise Rejected("answer_labels", "the assistant turn has no <|im_end|>: the answer was truncated") from None
    decoded = tokenizer.decode(input_ids[begin:end])
    if decoded != expected:
        raise Rejected("answer_labels", f"the supervised span decodes to {decoded!r}, not the answer {expected!r}")
    labels = [IGNORE_INDEX] * len(input_ids)
    labels[begin:end + 1] = input_ids[begin:end + 1]
    return labels


def prompt_of(row: dict) -> dict:
    """The sample up to the assistant's answer (where :func:`assistant_labels` starts supervising):
    what the model sees before it must answer."""
    start = next(i for i, label in enumerate(row["labels"]) if label != IGNORE_INDEX)
    return {**row, "input_ids": row["input_ids"][:start], "labels": [IGNORE_INDEX] * start,
            "mm_token_type_ids": row["mm_token_type_ids"][:start]}


def generated_answer(text: str) -> str:
    """A generated text without the empty think block that answers learned to begin with
    (``prompt.think_block: answer``); any other text is left as it is, for the parser to judge."""
    return text[len(EMPTY_THINK):] if text.startswith(EMPTY_THINK) else text


_TIMESTAMP = re.compile(r"<(\d+(?:\.\d+)?) seconds>")


def prompt_timestamps(text: str) -> list[float]:
    """The ``<t seconds>`` markers the Qwen3-VL processor writes before each frame pair."""
    return [float(value) for value in _TIMESTAMP.findall(text)]
