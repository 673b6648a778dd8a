"""Everyday mistakes under Snakemake, as a user meets them: a typo in a config key or path stops the run
before anything runs, and a failed stage's own message is the last thing on the terminal, pointing at
files that are still there."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import copy_checkout, planned_jobs, snakemake

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    return copy_checkout(tmp_path_factory.mktemp("errors"))


def nothing_ran(workdir) -> bool:
    return not (workdir / "results").exists() and not (workdir / "data" / "demo").exists()


@pytest.mark.parametrize("key, value", [("data.annotations", "data/demo/annotation.jsonl"),
                                        ("data.root", "data/demo/video"), ("model.path", "data/demo/modell"),
                                        ("data.annotations", "elsewhere/annotations.jsonl"),
                                        ("model.path", "elsewhere/model"), ("predict.videos", "data/new-videos")])
def test_a_path_typo_inside_or_outside_the_demo_folder_stops_every_command_before_anything_runs(checkout, key,
                                                                                                 value):
    section, name = key.split(".")
    (checkout / "typo.yaml").write_text(yaml.safe_dump({section: {name: value}}))
    for command in (["--cores", "2"], ["-n"]):
        result = snakemake(checkout, *command, "--configfile", "typo.yaml")
        output = result.stdout + result.stderr
        assert result.returncode != 0 and f"config {key}: {value} does not exist" in output, output[-2000:]
        assert "Point " + key in output and "Traceback" not in output
    assert nothing_ran(checkout)


def test_a_misspelt_key_is_one_line_with_the_key_it_meant(checkout):
    (checkout / "typo.yaml").write_text(yaml.safe_dump({"window": {"lenght": 4.0}, "train": {"tail": "sometimes"}}))
    result = snakemake(checkout, "-n", "--configfile", "typo.yaml")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "config key window.lenght: not a key of the config; did you mean window.length?" in output
    assert 'config key train.tail: "sometimes" is not allowed; it must be one of pad or drop or error' in output
    assert "additionalProperties" not in output and len(output.splitlines()) < 40, output  # no schema dump


def test_a_nested_override_on_the_command_line_takes_booleans_and_numbers(checkout):
    """Snakemake hands a nested --config value over as strings ('True', '2'); they validate as the
    boolean and integer the schema asks for, and a value that is neither still stops the run by name."""
    (checkout / "override_videos").mkdir(exist_ok=True)
    result = snakemake(checkout, "predict", "-n", "--config",
                       "predict={'videos': 'override_videos', 'render': True, 'batch_size': 2}")
    output = result.stdout + result.stderr
    assert result.returncode == 0 and planned_jobs(output)["predict"] == 1, output[-2000:]
    result = snakemake(checkout, "predict", "-n", "--config", "predict={'videos': 'override_videos', 'render': maybe}")
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Traceback" not in output
    assert 'config key predict.render: "maybe" is not allowed; it must be of type boolean' in output
    assert nothing_ran(checkout)


def test_a_failed_stage_ends_the_terminal_with_its_message_and_keeps_what_it_points_to(checkout):
    (checkout / "mine").mkdir(exist_ok=True)
    (checkout / "mine" / "annotations.jsonl").write_text('{"video": "a.mp4", "keep": [[0, 1]]}\nnot json\n')
    (checkout / "mine" / "videos").mkdir(exist_ok=True)
    (checkout / "mine.yaml").write_text(yaml.safe_dump({"data": {"annotations": "mine/annotations.jsonl",
                                                                 "root": "mine/videos"}}))
    result = snakemake(checkout, "--cores", "2", "--configfile", "mine.yaml")
    terminal = (result.stdout + result.stderr).splitlines()
    assert result.returncode != 0
    shown = terminal[terminal.index("=== window failed; the end of logs/window/window.log:"):]
    assert shown[1].startswith("error: 2 of 2 annotation lines rejected") and shown[1].endswith(
        "see logs/window/window.rejects.jsonl:")
    assert "not valid JSON" in "\n".join(shown) and "Fix or remove these items" in "\n".join(shown)
    assert "(the run record, with the traceback: logs/window/window.run_record.json)" in shown
    assert len(terminal) - terminal.index(shown[0]) < 15  # the stage's lines are the last the user reads
    # Snakemake removed the failed job's outputs; what the message points to is still there
    assert not (checkout / "results" / "window" / "rejects.jsonl").exists()
    kept = [json.loads(line) for line in (checkout / "logs/window/window.rejects.jsonl").read_text().splitlines()]
    assert [item["reason"] for item in kept] == ["video file does not exist", "not valid JSON"]
    record = json.loads((checkout / "logs/window/window.run_record.json").read_text())
    assert record["status"] == "failed" and "TooManyRejects" in record["traceback"]
