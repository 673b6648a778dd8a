"""The errors a user fixes: bad config, data, checkpoint or environment, explained by their message.

A stage run from the command line ends on a :class:`UserError` with its message and a non-zero
exit, without a traceback (``VIDEOSFT_DEBUG=1`` shows it); any other exception is a bug and keeps
its traceback (:func:`videosft.provenance.exit_after`).
"""

import re


class UserError(Exception):
    """A problem in what the user gave, with a message that names it and says what to do."""


class ConfigError(UserError, ValueError):
    """A config value or file that cannot be used."""


class InputError(UserError, ValueError):
    """A data, checkpoint or earlier stage's file that cannot be used as it is."""


# code -> the reason, in words a person acts on
REASONS = {
    "not_json": "not valid JSON",
    "bad_fields": "a field is missing or of the wrong type",
    "bad_keep_range": "a keep range is not [start, end] seconds with 0 <= start < end",
    "keep_after_end": "keep range ends after the video",
    "duplicate": "the same video and query twice",
    "no_duration": "no duration in the annotation",
    "video_missing": "video file does not exist",
    "video_outside_root": "video path leaves data.root",
    "video_undecodable": "video cannot be decoded",
    "video_empty": "video file is empty (0 bytes)",
    "video_truncated": "video file is cut off before the window",
    "too_few_frames": "too few frames",
    "too_long": "sample does not fit data.max_length",
    "budget_not_applied": "token budget did not take effect",
    "frame_times": "frame times disagree with the prompt's",
    "variable_frame_rate": "frame rate varies more than Qwen2.5-VL's fixed step allows",
    "video_layout": "video tokens not laid out as the model was trained on",
    "answer_labels": "answer not where its labels supervise it",
    "answer_format": "answer is not in the answer format",
    "unexpected": "unexpected error (a bug: please report it)",
}


class Rejected(ValueError):
    """An item a check turns away: ``code`` (a key of :data:`REASONS`) and a message naming the item's
    problem and what to do."""

    def __init__(self, code: str, message: str):
        if code not in REASONS:
            raise KeyError(f"reject code {code!r} is not one of {sorted(REASONS)}")
        super().__init__(message)
        self.code = code


# How a stage's own message starts on its log (provenance.exit_after prints it) and how much of a
# log's end shows when there is none (a bug's traceback, a killed process).
MESSAGE_START = "error: "
TAIL_LINES = 15
# What torchrun (the train stage's launcher) writes when a rank fails: its log lines ("E1203 11:55:21.453000
# 10433 .../api.py:1002] failed (exitcode: 1) ..."), then its own traceback ending in ChildFailedError and a
# summary box. They say only that a rank failed, and they came after the rank's message.
LAUNCHER_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ")
LAUNCHER_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
TRACEBACK = "Traceback (most recent call last):"


def own_lines(lines: list[str]) -> list[str]:
    """A stage log's lines without what its launcher (torchrun) reported about a failed rank."""
    failed = [i for i, line in enumerate(lines) if LAUNCHER_FAILED in line]
    if failed:
        lines = lines[:max((i for i in range(failed[-1]) if lines[i].startswith(TRACEBACK)), default=failed[-1])]
    return [line for line in lines if not LAUNCHER_LOG.match(line)]


def stage_message(log_text: str) -> str:
    """What a failed stage said last: its ``error:`` message to the end of the log, once even where each
    rank said it, else the log's last lines (a bug's traceback); never what torchrun adds after a failed
    rank."""
    lines = own_lines(log_text.rstrip().splitlines())
    starts = [i for i, line in enumerate(lines) if line.startswith(MESSAGE_START)]
    if not starts:
        return "\n".join(lines[-TAIL_LINES:])
    last = lines[starts[-1]]
    # each rank that failed so said it; one rank's copy may lack the record line another's has
    copies = [lines[start:end] for start, end in zip(starts, [*starts[1:], len(lines)]) if lines[start] == last]
    return "\n".join(max(copies, key=len))


def failed_jobs(snakemake_log: str) -> list[tuple[str, str]]:
    """(rule, its log file) for each job Snakemake's log reports failed (its "Error in rule" blocks)."""
    jobs = []
    for block in snakemake_log.split("Error in rule ")[1:]:
        rule = block.split(":", 1)[0].strip()
        log = re.search(r"^\s*log: (\S+)", block, re.MULTILINE)
        if log and (rule, log.group(1)) not in jobs:
            jobs.append((rule, log.group(1)))
    return jobs
