"""The report stage: figures from the other stages' real outputs, placeholders for missing ones,
and the evaluation table (`snakemake --report report.html` after a full run: tests/workflow/test_workflow.py)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import matplotlib.image
import pytest

from conftest import PROJECT, stage_json
from videosft.data import train_logs
from videosft.reporting import FIGURES, Inputs, make_report
from videosft.stages import report
from videosft.errors import REASONS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    data = Path(path).read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 2000, f"{path} is not a PNG with content"
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 100, f"{path}: {image.shape}"


def assert_svg(path: Path) -> str:
    text = Path(path).read_text()
    root = ET.fromstring(text)
    assert root.tag.endswith("svg") and len(text) > 2000, f"{path} is not an SVG with content"
    return text


def write_train(directory: Path, device: str = "cpu", world: int = 2, steps: int = 4) -> Path:
    """A train stage's run record and step logs (per rank, and all of them in steps.jsonl), shaped as
    train.py writes them."""
    directory.mkdir(parents=True, exist_ok=True)
    measured = {}
    for rank in range(world):
        lines = []
        for step in range(steps):
            memory = ({"peak_allocated_gib": 7.1 + 0.1 * step + 0.05 * rank, "peak_reserved_gib": 8.0 + 0.1 * step}
                      if device.startswith("cuda") else {"peak_rss_gib": 0.99 + 0.001 * step})
            lines.append(json.dumps({"step": step, "rank": rank, "loss": 5.9 - 0.1 * step + 0.01 * rank,
                                     "lr": 2e-4, "grad_norm": 0.4, "samples": [f"video_00{rank}.mp4#000{step}/x"],
                                     "frames": [16], "grid": [[8, 4, 6]], "input_tokens": [220],
                                     "supervised_tokens": [8], "step_seconds": 0.4, "tokens_per_second": 500.0,
                                     **memory}))
        (directory / f"steps.rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
        measured[str(rank)] = {key: value for key, value in json.loads(lines[-1]).items() if key.startswith("peak_")}
    train_logs.write_all_steps(directory)
    record = {
        "stage": "train", "status": "ok",
        "results": {
            "world_size": world, "device": device, "precision": "bf16" if device.startswith("cuda") else "fp32",
            "load": {"entries": 88, "matched": 88, "load_seconds": 0.08, "verify_seconds": 0.06,
                     "summary": "88 of 88 entries matched", "build_and_load_seconds": 4.4},
            "steps": steps,
            "memory": {"predicted": {"allocated_gib": 7.4, "reserved_gib": 8.5},
                       "measured": measured},
        },
    }
    (directory / "run_record.json").write_text(json.dumps(record))
    return directory / "run_record.json"


BASE = {"R1@0.3": 0.25, "R1@0.5": 0.125, "R1@0.7": 0.0, "mIoU": 0.1875, "mAP": 0.0625, "num_samples": 4,
        "well_formed_rate": 0.5, "unparseable_rate": 0.5, "degenerate_rate": 0.25}
TUNED = {"R1@0.3": 0.75, "R1@0.5": 0.5, "R1@0.7": 0.25, "mIoU": 0.5625, "mAP": 0.4375, "num_samples": 4,
         "well_formed_rate": 1.0, "unparseable_rate": 0.0, "degenerate_rate": 0.0}


def write_verify(path: Path, evaluation: bool = True) -> Path:
    """A verify stage's verify.json, shaped as verify.py writes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {"tensors": {"tensors": 4, "matched": 4}, "load_seconds": 3.0, "ok": True, "problems": []}
    if evaluation:
        result["evaluation"] = {
            "windows": 4, "base": BASE, "fine_tuned": TUNED,
            "answers": [{"window_id": "video_001.mp4#0000/x", "target": [[2.0, 8.0]], "base": "\n\n<x>",
                         "fine_tuned": "2.0-8.0"}],
            "gain_over_best_constant": {"constant": "whole_window", "mean": 0.25, "standard_error": 0.05, "windows": 3},
        }
    path.write_text(json.dumps(result))
    return path


