from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from typing import Optional
import yaml

from videosft import config as config_lib
from videosft import provenance

PROJECT = Path(__file__).resolve().parents[1]


def test_our_defaults_match_snakemake_validate():
    from snakemake.utils import validate

    shipped = yaml.safe_load((PROJECT / "config.yaml").read_text())
    ours = config_lib.resolve(shipped)
    theirs = copy.deepcopy(shipped)
    validate(theirs, str(config_lib.SCHEMA_PATH))
    assert ours == theirs
    assert config_lib.resolve({}) == ours, "config.yaml should only restate defaults"


def test_bad_config_names_each_key_its_value_and_what_is_allowed_in_a_line(monkeypatch):
    monkeypatch.delenv("VIDEOSFT_DEBUG", raising=False)
    with pytest.raises(ValueError) as raised:
        config_lib.resolve({"train": {"tail": "sometimes", "steps": 0}, "trian": {}, "window": {"lenght": 8}})
    lines = str(raised.value).splitlines()
    assert lines == [
        "config key trian: not a key of the config; did you mean train?",
        "config key train.steps: 0 is not allowed; it must be at least 1",
        'config key train.tail: "sometimes" is not allowed; it must be one of pad or drop or error',
        "config key window.lenght: not a key of the config; did you mean window.length?",
        "(every key, its meaning and default: workflow/schemas/config.schema.yaml)"]
    with pytest.raises(ValueError, match="known keys here: .*length.*stride"):
        config_lib.resolve({"window": {"xyzzy": 1}})  # nothing near it: the keys there are listed
    monkeypatch.setenv("VIDEOSFT_DEBUG", "1")
    with pytest.raises(ValueError, match="jsonschema: 'sometimes' is not one of"):
        config_lib.resolve({"train": {"tail": "sometimes"}})  # the schema's own account on request


def test_a_snakemake_config_override_is_read_as_the_types_the_schema_asks(monkeypatch):
    """Snakemake's own --config parser leaves every nested value a string; where the schema asks for a
    boolean, integer, number or null it is read as one, and where it allows a string it stays text."""
    from snakemake.cli import parse_config

    monkeypatch.delenv("VIDEOSFT_DEBUG", raising=False)
    overrides = parse_config(["predict={'videos': 'some/dir', 'render': True, 'batch_size': 8, "
                              "'min_agreement': .75, 'query': 'True', 'adapter': 'null'}",
                              "train={'pack_tokens': null, 'lr': 1e-4, 'gradient_checkpointing': no}",
                              "memory={'world_sizes': [1, 2]}"])
    assert overrides["predict"]["render"] == "True" and overrides["memory"]["world_sizes"] == ["1", "2"]  # as given
    resolved = config_lib.resolve(overrides)
    assert resolved["predict"] == {**config_lib.resolve({})["predict"], "videos": "some/dir", "render": True,
                                   "batch_size": 8, "min_agreement": 0.75, "query": "True", "adapter": "null"}
    assert resolved["train"]["pack_tokens"] is None and resolved["train"]["lr"] == 1e-4
    assert resolved["train"]["gradient_checkpointing"] is False and resolved["memory"]["world_sizes"] == [1, 2]
    with pytest.raises(ValueError) as raised:  # a value that is none of what the schema allows still fails, by name
        config_lib.resolve(parse_config(["predict={'render': maybe, 'batch_size': 2.5}", "window={length: long}"]))
    assert str(raised.value).splitlines()[:3] == [
        'config key predict.batch_size: "2.5" is not allowed; it must be of type integer',
        'config key predict.render: "maybe" is not allowed; it must be of type boolean',
        'config key window.length: "long" is not allowed; it must be of type number']


# The descriptions that a comma once cut short (a comma ends an unquoted value in a YAML {flow: mapping}).
WHOLE_DESCRIPTIONS = {
    ("predict", "render"): "Also write the cut video (H.264, no audio) beside the timelines.",
    ("predict", "batch_size"): "Windows answered together (left-padded, KV cache), across videos: a folder of short videos "
                              "fills each batch.",
    ("demo", "pretrain", "clips"): "Rendered clips, held-out ones included.",
    ("model", "path"): "Checkpoint directory (config, safetensors, tokenizer, processor).",
}


