"""The predict and export stages: from videos to the cut lists an editor opens, and a merged checkpoint."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from conftest import saved_adapter, stage_json
from videosft import config as config_lib
from videosft.stages import export
from videosft.stages import predict
from videosft import reporting as report
from videosft.evaluation.cutlist import merge_votes
from videosft.media.clock import MediaClock, media_clock
from videosft.media.editor_timelines import read_ranges
from videosft.data.rejects import Rejects
from videosft.data.sample_store import read_samples
from videosft.data.windows import read_windows, windows_by_video
from videosft.encoding.prompts import window_prompts
from videosft.media.video import VideoFile


@pytest.fixture(scope="module")
def adapter(demo_dir, tmp_path_factory) -> Path:
    """A LoRA adapter with non-zero B (an untrained one would leave the base unchanged), as peft saves it."""
    import torch
    from transformers import AutoConfig

    from videosft.models.checkpoint import model_class

    model_dir = demo_dir / "model"
    base = model_class(AutoConfig.from_pretrained(model_dir)).from_pretrained(model_dir, dtype=torch.float32)
    return saved_adapter(base, tmp_path_factory.mktemp("adapter"), 4, 8, ["q_proj", "v_proj"])


def predict_cfg(demo_config: dict, **predict_cfg) -> config_lib.View:
    return config_lib.for_stage("predict", {**demo_config, "predict": predict_cfg})


def test_predict_feeds_the_model_the_training_prompt_of_each_window(prepared, demo_config):
    """Train/serve parity: for every val window, the token ids predict gives the model are the
    training sample's ids up to its answer, and the pixels are the same (a prompt keeps the processor's;
    a sample's are made again of its stored frames)."""
    import torch
    from transformers import AutoProcessor

    from videosft.media.pixels import pixel_values_videos

    cfg = predict_cfg(demo_config)
    processor = AutoProcessor.from_pretrained(cfg.model.path)
    samples = {row["window_id"]: row for row in read_samples(prepared / "preprocess" / "manifest.json", "val")}
    videos = windows_by_video(read_windows(prepared / "window" / "windows.parquet", "val"), Path(cfg.data.root))
    compared = 0
    for (path, _query), windows in videos.items():
        prompts, results = window_prompts(VideoFile(Path(path)), windows, processor, cfg,
                                          Rejects(Path("/tmp") / "unused-rejects.jsonl"))
        for prompt, result in zip(prompts, results):
            sample = samples[result["window_id"]]
            first = next(i for i, label in enumerate(sample["labels"]) if label != -100)
            assert prompt["input_ids"] == sample["input_ids"][:first], result["window_id"]
            assert prompt["video_grid_thw"] == sample["video_grid_thw"] and "frames" not in prompt
            assert torch.equal(pixel_values_videos(prompt, processor.video_processor),
                               pixel_values_videos(sample, processor.video_processor)), result["window_id"]
            compared += 1
    assert compared == len(samples) > 0


def test_merging_overlapping_windows():
    windows = [{"start": 0.0, "end": 8.0, "ranges": [(2.0, 6.0)]},
               {"start": 4.0, "end": 12.0, "ranges": [(5.0, 9.0)]},
               {"start": 8.0, "end": 16.0, "ranges": None}]  # unparseable: abstains
    assert merge_votes(windows, 0.5) == [(2.0, 9.0)]  # one of two covering windows is enough at 0.5
    assert merge_votes(windows, 1.0) == [(2.0, 4.0), (5.0, 6.0), (8.0, 9.0)]  # every covering window must agree
    assert merge_votes([{"start": 0.0, "end": 8.0, "ranges": []}], 0.5) == []


