"""From window answers to the cut list an editor opens: ranges in source time, merged across
overlapping windows, written as an OpenTimelineIO timeline (and, through its adapters, a CMX 3600
EDL and Final Cut Pro 7 XML, which Premiere, Resolve and Final Cut import).

**The merge rule.** Each window that answered in the format votes on the time it covers: keep
where its answer keeps, cut elsewhere. A moment of the video is kept when at least
``min_agreement`` of the windows that cover it and answered say keep (with the default 0.5 and
two overlapping windows, one is enough; with three, two are). Windows whose answer did not parse
abstain; a moment that only such windows cover is cut. The rule is applied exactly, on the
elementary intervals between all window and range boundaries, not on a time grid.

The cut lists of annotated videos are scored in source time (:func:`evaluate_in_source_time`).
"""

from __future__ import annotations

from pathlib import Path

from ..media.timeline import Range, merge_ranges
from .metrics import source_time_metrics


def to_source(local: list[Range], window_start: float, window_end: float) -> list[Range]:
    """Window-local ranges in source seconds, clipped to the window."""
    ranges = []
    for start, end in local:
        start, end = window_start + start, min(window_start + end, window_end)
        if end > start:
            ranges.append((start, end))
    return ranges


def merge_votes(windows: list[dict], min_agreement: float) -> list[Range]:
    """Source-time ranges to keep from ``windows`` ({"start", "end", "ranges": source ranges, or
    None for an answer that did not parse}), by the rule in the module docstring."""
    voters = [w for w in windows if w["ranges"] is not None]
    points = sorted({t for w in voters for t in (w["start"], w["end"], *(x for r in w["ranges"] for x in r))})
    kept: list[list[float]] = []
    for left, right in zip(points, points[1:]):
        middle = (left + right) / 2
        covering = [w for w in voters if w["start"] <= middle < w["end"]]
        keeping = [w for w in covering if any(s <= middle < e for s, e in w["ranges"])]
        if keeping and len(keeping) >= min_agreement * len(covering):
            if kept and kept[-1][1] == left:
                kept[-1][1] = right
            else:
                kept.append([left, right])
    return [(start, end) for start, end in kept]


FALLBACK_RATE = 24.0


def timeline_rate(fps: float) -> float:
    """The video's frame rate when it is a timecode rate an EDL can carry (23.976 to 60), else 24
    frames per second (editors conform by timecode; the times stay the same seconds, to 1/24 s)."""
    import opentimelineio as otio

    return fps if otio.opentime.RationalTime.is_smpte_timecode_rate(fps) else FALLBACK_RATE


def timeline(video: Path, ranges: list[Range], rate: float, duration: float, name: str):
    """An OpenTimelineIO timeline with one clip per kept range, each referencing the source file,
    at ``rate`` frames per second (:func:`timeline_rate`)."""
    import opentimelineio as otio

    def time(seconds: float):
        return otio.opentime.RationalTime(round(seconds * rate), rate)

    media = otio.schema.ExternalReference(target_url=str(Path(video).resolve()),
                                          available_range=otio.opentime.TimeRange(time(0), time(duration)))
    track = otio.schema.Track(name="V1", kind=otio.schema.TrackKind.Video)
    for index, (start, end) in enumerate(ranges, start=1):
        clip = otio.schema.Clip(name=f"{Path(video).stem}_keep{index:03d}", media_reference=media.clone(),
                                source_range=otio.opentime.TimeRange(time(start), time(end) - time(start)))
        track.append(clip)
    result = otio.schema.Timeline(name=name)
    result.tracks.append(track)
    return result


EDITOR_FILES = {"otio": "otio_json", "edl": "cmx_3600", "xml": "fcp_xml"}


def write_timelines(timeline_, out: Path, stem: str) -> dict[str, str]:
    """The timeline as .otio, .edl (CMX 3600) and .xml (Final Cut Pro 7 XML); the files written."""
    import opentimelineio as otio

    written = {}
    for suffix, adapter in EDITOR_FILES.items():
        path = out / f"{stem}.{suffix}"
        if adapter == "cmx_3600" and not timeline_.find_clips():
            # the CMX 3600 writer fails on a timeline without events; an EDL of none is its header
            path.write_text(f"TITLE: {timeline_.name}\nFCM: NON-DROP FRAME\n")
        else:
            otio.adapters.write_to_file(timeline_, str(path), adapter_name=adapter)
        written[suffix] = str(path)
    return written


def clip_ranges(path: Path, adapter: str | None = None) -> list[Range]:
    """The (start, end) source seconds of every clip of an editor file, as OpenTimelineIO reads it."""
    import opentimelineio as otio

    read = otio.adapters.read_from_file(str(path), adapter_name=adapter)
    return [(clip.source_range.start_time.to_seconds(), clip.source_range.end_time_exclusive().to_seconds())
            for clip in read.find_clips()]


def evaluate_in_source_time(results: list[dict]) -> dict:
    """The merged source-time ranges against what the annotations keep, per video and query: the
    window stage's keep ranges of the val windows, joined back into source time (so fragments it
    dropped as shorter than window.min_fragment are not asked for). ``results``: the predict
    stage's per video and query (``name``, ``ranges``, ``source_windows``)."""
    predicted = {r["name"]: r["ranges"] for r in results}
    targets = {r["name"]: merge_ranges([tuple(x) for w in r["source_windows"] for x in w["keep_source"]])[0]
               for r in results}
    return source_time_metrics(predicted, targets)