def schema_nodes(node: dict, path: tuple = ()):
    """(dotted key, its schema) for every key of the config schema, nested sections included."""
    for name, child in node.get("properties", {}).items():
        yield (*path, name), child
        yield from schema_nodes(child, (*path, name))


def test_every_schema_description_is_whole():
    import jsonschema

    nodes = dict(schema_nodes(config_lib.schema()))
    for path, text in WHOLE_DESCRIPTIONS.items():
        assert nodes[path]["description"] == text, ".".join(path)
    # the rest of a cut description becomes a key of its own, which JSON Schema does not know
    known = set(jsonschema.Draft202012Validator.VALIDATORS) | {"description", "default", "title", "examples"}
    for path, node in nodes.items():
        assert set(node) <= known, f"{'.'.join(path)}: not schema keywords: {sorted(set(node) - known)}"
        text = node.get("description", ".").strip()
        assert text.endswith((".", ")")), f"{'.'.join(path)}: description ends mid-sentence: {text!r}"


def test_stage_sections_are_all_a_stage_gets(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default input paths, relative to the working directory, exist here
    (tmp_path / "data" / "demo" / "videos").mkdir(parents=True)
    (tmp_path / "data" / "demo" / "annotations.jsonl").write_text("")
    cfg = config_lib.stage_config("window", config_lib.resolve({}))
    assert set(cfg) == {"data", "window"}
    assert config_lib.plain(config_lib.load(json.dumps(cfg), "window")) == cfg
    assert config_lib.plain(config_lib.load(str(PROJECT / "config.yaml"), "window")) == cfg


def test_a_stage_run_alone_stops_at_a_config_path_that_does_not_exist(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "annotations.jsonl").write_text("")
    for key in ("annotations", "root"):  # a typo inside data/demo/, as outside it
        data = {"annotations": "annotations.jsonl", "root": str(tmp_path), key: f"data/demo/{key}-typo"}
        with pytest.raises(ValueError, match=f"config data.{key}: data/demo/{key}-typo does not exist .*Point data.{key} at"):
            config_lib.load(json.dumps({"data": data}), "window")
    with pytest.raises(ValueError, match="config model.path: data/demo/modell does not exist"):
        config_lib.load(json.dumps({"model": {"path": "data/demo/modell"}}), "verify")
    given = {"data": {"annotations": "annotations.jsonl", "root": "."}, "model": {"path": "."}}
    assert config_lib.load(json.dumps({**given, "predict": {"videos": "val"}}), "predict")  # val names no path
    with pytest.raises(ValueError, match="config predict.videos: new-videos does not exist"):
        config_lib.load(json.dumps({**given, "predict": {"videos": "new-videos"}}), "predict")


def test_a_view_has_exactly_the_schemas_keys_typed_and_read_only():
    import dataclasses

    cfg = config_lib.view(config_lib.stage_config("probe", config_lib.resolve({})))
    assert cfg.train.micro_batch_size == 1 and cfg.memory.world_sizes == [1, 2, 4]
    assert set(config_lib.plain(cfg.train)) == set(config_lib.MEMORY_PLAN_KEYS)  # probe reads only these
    with pytest.raises(AttributeError):
        cfg.train.steps  # not a key the probe reads: an error where it is read, never None
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.micro_batch_size = 2
    demo = config_lib.section("demo", {"model": {"layers": 2}})
    assert demo.model.layers == 2 and demo.model.hidden_size == 64  # nested sections are views too
    types = {field.name: field.type for field in dataclasses.fields(config_lib.section("train"))}
    assert types["pack_tokens"] == Optional[int] and types["steps"] is int and types["lr"] is float


def test_stage_sources_follow_imports():
    def sources(stage):
        return {path.relative_to(provenance.PACKAGE_DIR).as_posix() for path in provenance.stage_sources(stage)}

    names = sources("train")
    assert {"stages/train.py", "provenance.py", "config.py", "models/checkpoint.py", "models/lora.py",
            "encoding/chat.py", "stages/__init__.py", "models/__init__.py"} <= names
    assert "stages/verify.py" not in names and "stages/demo.py" not in names
    assert sources("probe") >= {"stages/probe.py", "models/checkpoint.py", "models/lora.py"}


def test_run_record_names_interpreter_versions_and_hashes(tmp_path, monkeypatch):
    import sys

    monkeypatch.setenv("VIDEO_MAX_TOKEN_NUM", "196")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("VIDEOSFT_FUSED_KERNELS", "torch")  # every VIDEOSFT_* switch, not a list to keep up
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with provenance.run_record("window", tmp_path, {"window": {"length": 8}}) as record:
        record["results"] = {"windows": 3}
    saved = json.loads((tmp_path / "run_record.json").read_text())
    assert saved["status"] == "ok" and saved["interpreter"] == sys.executable
    assert saved["packages"]["torch"] and saved["packages"]["deepspeed"]
    assert saved["sources"]["stages/window.py"] == provenance.sha256_file(
        provenance.PACKAGE_DIR / "stages" / "window.py")
    assert saved["env"]["VIDEO_MAX_TOKEN_NUM"] == "196" and saved["env"]["SLURM_JOB_ID"] == "42"
    assert saved["env"]["VIDEOSFT_FUSED_KERNELS"] == "torch"
    assert saved["env"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert saved["results"] == {"windows": 3}


def test_a_failed_stage_records_the_error(tmp_path):
    with pytest.raises(RuntimeError):
        with provenance.run_record("window", tmp_path, {}):
            raise RuntimeError("boom")
    saved = json.loads((tmp_path / "run_record.json").read_text())
    assert saved["status"] == "failed" and saved["error"] == "RuntimeError: boom"


def test_stale_code_is_refused(tmp_path):
    stale = [str(tmp_path / "old" / "videosft" / "window.py")]
    with pytest.raises(provenance.StaleCodeError, match="pip install -e"):
        provenance.check_code("window", stale)
    provenance.check_code("window", [str(p) for p in provenance.stage_sources("window")])


def test_a_stage_in_another_environment_fails_naming_both(tmp_path, monkeypatch):
    upstream = tmp_path / "window.json"
    with provenance.run_record("window", tmp_path / "w", {}) as _:
        pass
    record = json.loads((tmp_path / "w" / "run_record.json").read_text())
    record["packages"]["torch"] = "2.0.0"
    record["interpreter"] = "/opt/old-env/bin/python"
    upstream.write_text(json.dumps(record))
    args = type("Args", (), {"code": None, "job": "preprocess", "after": [str(upstream)]})()
    with pytest.raises(provenance.EnvironmentMismatch) as error:
        with provenance.run_record("preprocess", tmp_path / "p", {}, args):
            pass
    message = str(error.value)
    assert "/opt/old-env/bin/python" in message and "2.0.0" in message and provenance.ALLOW_MIXED in message
    import torch

    assert torch.__version__.split("+")[0] in message or provenance.package_versions()["torch"] in message
    monkeypatch.setenv(provenance.ALLOW_MIXED, "1")
    with provenance.run_record("preprocess", tmp_path / "p", {}, args) as record:
        pass
    assert json.loads((tmp_path / "p" / "run_record.json").read_text())["snakemake_job"] == "preprocess"


def test_diff_names_what_changed(tmp_path, capsys):
    with provenance.run_record("window", tmp_path / "a", {"window": {"length": 8}}):
        pass
    a = json.loads((tmp_path / "a" / "run_record.json").read_text())
    b = json.loads(json.dumps(a))
    b["packages"]["transformers"] = "4.0.0"
    b["config"]["window"]["length"] = 4
    b["sources"]["window.py"] = "0" * 64
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert provenance.main(["diff", str(tmp_path / "a" / "run_record.json"), str(tmp_path / "b.json")]) == 1
    out = capsys.readouterr().out
    for key in ("packages.transformers", "config.window.length", "sources.window.py"):
        assert key in out
    assert "started" not in out  # timings are not differences
    assert provenance.main(["diff", str(tmp_path / "a" / "run_record.json"), str(tmp_path / "a" / "run_record.json")]) == 0


def test_a_stage_help_names_its_command_and_reads_as_text():
    import subprocess
    import sys

    shown = subprocess.run([sys.executable, "-m", "videosft.stages.window", "--help"], capture_output=True, text=True,
                           check=True).stdout
    assert shown.startswith("usage: python -m videosft.stages.window ")
    assert "``" not in shown and ":func:" not in shown and "[s - w0, e - w0]" in shown
    assert provenance.plain_text("see :func:`videosft.x.y` and ``a_b``, :mod:`~z`") == "see videosft.x.y and a_b, z"