SOURCE_TIME = {"R1@0.3": 0.5, "R1@0.5": 0.25, "R1@0.7": 0.0, "mIoU": 0.3125, "keep_precision": 0.75,
               "keep_recall": 0.6, "videos": 2, "moments": 4, "kept_seconds": 8.0, "target_seconds": 10.0}


def write_predict(path: Path, evaluation: bool = True) -> Path:
    """A predict stage's summary.json, shaped as predict.py writes it: for the val split, or (without
    evaluation) for a folder of new videos."""
    path.parent.mkdir(parents=True, exist_ok=True)
    summary = {"source": "val" if evaluation else "/data/new", "model": "data/demo/model",
               "adapter": "results/train/adapter", "min_agreement": 0.5, "videos": 2, "predicted": 2, "windows": 4}
    if evaluation:
        summary["evaluation"] = SOURCE_TIME
    path.write_text(json.dumps(summary))
    return path


@pytest.fixture(scope="module")
def inputs(prepared, tmp_path_factory) -> Inputs:
    """Real window / preprocess / probe outputs; train and verify outputs as those stages write them."""
    extra = tmp_path_factory.mktemp("report-inputs")
    window_rejects = extra / "window-rejects.jsonl"  # the demo has none: add two, of two reasons
    window_rejects.write_text(
        json.dumps({"where": "annotations.jsonl:7", "code": "video_missing", "reason": REASONS["video_missing"],
                    "error": "no video"}) + "\n"
        + json.dumps({"where": "annotations.jsonl:9", "code": "keep_after_end", "reason": REASONS["keep_after_end"],
                      "error": "keep range"}) + "\n")
    train = write_train(extra / "train")
    return Inputs(
        windows=prepared / "window" / "windows.parquet",
        window_rejects=window_rejects,
        manifest=prepared / "preprocess" / "manifest.json",
        preprocess_rejects=prepared / "preprocess" / "rejects.jsonl",
        probe=prepared / "probe" / "probe.json",
        train=train,
        train_steps=train.parent / "steps.jsonl",
        verify=write_verify(extra / "verify" / "verify.json"),
        predict=write_predict(extra / "predict" / "summary.json"),
    )


def report_args(inputs: Inputs, out: Path) -> list[str]:
    args = ["--config", stage_json("report"), "--out", str(out)]
    for name, path in vars(inputs).items():
        if path is not None:
            args += [f"--{name.replace('_', '-')}", str(path)]
    return args


def test_every_figure_is_drawn_from_the_stage_outputs(inputs, tmp_path):
    out = tmp_path / "report"
    assert report.main(report_args(inputs, out)) == 0
    record = json.loads((out / "run_record.json").read_text())
    assert record["stage"] == "report" and record["status"] == "ok"
    results = record["results"]
    assert results["placeholders"] == [] and results["problems"] == []
    assert set(results["figures"]) == set(FIGURES)
    for name in FIGURES:
        assert_png(out / f"{name}.png")
        assert str(out / f"{name}.png") in results["figures"][name]["files"]
    assert all(entry["exists"] for entry in results["inputs"].values())


def test_svg_figures_keep_their_text(inputs, tmp_path):
    assert report.main(report_args(inputs, tmp_path) + ["--format", "svg"]) == 0
    texts = {name: assert_svg(tmp_path / f"{name}.svg") for name in FIGURES}
    assert "predicted allocated" in texts["memory"] and "rank 1" in texts["loss"]
    assert "config video.max_tokens" in texts["tokens"]  # where the budget came from
    assert "window: video file does not exist" in texts["windows"] and "fine-tuned" in texts["evaluation"]
    assert "keep_precision" in texts["evaluation"] and "In source time" in texts["evaluation"]


