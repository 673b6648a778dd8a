"""A video's clock as an editor counts it: its frame rate, its start timecode and where its first frame is.

Editors number a file's frames from its first decoded frame and label frame 0 with the file's start
timecode (a camera's ``tmcd`` track or ``timecode`` tag; 00:00:00:00 when it has none). predict's
ranges are seconds on the player's clock, which an MP4/MOV edit list can start later than the first
frame (an empty edit of 1 s shows frame 0 at 1.0 s). So a time ``t`` is frame
``start + round((t - first_frame_seconds) x rate)`` of the file (:meth:`MediaClock.frame_at`).

The rate (:func:`timeline_rate`), recorded with its rule in keep.json:

* **exact**: the stream's average rate is a standard one (29.97 however it is spelled: 30000/1001 or
  2997/100; 23.976, 59.94, and whole rates from 1 to 120 such as 15 fps screen recordings);
* **nearest**: within 1% of a standard rate with evenly spaced frames (a phone's 30.04 average from
  jittered timestamps is 30);
* **variable**: frame intervals that differ by more than 20%: the lowest of 23.976, 24, 25, 29.97,
  30, 50, 59.94, 60 at or above the fastest stretch's rate, so that no two frames share a timeline
  frame; frames are then counted by time, as editors conform variable-rate media.

Drop-frame timecode is used where the rate is 29.97 or 59.94 and the file's own start timecode is
written drop-frame (``;`` before the frames), otherwise non-drop.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from fractions import Fraction

import numpy as np

NTSC = tuple(Fraction(n * 1000, 1001) for n in (24, 30, 48, 60, 120))
STANDARD = sorted({*NTSC, *(Fraction(n) for n in range(1, 121))})
EDITOR_RATES = (Fraction(24000, 1001), Fraction(24), Fraction(25), Fraction(30000, 1001), Fraction(30),
                Fraction(50), Fraction(60000, 1001), Fraction(60))
NEAREST = 0.01  # an average this close (relative) to a standard rate is that rate
VARIABLE = 1.2  # frame intervals whose 95th / 5th percentiles differ more than this: variable rate


def timeline_rate(average_fps: float, intervals: np.ndarray) -> tuple[Fraction, str]:
    """The rate a timeline of this video counts in, and the rule that chose it (module docstring)."""
    spread = intervals[intervals > 0]
    if len(spread) > 2 and np.percentile(spread, 95) > VARIABLE * np.percentile(spread, 5):
        fastest = 1 / float(np.percentile(spread, 5))
        rate = next((r for r in EDITOR_RATES if float(r) >= fastest * (1 - 1e-4)), EDITOR_RATES[-1])
        return rate, (f"variable: frame intervals {np.percentile(spread, 5):.4f}-{np.percentile(spread, 95):.4f} s; "
                      f"the lowest editor rate at or above the fastest stretch ({fastest:.3f} fps), frames counted by time")
    nearest = min(STANDARD, key=lambda r: abs(float(r) - average_fps))
    error = abs(float(nearest) - average_fps) / average_fps
    if error < 1e-4:
        return nearest, "exact"
    if error < NEAREST:
        return nearest, f"nearest standard rate to the measured average {average_fps:.4f} fps (timestamps jitter)"
    rate = Fraction(max(1, round(average_fps)))
    return rate, f"no standard rate within 1% of {average_fps:.4f} fps: the nearest whole rate, frames counted by time"


def nominal(rate: Fraction) -> int:
    """The timecode's frames per second: 30 for 29.97."""
    return round(float(rate))


def dropped_per_minute(rate: Fraction) -> int:
    return 2 * nominal(rate) // 30


