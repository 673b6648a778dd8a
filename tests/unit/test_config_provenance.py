from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from videosft import config as config_lib
from videosft import provenance

PROJECT = Path(__file__).resolve().parents[2]


def test_our_defaults_match_snakemake_validate():
    from snakemake.utils import validate

    shipped = yaml.safe_load((PROJECT / "config.yaml").read_text())
    ours = config_lib.resolve(shipped)
    theirs = copy.deepcopy(shipped)
    validate(theirs, str(config_lib.SCHEMA_PATH))
    assert ours == theirs
    assert config_lib.resolve({}) == ours, "config.yaml should only restate defaults"


def test_bad_config_names_the_key():
    with pytest.raises(ValueError, match="config key train/tail"):
        config_lib.resolve({"train": {"tail": "sometimes"}})
    with pytest.raises(ValueError, match="Additional properties"):
        config_lib.resolve({"trian": {}})


def test_stage_sections_are_all_a_stage_gets():
    cfg = config_lib.stage_config("window", config_lib.resolve({}))
    assert set(cfg) == {"data", "window"}
    assert config_lib.load(json.dumps(cfg), "window") == cfg
    assert config_lib.load(str(PROJECT / "config.yaml"), "window") == cfg


def test_stage_sources_follow_imports():
    names = {path.name for path in provenance.stage_sources("train")}
    assert {"train.py", "provenance.py", "config.py", "keymap.py", "lora.py", "chat.py"} <= names
    assert "verify.py" not in names and "demo.py" not in names
    assert {path.name for path in provenance.stage_sources("probe")} >= {"probe.py", "keymap.py", "lora.py"}


def test_run_record_names_interpreter_versions_and_hashes(tmp_path, monkeypatch):
    import sys

    monkeypatch.setenv("VIDEO_MAX_TOKEN_NUM", "196")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    with provenance.run_record("window", tmp_path, {"window": {"length": 8}}) as record:
        record["results"] = {"windows": 3}
    saved = json.loads((tmp_path / "run_record.json").read_text())
    assert saved["status"] == "ok" and saved["interpreter"] == sys.executable
    assert saved["packages"]["torch"] and saved["packages"]["deepspeed"]
    assert saved["sources"]["window.py"] == provenance.sha256_file(provenance.PACKAGE_DIR / "window.py")
    assert saved["env"]["VIDEO_MAX_TOKEN_NUM"] == "196" and saved["env"]["SLURM_JOB_ID"] == "42"
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
