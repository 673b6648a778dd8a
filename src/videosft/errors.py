"""The errors a user fixes: bad config, data, checkpoint or environment, explained by their message.

A stage run from the command line ends on a :class:`UserError` with its message and a non-zero
exit, without a traceback (``VIDEOSFT_DEBUG=1`` shows it); any other exception is a bug and keeps
its traceback (:func:`videosft.provenance.exit_after`).
"""


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