def to_timecode(frames: int, rate: Fraction, drop: bool) -> str:
    """``frames`` as HH:MM:SS:FF (drop-frame: HH:MM:SS;FF, frames 0 and 1 of each minute but every
    tenth skipped at 29.97, 0-3 at 59.94)."""
    base = nominal(rate)
    if drop:
        skip = dropped_per_minute(rate)
        per_ten, per_minute = base * 600 - 9 * skip, base * 60 - skip
        tens, rest = divmod(frames, per_ten)
        frames += 9 * skip * tens + (skip * ((rest - skip) // per_minute) if rest >= skip else 0)
    hours, minutes = frames // (base * 3600) % 24, frames // (base * 60) % 60
    return f"{hours:02d}:{minutes:02d}:{frames // base % 60:02d}{';' if drop else ':'}{frames % base:02d}"


def from_timecode(text: str, rate: Fraction, drop: bool | None = None) -> int:
    """The frame count of a timecode; drop-frame when ``drop``, or by default when it is written with ``;``."""
    fields = re.fullmatch(r"(\d+):(\d+):(\d+)([:;.,])(\d+)", text.strip())
    if fields is None:
        raise ValueError(f"{text!r} is not a timecode HH:MM:SS:FF")
    hours, minutes, seconds, separator, frames = fields.groups()
    drop = separator in ";," if drop is None else drop
    total = ((int(hours) * 60 + int(minutes)) * 60 + int(seconds)) * nominal(rate) + int(frames)
    if drop:
        elapsed = int(hours) * 60 + int(minutes)
        total -= dropped_per_minute(rate) * (elapsed - elapsed // 10)
    return total


@dataclass(frozen=True)
class MediaClock:
    """What a timeline needs of one video file (module docstring)."""
    rate: Fraction
    rate_rule: str
    measured_fps: float
    start_timecode: str  # the file's own, or 00:00:00:00
    drop_frame: bool
    first_frame_seconds: float  # when the player shows frame 0
    frames: int  # the media's length in timeline frames, from frame 0
    width: int
    height: int
    audio_channels: int  # 0: no audio stream
    audio_rate: int

    @property
    def start_frame(self) -> int:
        return from_timecode(self.start_timecode, self.rate, self.drop_frame)

    def frame_at(self, seconds: float) -> int:
        """The file's frame number (start timecode included) shown at ``seconds`` on the player's clock."""
        return self.start_frame + round((seconds - self.first_frame_seconds) * self.rate)

    def seconds_at(self, frame: int) -> float:
        return self.first_frame_seconds + (frame - self.start_frame) / float(self.rate)

    def timecode(self, frame: int) -> str:
        return to_timecode(frame, self.rate, self.drop_frame)

    def as_json(self) -> dict:
        facts = asdict(self)
        facts["rate"] = f"{self.rate.numerator}/{self.rate.denominator}"
        return facts

    @classmethod
    def from_json(cls, facts: dict) -> MediaClock:
        return cls(**{**facts, "rate": Fraction(facts["rate"])})


def media_clock(video) -> MediaClock:
    """The clock of an open :class:`videosft.media.video.VideoFile`: its frames' times on the player's clock
    and the container's facts it read when opened."""
    timestamps, facts, tagged = video.timestamps, video.facts, video.facts.timecode
    first = float(timestamps[0])
    average = (len(timestamps) - 1) / max(float(timestamps[-1]) - first, 1e-9) if len(timestamps) > 1 else 1.0
    rate, rule = timeline_rate(average, np.diff(timestamps))
    drop = bool(tagged) and any(mark in tagged for mark in ";.,") and rate in (NTSC[1], NTSC[3])
    code = tagged if tagged and re.fullmatch(r"\d+:\d+:\d+[:;.,]\d+", tagged) else to_timecode(0, rate, drop)
    code = to_timecode(from_timecode(code, rate, drop), rate, drop)  # one spelling: ';' exactly when drop-frame
    return MediaClock(rate=rate, rate_rule=rule, measured_fps=round(average, 6), start_timecode=code, drop_frame=drop,
                      first_frame_seconds=first, frames=max(1, round((video.duration - first) * rate)),
                      width=facts.width, height=facts.height, audio_channels=facts.audio_channels,
                      audio_rate=facts.audio_rate)
