"""bench/vision_rotary.py runs the train stage's check and times both functions (here through Triton's
interpreter on the CPU, in fp16: the interpreter's bf16 cast truncates, see tests/kernels/test_vision_rotary.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import vision_rotary as bench  # noqa: E402

from videosft.kernels import vision_rotary  # noqa: E402


def test_check_and_timings_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(vision_rotary, "_KERNEL", None)
    monkeypatch.setattr(vision_rotary, "CHECK_TOKENS", (vision_rotary.CHECK_SHORT_TOKENS,))
    monkeypatch.setattr(vision_rotary.select, "__defaults__", ("auto", None, vision_rotary.CHECK_TOKENS))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"vision_config": {"num_heads": 4, "hidden_size": 96}}))
    out = tmp_path / "rotary.json"
    assert bench.main(["--model-config", str(config), "--device", "cpu", "--tokens", "57", "--dtype", "float16",
                       "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["heads"], result["head_dim"]) == (4, 24)
    assert {(r["tokens"], r["dtype"]) for r in result["check"]["checks"]} == {
        (201, "torch.float16"), (201, "torch.float32")}
    (row,) = result["timings"]
    assert row["tokens"] == 57 and row["differing_elements"] == 0 and row["fused_ms"] > 0 and row["transformers_ms"] > 0
    printed = capsys.readouterr().out
    assert "check (4 heads x 24): 201 tokens float16: 0 differing" in printed
    assert printed.splitlines()[-1].split()[0] == "57"
