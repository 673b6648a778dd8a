"""Stage predict: new videos in, the cut list a video editor opens out.

Each video is cut into windows by the window stage's rules (``window.*``; a ``drop`` tail is
read as ``shift``, so that no second goes unjudged), every window's prompt is built by the same
code as the training samples (:func:`videosft.encoding.samples.build_sample`: budget, layout, time base,
chat template), the model answers greedily in left-padded batches with its KV cache
(:func:`videosft.evaluation.generation.greedy_answers`, as in the verify stage's evaluation; bf16 on a GPU),
each answer is parsed by the training format's parser, moved to source time and merged across
overlapping windows (:mod:`videosft.evaluation.cutlist` states the rule). Per video it writes ``keep.json``
(the source-time ranges; per window its answer, parse status, degeneracy and ranges) and
the timeline as ``.otio``, ``.edl`` (CMX 3600) and ``.xml`` (Final Cut Pro 7), each clip
referencing the source file; with ``predict.render: true`` also the cut video. A video that
cannot be decoded, or a window that cannot be encoded, is recorded with its reason; the others
go on. A video left without a cut list (it cannot be opened, or none of its windows can be encoded)
is skipped: the stage's closing lines name each skipped video and why, ``summary.json`` lists them
under ``skipped``, and past ``predict.max_skipped`` (0 by default) the stage fails, after writing
everything else, with a message naming them. With ``predict.videos: val`` the windows are the
window stage's val windows, and the merged ranges are scored against the annotations in source
time (``evaluation.json``). While the model answers, host threads open the next videos and decode and
prompt their windows (predict.prepare_threads), and the model answers the windows of successive videos
together, predict.batch_size at a time, in the same batches whatever the threads' timing. The summary's
seconds per part therefore overlap (summed over threads), and windows/s is counted over the wall time
after the model's load, less the kernels' checks (``check_kernels``: once per run, at the first batch).

    python -m videosft.stages.predict --config config.yaml --adapter results/train/adapter --out results/predict
    python -m videosft.stages.predict --config config.yaml --out results/predict    # model.path merged (export)
    python -m videosft.stages.predict --config config.yaml --out results/predict --keep results/predict/0000-x/keep.json

The last form writes a keep.json's timelines again, after a person corrected its ``ranges`` (source
seconds, as predict wrote them); its ``clock`` says how they map onto the file's frames
(:mod:`videosft.media.clock`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from pathlib import Path

from .. import config as config_lib
from ..config import View
from ..data.rejects import Rejects, TooManyRejects
from ..data.windows import new_video_windows, read_windows, windows_by_video
from ..encoding.chat import parse_answer
from ..encoding.prompts import window_prompts
from ..errors import ConfigError, Rejected
from ..evaluation.cutlist import evaluate_in_source_time, merge_votes, to_source
from ..evaluation.generation import Prompts, answered_in_order, greedy_answers
from ..evaluation.inference_model import load_model
from ..evaluation.metrics import source_time_headline
from ..kernels import selection
from ..media.clock import MediaClock, media_clock
from ..media.editor_timelines import write_timelines
from ..media.video import VideoFile
from ..provenance import existing_path, exit_after, kept_path, run_record, stage_parser, write_json
from ..training.batches import made_ahead

VIDEO_SUFFIXES = {".mp4", ".mov", ".mkv", ".avi", ".webm", ".m4v"}


def videos_to_predict(cfg: View, windows_path: Path | None) -> dict[tuple[str, str | None], list[dict] | None]:
    """(video path, query) -> its windows (the window stage's, for ``val``) or None (cut here)."""
    source = cfg.predict.videos
    if source == "val":
        if windows_path is None:
            raise ConfigError("predict.videos is val: give --windows results/window/windows.parquet")
        return windows_by_video(read_windows(windows_path, "val"), Path(cfg.data.root))
    path = Path(source)
    if path.is_dir():
        found = {(str(p), None): None for p in sorted(path.rglob("*")) if p.suffix.lower() in VIDEO_SUFFIXES}
        if not found:  # else the run would end on "no video could be read", which is not what happened
            raise ConfigError(f"predict.videos: {source} holds no video ({', '.join(sorted(VIDEO_SUFFIXES))}, in "
                              "it or below); point predict.videos at a folder of videos or at one video")
        return found
    if path.is_file():
        return {(str(path), None): None}
    raise ConfigError(f"predict.videos: {source} is neither val, a video file nor a folder")


@dataclasses.dataclass
class Opened:
    """A video opened and cut into windows, its prompts not made yet."""
    index: int  # its place among the videos asked for: names its output folder
    path: Path
    shown: str
    name: str
    video: VideoFile
    source_windows: list[dict]  # the window stage's (val), with their keep ranges; [] for a new video
    windows: list[dict]
    open_seconds: float


def skipped_video(path: Path, shown: str, code: str, message: str) -> dict:
    """A video left without a cut list, as summary.json lists it: ``shown`` is how the closing lines name it
    and ``reason`` the reject's message (what is wrong, what to do), without the path it starts with."""
    reason = message[len(str(path)):].lstrip() if message.startswith(str(path)) else message
    return {"video": str(path), "shown": shown, "code": code, "reason": reason}


def shown_name(path: Path, windows: list[dict] | None, cfg: View) -> str:
    """How a person finds the video: its path inside predict.videos (a folder), its file name (one file), or
    for the val split its annotation's video and query."""
    if windows:
        return windows[0]["video"] + (f" [{windows[0]['query']}]" if windows[0]["query"] else "")
    folder = Path(cfg.predict.videos)
    return str(path.relative_to(folder)) if folder.is_dir() and path.is_relative_to(folder) else path.name


def open_video(index: int, path: Path, windows: list[dict] | None, cfg: View, rejects: Rejects) -> Opened | dict:
    """One video opened and cut into windows (or given the window stage's); if it cannot be read, what
    :func:`skipped_video` says of it."""
    started = time.perf_counter()
    shown = shown_name(path, windows, cfg)
    try:
        video = VideoFile(path)
    except ValueError as error:  # a Rejected (its code: video_undecodable, too_few_frames, ...) or a bug's
        rejects.add(str(path), error, video=shown)
        return skipped_video(path, shown, error.code if isinstance(error, Rejected) else "unexpected", str(error))
    name, source_windows = (shown if windows else path.name), windows or []
    windows = windows or new_video_windows(path.name, video.duration, cfg.predict.query or cfg.prompt.default_query,
                                           cfg.window)
    return Opened(index, path, shown, name, video, source_windows, windows, time.perf_counter() - started)


def runs_of(opened: Opened | dict, size: int):
    """An opened video's windows in runs of ``size``, the unit a host thread prepares, as (video, first,
    end): a long video's runs are prepared on several threads at once. A skipped video as it is."""
    if isinstance(opened, dict):
        yield opened
        return
    for first in range(0, max(1, len(opened.windows)), size):  # a video without windows still comes, to be skipped
        yield opened, first, min(first + size, len(opened.windows))


def prompt_run(run: tuple | dict, processor, cfg: View, rejects: Rejects) -> Prompts | dict:
    """The prompts of a run of a video's windows. The runs of one video are made on several threads at once,
    and a decoder is not to be shared between threads: every run but the first decodes with a reader of its own."""
    if isinstance(run, dict):
        return run
    opened, first, end = run
    windows, last = opened.windows[first:end], end == len(opened.windows)
    started = time.perf_counter()
    try:
        video = opened.video if first == 0 else opened.video.with_own_reader()
    except Rejected as error:  # the file changed or went away since it was opened: these windows are lost
        for window in windows:
            rejects.add(window["window_id"], error, video=opened.name)
        return Prompts(opened, [], [], last)
    seconds = {"open": time.perf_counter() - started, "decode": 0.0, "preprocess": 0.0}
    prompts, results = window_prompts(video, windows, processor, cfg, rejects, seconds)
    return Prompts(opened, prompts, results, last, seconds)


def cut_list(opened: Opened, results: list[dict], min_agreement: float, rejects: Rejects) -> dict:
    """A video's answered windows parsed, moved to source time and merged into the ranges to keep."""
    for result in results:
        text, local = result["answer"], parse_answer(result["answer"])
        result.update(parsed=local is not None, ranges_local=local,
                      ranges=None if local is None else to_source(local, result["start"], result["end"]))
        if local is None:
            rejects.add(result["window_id"], f"answer {text!r} is not in the answer format; the window "
                        "abstains from the merge", code="answer_format", video=opened.name)
    ranges = merge_votes(results, min_agreement)
    video = opened.video
    return {"video": str(opened.path), "name": opened.name, "duration": video.duration,
            "clock": media_clock(video).as_json(), "ranges": ranges,
            "kept_seconds": sum(end - start for start, end in ranges), "merge": {"min_agreement": min_agreement},
            "windows": results, "source_windows": [{"window_id": w["window_id"], "keep_source": w.get("keep_source") or []}
                                                   for w in opened.source_windows]}


def unencoded(opened: Opened, rejects: Rejects) -> dict:
    """A video none of whose windows could be encoded, as skipped: an empty cut list would read as "nothing
    worth keeping" for a video the model never saw."""
    ids = {window["window_id"] for window in opened.windows}
    first = next((item for item in list(rejects.items) if item["where"] in ids),
                 {"code": "unexpected", "error": "no window"})
    return skipped_video(opened.path, opened.shown, first["code"], f"none of its {len(opened.windows)} windows "
                         f"could be encoded (the first: {first['error']})")


def write_outputs(result: dict, out: Path, render: bool) -> dict[str, str]:
    """keep.json, the editor timelines and, with ``render``, the cut video, in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "keep.json", result)
    return write_cut(result, out, render)


def write_cut(keep: dict, out: Path, render: bool) -> dict[str, str]:
    """A keep list's timelines (.otio, .edl, .xml) and, with ``render``, its cut video."""
    video, clock = Path(keep["video"]), MediaClock.from_json(keep["clock"])
    ranges = [tuple(r) for r in keep["ranges"]]
    files = write_timelines(video, clock, ranges, out, video.stem, f"{video.stem} (videosft cut list)")
    if render:
        from ..media.render import render_cut

        cut = render_cut(video, ranges, out / f"{video.stem}.cut.mp4", clock)
        if cut is not None:
            files["mp4"] = str(cut)
    return files


def recut(keep_files: list[Path], render: bool) -> dict[str, dict]:
    """The timelines (and cut videos) again from keep.json files, perhaps corrected by hand, beside each."""
    from ..data.predict_summary import read_keep

    return {str(path): write_cut(read_keep(path), path.parent, render) for path in keep_files}


def predict(cfg: View, adapter: Path | None, windows_path: Path | None, out: Path, record: dict,
            kept_rejects: Path | None = None) -> None:
    from transformers import AutoProcessor

    # first of all, so that a run that fails never leaves an earlier run's cut lists looking like its own
    for stale in [*out.glob("[0-9][0-9][0-9][0-9]-*"), out / "evaluation.json"]:
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink(missing_ok=True)
    videos = videos_to_predict(cfg, windows_path)
    processor = AutoProcessor.from_pretrained(cfg.model.path)
    started = time.perf_counter()
    model = load_model(Path(cfg.model.path), adapter, merge=True)
    timings = {"load_model": time.perf_counter() - started, "check_kernels": 0.0, "open": 0.0, "decode": 0.0,
               "preprocess": 0.0, "generate": 0.0}
    rejects = Rejects(out / "rejects.jsonl", kept_rejects)
    started = time.perf_counter()
    kernels = {}
    results, outputs, skipped = cut_videos(videos, model, processor, cfg, rejects, timings, out, kernels)
    # the parts overlap: this is the wall time, without the kernels' checks (once per run, as the load is)
    timings["after_load"] = time.perf_counter() - started - timings["check_kernels"]
    windows = sum(len(r["windows"]) for r in results)
    record["results"] = {"source": cfg.predict.videos, "model": cfg.model.path,
                         "adapter": None if adapter is None else str(adapter), "kernels": kernels,
                         "min_agreement": cfg.predict.min_agreement,
                         "videos": len(videos), "predicted": len(results), "windows": windows,
                         "rejects": rejects.summary(), "skipped": skipped, "max_skipped": cfg.predict.max_skipped,
                         "outputs": outputs, "seconds": timings,
                         "windows_per_second": windows / max(timings["after_load"], 1e-9)}
    if cfg.predict.videos == "val":
        record["results"]["evaluation"] = evaluate_in_source_time(results)
        write_json(out / "evaluation.json", record["results"]["evaluation"])
        print(f"predict: {source_time_headline(record['results']['evaluation'])}", flush=True)
    write_json(out / "summary.json", record["results"])  # before any failure below: the user sees everything
    print(closing(skipped, len(videos), out, cfg, rejects), flush=True)


def cut_videos(videos: dict, model, processor, cfg: View, rejects: Rejects, timings: dict, out: Path,
               kernels: dict) -> tuple[list[dict], dict[str, dict], list[dict]]:
    """Each video's cut list written under ``out``: (results, their files by video, the videos skipped).

    Videos are opened on one host thread and their windows' prompts made in runs of predict.batch_size on
    predict.prepare_threads more, ahead of the model, which answers them in batches across videos with the
    kernels the train stage binds (checked at the first batch; ``kernels`` gets what was bound)."""
    outputs, results, skipped = {}, [], []
    batch_size = cfg.predict.batch_size
    sources = [(index, Path(path), windows) for index, ((path, _query), windows) in enumerate(videos.items())]
    opened = made_ahead(sources, lambda source: open_video(*source, cfg, rejects))

    def runs():
        for video in opened:
            timings["open"] += video.open_seconds if isinstance(video, Opened) else 0.0
            yield from runs_of(video, batch_size)

    def counted(parts):
        for part in parts:
            for key, seconds in (part.seconds.items() if isinstance(part, Prompts) else ()):
                timings[key] += seconds
            yield part

    parts = made_ahead(runs(), lambda run: prompt_run(run, processor, cfg, rejects), prepare_threads(cfg, model.device))

    def answer(prompts: list[dict]) -> list[dict]:
        if not kernels:  # checked at the first batch's longest prompt: the lengths this run has
            started = time.perf_counter()
            kernels.update(selection.for_generation(model, model.device, max(len(p["input_ids"]) for p in prompts)))
            timings["check_kernels"] = time.perf_counter() - started
            print("\n".join(f"predict: {line}" for line in selection.summary(kernels, model.device)), flush=True)
        started = time.perf_counter()
        answers = greedy_answers(model, prompts, processor.tokenizer, processor.video_processor,
                                 cfg.predict.max_new_tokens, cfg.prompt.think_block, len(prompts))
        timings["generate"] += time.perf_counter() - started
        return [{"answer": a["answer"], "degenerate": a["degenerate"]} for a in answers]

    for video, answered in answered_in_order(counted(parts), answer, batch_size):
        if isinstance(video, Opened) and not answered:
            video = unencoded(video, rejects)
        if isinstance(video, dict):
            skipped.append(video)
            print(f"predict: skipped {video['shown']}: {video['reason']}", flush=True)
            continue
        result = cut_list(video, answered, cfg.predict.min_agreement, rejects)
        results.append(result)
        outputs[result["name"]] = write_outputs(result, out / f"{video.index:04d}-{video.path.stem}",
                                                cfg.predict.render)
        print(f"predict: {result['name']}: {len(result['ranges'])} ranges, {result['kept_seconds']:.1f} of "
              f"{result['duration']:.1f} s kept, {sum(not w.get('parsed', True) for w in result['windows'])} of "
              f"{len(result['windows'])} answers unparseable", flush=True)
    return results, outputs, skipped


def prepare_threads(cfg: View, device) -> int:
    """predict.prepare_threads, or as the cores allow on a GPU (up to 4; one core is the model's), else 1."""
    if cfg.predict.prepare_threads is not None:
        return cfg.predict.prepare_threads
    return max(1, min(4, (os.cpu_count() or 1) - 1)) if device.type == "cuda" else 1


def closing(skipped: list[dict], total: int, out: Path, cfg: View, rejects: Rejects) -> str:
    """The run's last words: how many videos have a cut list and, by name, each one skipped and why. Past
    predict.max_skipped, or with nothing cut at all, the same listing as the stage's error instead.

    A skip's log line scrolls away on a folder of hundreds of videos, so the skips are named again at the
    end, where a person looks (on a failure in the ``error:`` message, which a failed workflow job shows)."""
    listing = "".join(f"\n  {item['shown']}: {item['reason']}" for item in skipped)
    limit, cut = cfg.predict.max_skipped, total - len(skipped)
    if skipped and not cut:  # whatever max_skipped says: nothing was done (one file, or a folder of bad ones)
        raise ConfigError(f"no video of predict.videos ({cfg.predict.videos}) could be read:{listing}\n"
                          f"Every reject: {rejects.shown}")
    if limit is not None and len(skipped) > limit:
        raise TooManyRejects(
            f"predict skipped {len(skipped)} of {count(total, 'video')}, more than predict.max_skipped ({limit}) "
            f"allows; no cut list for:{listing}\nThe cut lists of the other {count(cut, 'video')} are in {out}, "
            f"every reject in {rejects.shown}. Fix or remove these videos, or raise predict.max_skipped (null: "
            "any number) to accept the skips.")
    if not skipped:
        others = f"; every reject: {rejects.shown}" if len(rejects) else ""
        return f"predict: a cut list for each of {count(total, 'video')} in {out}{others}"
    allowed = "any number" if limit is None else limit
    return (f"predict: skipped {len(skipped)} of {count(total, 'video')} (predict.max_skipped: {allowed}); the cut "
            f"lists of the other {cut} are in {out}, every reject in {rejects.shown}. No cut list for:{listing}")


def count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    parser.add_argument("--adapter", type=existing_path, help="adapter directory from the train stage; without it "
                        "model.path is used as it is (a merged checkpoint from the export stage)")
    parser.add_argument("--windows", type=existing_path, help="windows.parquet of the window stage (predict.videos: val)")
    parser.add_argument("--keep", type=existing_path, nargs="+", help="keep.json files (a cut list corrected by hand): "
                        "write their timelines (and, with predict.render, cut videos) again beside each; no model")
    args = parser.parse_args(argv)
    cfg = config_lib.load(args.config, "predict")
    if args.keep:
        for path, files in recut(args.keep, cfg.predict.render).items():
            print(f"predict: {path}: " + ", ".join(Path(f).name for f in files.values()), flush=True)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    with run_record("predict", args.out, cfg, args) as record:
        predict(cfg, args.adapter, args.windows, args.out, record, kept_path(args, "rejects.jsonl"))
    return 0


if __name__ == "__main__":
    exit_after(main)