@pytest.fixture(scope="module")
def predicted(prepared, demo_config, adapter, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("predict")
    cfg = {**demo_config, "predict": {"batch_size": 3, "render": True}}
    assert predict.main(["--config", stage_json("predict", cfg), "--adapter", str(adapter), "--windows",
                         str(prepared / "window" / "windows.parquet"), "--out", str(out)]) == 0
    return out


@pytest.mark.slow  # the predicted fixture: about 10 s
def test_every_val_video_gets_ranges_and_timelines_an_editor_opens(predicted, prepared):
    summary = json.loads((predicted / "summary.json").read_text())
    val_videos = {row["video"] for row in read_windows(prepared / "window" / "windows.parquet", "val")}
    assert summary["predicted"] == len(val_videos) == len(summary["outputs"]) > 0
    seconds = summary["seconds"]  # where predict's time goes (bench/ reads it)
    assert set(seconds) == {"load_model", "check_kernels", "open", "decode", "preprocess", "generate", "after_load"}
    assert all(value > 0 for value in seconds.values()), seconds
    # the next video is read and prompted while the model answers: the parts overlap, so windows/s is
    # counted over the wall time after the model's load (and the kernels' checks, also once per run)
    assert summary["windows_per_second"] == pytest.approx(summary["windows"] / seconds["after_load"])
    for name, files in summary["outputs"].items():
        keep = json.loads((Path(files["otio"]).parent / "keep.json").read_text())
        assert all(w["answer"] is not None and "ranges" in w and isinstance(w["degenerate"], bool)
                   for w in keep["windows"])
        for start, end in keep["ranges"]:
            assert 0 <= start < end <= keep["duration"]
        clock = MediaClock.from_json(keep["clock"])  # the demo's 8 fps videos: an exact whole rate
        assert keep["clock"]["rate"] == "8/1" and keep["clock"]["rate_rule"] == "exact"
        for suffix in ("otio", "edl", "xml"):
            clips = read_ranges(Path(files[suffix]), clock)
            assert len(clips) == len(keep["ranges"]), (suffix, clips, keep["ranges"])
            for (start, end), (clip_start, clip_end) in zip(keep["ranges"], clips):  # to the frame
                tolerance = 0.5 / float(clock.rate) + 1e-9
                assert abs(clip_start - start) <= tolerance and abs(clip_end - end) <= tolerance
        if keep["ranges"]:
            rendered = VideoFile(Path(files["mp4"]))
            kept_frames = sum(len(VideoFile(Path(keep["video"])).window_frames(s, e)) for s, e in keep["ranges"])
            assert len(rendered.reader) == kept_frames
    evaluation = json.loads((predicted / "evaluation.json").read_text())
    assert evaluation["videos"] == len(val_videos) and evaluation["moments"] > 0
    assert {"R1@0.5", "mIoU", "keep_precision", "keep_recall"} <= set(evaluation)


@pytest.mark.slow  # the predicted fixture, and predict again
def test_the_cut_lists_do_not_depend_on_the_batches_or_the_host_threads(predicted, prepared, demo_config, adapter,
                                                                       tmp_path):
    """Windows answered one at a time, their prompts made on two threads in runs of one window (every run
    of a video but its first opens the file again), give the cut lists that batches of three across videos
    gave, window for window."""
    cfg = {**demo_config, "predict": {"batch_size": 1, "prepare_threads": 2}}
    assert predict.main(["--config", stage_json("predict", cfg), "--adapter", str(adapter), "--windows",
                         str(prepared / "window" / "windows.parquet"), "--out", str(tmp_path)]) == 0
    batched = sorted(predicted.glob("*/keep.json"))
    assert [p.parent.name for p in batched] == [p.parent.name for p in sorted(tmp_path.glob("*/keep.json"))]
    for path in batched:
        ours, theirs = json.loads((tmp_path / path.parent.name / "keep.json").read_text()), json.loads(path.read_text())
        assert len(ours["windows"]) >= 2, "a video of one window has no second run"
        assert ours["windows"] == theirs["windows"] and ours["ranges"] == theirs["ranges"], path.parent.name


@pytest.mark.slow  # the predicted fixture
def test_the_report_shows_the_source_time_evaluation_beside_the_window_level_one(predicted, tmp_path):
    evaluation = json.loads((predicted / "evaluation.json").read_text())
    result = report.make_report(report.Inputs(predict=predicted / "summary.json"), tmp_path)
    assert result["source_time"]["shown"] and "val videos" in result["source_time"]["note"]
    with open(tmp_path / "evaluation_source_time.csv") as handle:
        rows = {row["metric"]: row for row in csv.DictReader(handle)}
    assert set(rows) == {"R1@0.3", "R1@0.5", "R1@0.7", "mIoU", "keep_precision", "keep_recall", "videos", "moments",
                         "kept_seconds", "target_seconds"}
    for metric, row in rows.items():
        value = evaluation[metric]
        assert row["value"] == ("" if value is None else f"{value:.4f}") and row["definition"], metric
    page = (tmp_path / "evaluation.html").read_text()
    assert "Evaluation in source time" in page and "seconds kept that should be kept / seconds kept" in page
    assert "No evaluation to show" in page  # no verify.json given: the window-level table says so


def answers(out: Path) -> dict:
    return {w["window_id"]: w["answer"] for keep in out.rglob("keep.json")
            for w in json.loads(keep.read_text())["windows"]}


def test_the_rendered_cut_holds_exactly_the_kept_frames(demo_dir, tmp_path):
    from videosft.media.render import render_cut

    video = sorted((demo_dir / "videos").glob("*.mp4"))[0]
    ranges = [(1.0, 2.5), (4.0, 5.0)]
    source = VideoFile(video)
    clock = media_clock(source)
    cut = VideoFile(render_cut(video, ranges, tmp_path / "cut.mp4", clock))
    assert len(cut.reader) == sum(len(source.window_frames(start, end)) for start, end in ranges)
    assert render_cut(video, [], tmp_path / "none.mp4", clock) is None and not (tmp_path / "none.mp4").exists()


@pytest.mark.slow  # the predicted fixture
def test_a_keep_list_corrected_by_hand_is_written_again_without_a_model(predicted, demo_config, tmp_path):
    """predict --keep: a person edits keep.json's ranges; the timelines beside it follow, to the frame; a
    mistake in the edit is named (file, range) and nothing is written."""
    from videosft.errors import InputError

    keep_file = next(predicted.rglob("keep.json"))
    edited = tmp_path / "edited"
    shutil.copytree(keep_file.parent, edited)
    keep = json.loads((edited / "keep.json").read_text())
    keep["ranges"] = [[0.5, 1.25], [3.0, min(6.0, keep["duration"])]]
    (edited / "keep.json").write_text(json.dumps(keep))
    cfg = stage_json("predict", {**demo_config, "predict": {"render": False}})
    assert predict.main(["--config", cfg, "--out", str(tmp_path / "unused"), "--keep", str(edited / "keep.json")]) == 0
    clock = MediaClock.from_json(keep["clock"])
    stem = Path(keep["video"]).stem
    for suffix in ("edl", "xml", "otio"):
        read = read_ranges(edited / f"{stem}.{suffix}", clock)
        assert [(round(a, 3), round(b, 3)) for a, b in read] == [tuple(r) for r in keep["ranges"]], suffix
    keep["ranges"] = [[2.0, 1.0]]
    (edited / "keep.json").write_text(json.dumps(keep))
    with pytest.raises(InputError, match=r"keep.json: ranges\[0\] \[2.0, 1.0\]"):
        predict.main(["--config", cfg, "--out", str(tmp_path / "unused"), "--keep", str(edited / "keep.json")])
    (edited / "keep.json").write_text('{"ranges": [[1, 2],]}')
    with pytest.raises(InputError, match="not JSON at line 1"):
        predict.main(["--config", cfg, "--out", str(tmp_path / "unused"), "--keep", str(edited / "keep.json")])


def folder_with_a_broken_video(demo_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A folder of one demo video and ``broken.mp4``, which is no video at all: (the folder, the good video)."""
    folder = tmp_path / "videos"
    folder.mkdir()
    good = sorted((demo_dir / "videos").glob("*.mp4"))[0]
    shutil.copy2(good, folder / good.name)
    (folder / "broken.mp4").write_bytes(b"not a video")
    return folder, good


@pytest.mark.slow  # the adapter fixture and a predict run
def test_a_broken_video_in_a_folder_is_recorded_and_the_others_go_on(demo_dir, demo_config, adapter, tmp_path,
                                                                     capsys):
    folder, good = folder_with_a_broken_video(demo_dir, tmp_path)
    cfg = {**demo_config, "predict": {"videos": str(folder), "max_skipped": None}}
    assert predict.main(["--config", stage_json("predict", cfg), "--adapter", str(adapter),
                         "--out", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["videos"] == 2 and summary["predicted"] == 1 and list(summary["outputs"]) == [good.name]
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert any("broken.mp4" in r["where"] and "could not be decoded" in r["error"] for r in rejects)
    # counted by the Rejected's code, not the exception's class; listed as skipped, with its reason in words
    assert summary["rejects"]["by_code"]["video_undecodable"] == 1  # beside the untrained answers' answer_format
    assert "video cannot be decoded" in summary["rejects"]["by_reason"]
    assert [(s["shown"], s["code"]) for s in summary["skipped"]] == [("broken.mp4", "video_undecodable")]
    # the run's last lines name the skipped video and why, in words a person acts on
    closing = capsys.readouterr().out.rstrip().splitlines()[-2:]
    assert closing[0].startswith("predict: skipped 1 of 2 videos (predict.max_skipped: any number); the cut "
                                 f"lists of the other 1 are in {tmp_path / 'out'}")
    assert closing[1].startswith("  broken.mp4: could not be decoded as a video (")
    assert closing[1].endswith("; check the file or re-encode it")
    assert not any(name in closing[1] for name in ("ValueError", "Rejected", "video_undecodable"))  # words only

    # new videos have no annotations: the report has nothing to score, says so, and shows no numbers
    result = report.make_report(report.Inputs(predict=tmp_path / "out" / "summary.json"), tmp_path / "report")
    assert not result["source_time"]["shown"] and "nothing to score" in result["source_time"]["note"]
    assert (tmp_path / "report" / "evaluation_source_time.csv").read_text().splitlines() == ["metric,value,definition"]
    page = (tmp_path / "report" / "evaluation.html").read_text()
    assert "nothing to score: predict cut 1 of 2 new videos" in page and "keep_precision" not in page


@pytest.mark.slow  # the adapter fixture and two predict runs on one small video
def test_predict_fails_past_max_skipped_naming_the_videos_after_writing_what_it_could(demo_dir, demo_config,
                                                                                      adapter, tmp_path):
    from videosft.errors import ConfigError, UserError

    folder, good = folder_with_a_broken_video(demo_dir, tmp_path)
    out = tmp_path / "out"
    cfg = {**demo_config, "predict": {"videos": str(folder)}}  # max_skipped: 0, the default
    with pytest.raises(UserError) as raised:
        predict.main(["--config", stage_json("predict", cfg), "--adapter", str(adapter), "--out", str(out)])
    message = str(raised.value)
    assert "predict skipped 1 of 2 videos, more than predict.max_skipped (0) allows" in message
    assert "\n  broken.mp4: could not be decoded as a video (" in message and "raise predict.max_skipped" in message
    summary = json.loads((out / "summary.json").read_text())  # written before the failure: the user sees all
    assert summary["predicted"] == 1 and summary["skipped"][0]["code"] == "video_undecodable"
    assert "broken.mp4" in (out / "rejects.jsonl").read_text()
    assert [keep.parent.name.split("-", 1)[1] for keep in out.glob("*/keep.json")] == [good.stem]
    assert json.loads((out / "run_record.json").read_text())["status"] == "failed"

    # one video that cannot be read: nothing was done, whatever max_skipped allows
    cfg = {**demo_config, "predict": {"videos": str(folder / "broken.mp4"), "max_skipped": None}}
    with pytest.raises(ConfigError, match=r"could be read:\n  broken.mp4: could not be decoded"):
        predict.main(["--config", stage_json("predict", cfg), "--adapter", str(adapter), "--out", str(out)])


@pytest.mark.slow  # the adapter fixture and a predict run on one small video
def test_a_video_none_of_whose_windows_can_be_encoded_is_skipped_not_cut_to_nothing(demo_dir, demo_config,
                                                                                   adapter, tmp_path, monkeypatch):
    """An empty cut list would read as "nothing worth keeping" for a video the model never saw."""
    from videosft.encoding import prompts
    from videosft.errors import ConfigError, Rejected

    def undecodable(window, *_args, **_kwargs):
        raise Rejected("video_undecodable", f"frames of {window['window_id']} could not be decoded (test)")

    monkeypatch.setattr(prompts, "build_sample", undecodable)
    good = sorted((demo_dir / "videos").glob("*.mp4"))[0]
    cfg = {**demo_config, "predict": {"videos": str(good)}}
    with pytest.raises(ConfigError, match=rf"could be read:\n  {good.name}: none of its 2 windows could be encoded "
                                          rf"\(the first: frames of {good.name}#0 could not be decoded \(test\)\)"):
        predict.main(["--config", stage_json("predict", cfg), "--adapter", str(adapter), "--out", str(tmp_path)])
    assert not list(tmp_path.glob("*/keep.json"))
    assert json.loads((tmp_path / "summary.json").read_text())["skipped"][0]["code"] == "video_undecodable"


def test_an_empty_folder_is_named_before_the_model_loads(demo_config, tmp_path):
    from videosft.errors import ConfigError

    (tmp_path / "videos").mkdir()
    (tmp_path / "videos" / "notes.txt").write_text("no video here")
    cfg = {**demo_config, "predict": {"videos": str(tmp_path / "videos")}}
    with pytest.raises(ConfigError, match="videos holds no video .*point predict.videos at a folder of videos"):
        predict.main(["--config", stage_json("predict", cfg), "--out", str(tmp_path / "out")])


def test_max_skipped_is_declared_with_its_default_and_why():
    node = config_lib.schema()["properties"]["predict"]["properties"]["max_skipped"]
    assert node["default"] == 0 and node["type"] == ["integer", "null"] and node["minimum"] == 0
    for words in ("null allows any number", "closing lines", "summary.json", "exit status", "single video file"):
        assert words in " ".join(node["description"].split()), words
    view = config_lib.for_stage("predict", {"predict": {"max_skipped": "null"}})  # as Snakemake's --config passes it
    assert view.predict.max_skipped is None
    assert config_lib.resolve({})["predict"]["max_skipped"] == 0


@pytest.mark.slow  # about 10 s
def test_export_merges_into_a_checkpoint_that_loads_and_answers_like_base_plus_adapter(prepared, demo_config,
                                                                                         adapter, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoConfig

    from videosft.training.batches import collate
    from videosft.models.checkpoint import model_class
    from videosft.media.pixels import load_video_processor

    model_dir = Path(demo_config["model"]["path"])
    out = tmp_path / "merged"
    cfg = {**demo_config, "export": {"dtype": "float32"}}
    assert export.main(["--config", stage_json("export", cfg), "--adapter", str(adapter), "--out", str(out)]) == 0
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "model.safetensors.index.json"):
        assert (out / name).exists() or name == "model.safetensors.index.json" and (out / "model.safetensors").exists()
    assert (out / "config.json").read_text() == (model_dir / "config.json").read_text()
    cls = model_class(AutoConfig.from_pretrained(model_dir))
    merged = cls.from_pretrained(out, dtype=torch.float32).eval()
    unmerged = PeftModel.from_pretrained(cls.from_pretrained(model_dir, dtype=torch.float32), adapter).eval()
    row = read_samples(prepared / "preprocess" / "manifest.json", "val")[0]
    batch = {k: v for k, v in collate([row], 0, load_video_processor(model_dir)).items() if k != "labels"}
    with torch.no_grad():
        difference = (merged(**batch).logits - unmerged(**batch).logits).abs().max().item()
        base_difference = (merged(**batch).logits - cls.from_pretrained(model_dir, dtype=torch.float32).eval()(
            **batch).logits).abs().max().item()
    assert difference < 1e-4 < base_difference  # the adapter is in, and merged exactly in float32

    # predict takes the merged checkpoint as model.path, without an adapter, and answers alike
    merged_cfg = {**demo_config, "model": {"path": str(out)}, "predict": {"adapter": None, "batch_size": 3}}
    assert predict.main(["--config", stage_json("predict", merged_cfg), "--windows",
                         str(prepared / "window" / "windows.parquet"), "--out", str(tmp_path / "p")]) == 0
    plus_adapter = {**demo_config, "predict": {"batch_size": 3}}
    assert predict.main(["--config", stage_json("predict", plus_adapter), "--adapter", str(adapter), "--windows",
                         str(prepared / "window" / "windows.parquet"), "--out", str(tmp_path / "a")]) == 0
    assert answers(tmp_path / "p") == answers(tmp_path / "a")