def test_gpu_memory_is_drawn_against_the_prediction(inputs, tmp_path):
    train = write_train(tmp_path / "train", device="cuda:0")
    gpu = Inputs(**{**vars(inputs), "train": train, "train_steps": train.parent / "steps.jsonl"})
    result = make_report(gpu, tmp_path / "out", fmt="svg")
    assert result["placeholders"] == []
    text = assert_svg(tmp_path / "out" / "memory.svg")
    for label in ("rank 0 peak allocated", "rank 1 peak reserved", "predicted allocated", "predicted reserved",
                  "GPU memory limit"):
        assert label in text, label
    assert "peak RSS" not in text


def test_a_slow_path_the_run_took_unasked_is_in_the_report(inputs, tmp_path):
    from videosft.kernels.gated_deltanet import slow_path_warning

    train = write_train(tmp_path / "train", device="cuda:0")
    record = json.loads(train.read_text())
    warning = slow_path_warning({"importable": False, "error": "ModuleNotFoundError: No module named 'fla'"})
    record["results"]["kernels"] = {"warnings": [warning]}
    train.write_text(json.dumps(record))
    result = make_report(Inputs(**{**vars(inputs), "train": train, "train_steps": train.parent / "steps.jsonl"}),
                         tmp_path / "out", fmt="svg")
    assert warning in result["figures"]["load"]["notes"]
    assert "flash-linear-attention does not import here" in assert_svg(tmp_path / "out" / "load.svg")


def test_missing_optional_inputs_give_placeholder_figures(inputs, tmp_path):
    absent = tmp_path / "absent"
    partial = Inputs(windows=inputs.windows, manifest=inputs.manifest, probe=None,
                     window_rejects=absent / "rejects.jsonl", preprocess_rejects=None,
                     train=absent / "run_record.json", train_steps=absent / "steps.jsonl",
                     verify=absent / "verify.json")
    out = tmp_path / "report"
    assert report.main(report_args(partial, out)) == 0
    results = json.loads((out / "run_record.json").read_text())["results"]
    assert results["placeholders"] == ["evaluation", "load", "loss", "memory"]
    assert results["problems"] == []
    assert "not found" in results["figures"]["loss"]["placeholder"]
    for name in FIGURES:
        assert_png(out / f"{name}.png")
    page = (out / "evaluation.html").read_text()
    assert "No evaluation to show" in page and "report.source_time: true" in page  # how to add it
    assert (out / "evaluation.csv").read_text().splitlines() == ["metric,base,fine_tuned,difference,definition"]
    assert (out / "evaluation_source_time.csv").read_text().splitlines() == ["metric,value,definition"]

    nothing = tmp_path / "nothing"
    assert report.main(["--config", stage_json("report"), "--out", str(nothing)]) == 0  # no inputs at all
    results = json.loads((nothing / "run_record.json").read_text())["results"]
    assert results["placeholders"] == sorted(FIGURES)
    for name in FIGURES:
        assert_png(nothing / f"{name}.png")


def test_empty_step_logs_and_a_verify_without_evaluation_give_placeholders(inputs, tmp_path):
    train = write_train(tmp_path / "train")
    for path in train.parent.glob("steps.rank*.jsonl"):
        path.write_text("")
    train_logs.write_all_steps(train.parent)
    record = json.loads(train.read_text())
    del record["results"]["memory"]
    train.write_text(json.dumps(record))
    empty = Inputs(**{**vars(inputs), "train": train, "train_steps": train.parent / "steps.jsonl", "predict": None,
                      "verify": write_verify(tmp_path / "verify.json", evaluation=False)})
    result = make_report(empty, tmp_path / "out")
    assert result["placeholders"] == ["evaluation", "loss", "memory"] and result["problems"] == []
    assert result["figures"]["load"]["placeholder"] is None  # the load times are still there
    for name in FIGURES:
        assert_png(tmp_path / "out" / f"{name}.png")


def test_a_figure_that_fails_is_recorded_not_fatal(inputs, tmp_path):
    broken = tmp_path / "verify.json"
    broken.write_text(json.dumps({"evaluation": {"base": {"mIoU": 0.5}, "fine_tuned": {"mIoU": "high"}},
                                  "load_seconds": "soon"}))
    (tmp_path / "manifest.json").write_text("{not json")
    result = make_report(Inputs(**{**vars(inputs), "verify": broken, "manifest": tmp_path / "manifest.json"}),
                         tmp_path / "out")
    assert "tokens" in result["placeholders"] and any(p.startswith("tokens:") for p in result["problems"])
    assert result["figures"]["evaluation"]["placeholder"] is None  # the numeric metric is drawn
    for name in FIGURES:
        assert_png(tmp_path / "out" / f"{name}.png")


def test_the_evaluation_table_holds_base_and_fine_tuned_values(inputs, tmp_path):
    make_report(inputs, tmp_path)
    with open(tmp_path / "evaluation.csv") as handle:
        rows = {row["metric"]: row for row in csv.DictReader(handle)}
    assert set(rows) == {k for k in BASE if k != "num_samples"}
    for metric, row in rows.items():
        assert float(row["base"]) == pytest.approx(BASE[metric])
        assert float(row["fine_tuned"]) == pytest.approx(TUNED[metric])
        assert float(row["difference"]) == pytest.approx(TUNED[metric] - BASE[metric])
        assert row["definition"], f"{metric} has no definition"
    with open(tmp_path / "evaluation_source_time.csv") as handle:
        source_rows = {row["metric"]: row for row in csv.DictReader(handle)}
    assert set(source_rows) == set(SOURCE_TIME)
    for metric, row in source_rows.items():
        assert float(row["value"]) == pytest.approx(SOURCE_TIME[metric]) and row["definition"], metric
    assert source_rows["keep_precision"]["definition"].startswith("seconds kept that should be kept / seconds kept")
    page = (tmp_path / "evaluation.html").read_text()
    assert "<table>" in page and "fine-tuned" in page
    for metric in rows:
        assert f"<td>{metric}</td><td class='n'>{BASE[metric]:.4f}</td><td class='n'>{TUNED[metric]:.4f}</td>" in page
    assert "Evaluation in source time" in page and "<td>keep_recall</td><td class='n'>0.6000</td>" in page
    assert "seconds kept that should be kept / seconds that should be kept" in page
    assert "2.0-8.0" in page and "\\n\\n&lt;x&gt;" in page  # answers, escaped, control characters shown
    assert "best constant answer (whole_window, the same answer on every window), per window with something to " \
           "keep (3): mean +0.2500, standard error 0.0500 (5.0 of them" in page


def test_the_report_stage_runs_as_a_module():
    result = subprocess.run([sys.executable, "-m", "videosft.stages.report", "--help"], capture_output=True, text=True,
                            timeout=60, cwd=PROJECT)
    assert result.returncode == 0 and "--verify" in result.stdout and "--train-steps" in result.stdout


def test_a_damaged_step_log_is_a_placeholder_naming_its_line_without_a_traceback(inputs, tmp_path, capsys):
    train = write_train(tmp_path / "train")
    steps = train.parent / "steps.jsonl"
    steps.write_text(steps.read_text() + '{"step": 9, "ra\n')  # half an entry, as a full disk leaves it
    result = make_report(Inputs(**{**vars(inputs), "train": train, "train_steps": steps}), tmp_path / "out")
    lines = len(steps.read_text().splitlines())
    for figure in ("loss", "memory"):
        assert f"steps.jsonl, line {lines}: not a JSON entry" in result["figures"][figure]["placeholder"]
    assert any(p.startswith("loss: ") for p in result["problems"])
    assert "Traceback" not in capsys.readouterr().err


def test_the_memory_figure_says_how_many_frames_cards_sharing_a_sample_would_hold(inputs, tmp_path):
    notes = make_report(inputs, tmp_path)["figures"]["memory"]["notes"]
    shared = [note for note in notes if note.startswith("most frames per sample on cards of 12 GiB")]
    assert shared and " on 1 card," in shared[0] and "on 2 cards sharing it" in shared[0], notes
