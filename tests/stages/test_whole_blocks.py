"""train.gather_whole_blocks: ZeRO-3 gathers each decoder layer / vision block at once, and the
run trains what the per-module gathering trains.

Not bit for bit: DeepSpeed reduces a leaf block's gradients together when the block's backward
ends, in another order than one parameter at a time, so gradients and their norm differ in the
last bits (relative 1e-8 on the norm here). Adam's second step divides by the gradients' own
size, which lifts that on the smallest lora_B tensors to 1e-5 to 2e-4 of the tensor's largest entry
(2.0e-4 measured once, 2026-12-02), hence the bound 1e-3. A gradient lost or reduced twice would
show as a difference of the tensor's own size."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import PROJECT, run_torchrun, stage_json
from videosft.training.setup import gather_whole_blocks

pytestmark = pytest.mark.slow  # trains on 2 ranks


def test_whole_block_gathering_trains_the_same_adapter_on_two_ranks(prepared, demo_config, tmp_path):
    """Also with the last decoder layer not checkpointed (train.uncheckpointed_layers): its backward needs its
    block's weights gathered again, with no recomputation's forward to gather them."""
    # the tiny model's tensors all sit under the default persistence threshold, where ZeRO-3 keeps
    # them whole on every rank; without it every tensor is partitioned and gathered
    ds = json.loads((PROJECT / "workflow" / "deepspeed" / "zero3.json").read_text())
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    (tmp_path / "zero3.json").write_text(json.dumps(ds))
    adapters, records, norms = {}, {}, {}
    for name, whole, uncheckpointed in (("per-module", False, 0), ("whole", True, 0), ("whole-last-kept", True, 1)):
        cfg = {**demo_config, "train": {**demo_config["train"], "steps": 2, "gather_whole_blocks": whole,
                                        "uncheckpointed_layers": uncheckpointed,
                                        "deepspeed_config": str(tmp_path / "zero3.json")}}
        out = tmp_path / name
        run_torchrun(["-m", "videosft.stages.train", "--config", stage_json("train", cfg), "--samples",
                      str(prepared / "preprocess" / "manifest.json"), "--probe",
                      str(prepared / "probe" / "probe.json"), "--out", str(out)])
        assert (out / "adapter" / "adapter_model.safetensors").exists(), name
        adapters[name] = load_file(out / "adapter" / "adapter_model.safetensors")
        records[name] = json.loads((out / "run_record.json").read_text())["results"]
        norms[name] = [json.loads(line)["grad_norm"] for line in (out / "steps.rank0.jsonl").read_text().splitlines()]
    assert records["per-module"]["zero3_leaf_blocks"] == []
    assert records["whole"]["zero3_leaf_blocks"] == ["Qwen3_5DecoderLayer", "Qwen3_5VisionBlock"]
    for name in ("whole", "whole-last-kept"):
        assert records[name]["losses_rank0"] == records["per-module"]["losses_rank0"], name
        assert norms[name] == pytest.approx(norms["per-module"], rel=1e-6), name
        assert adapters[name].keys() == adapters["per-module"].keys() and adapters[name]
        for key, tensor in adapters["per-module"].items():
            scale = tensor.abs().max().item()
            assert scale > 0 and (tensor - adapters[name][key]).abs().max().item() <= 1e-3 * scale, (name, key)


def test_a_model_without_blocks_to_gather_is_refused():
    with pytest.raises(ValueError, match="gather_whole_blocks.*Linear"):
        gather_whole_blocks(torch.nn.Linear(2, 2))


def test_whole_blocks_without_checkpointing_is_refused_before_the_model_is_built(prepared, demo_config, tmp_path):
    cfg = {**demo_config, "train": {**demo_config["train"], "gather_whole_blocks": True,
                                    "gradient_checkpointing": False}}
    result = run_torchrun(["-m", "videosft.stages.train", "--config", stage_json("train", cfg), "--samples",
                           str(prepared / "preprocess" / "manifest.json"), "--probe",
                           str(prepared / "probe" / "probe.json"), "--out", str(tmp_path / "out")], nproc=1)
    assert result.returncode != 0
    assert "train.gather_whole_blocks needs train.gradient_checkpointing: true" in result.stdout
    assert not (tmp_path / "out" / "adapter").exists()


def test_more_uncheckpointed_layers_than_the_model_has_is_refused_naming_the_key(prepared, demo_config, tmp_path):
    cfg = {**demo_config, "train": {**demo_config["train"], "uncheckpointed_layers": 99}}
    result = run_torchrun(["-m", "videosft.stages.train", "--config", stage_json("train", cfg), "--samples",
                           str(prepared / "preprocess" / "manifest.json"), "--probe",
                           str(prepared / "probe" / "probe.json"), "--out", str(tmp_path / "out")], nproc=1)
    assert result.returncode != 0
    # the rank's own words, not a traceback of it (torchrun then reports the failed rank)
    assert "error: train.uncheckpointed_layers=99: the language model has 4 decoder layers; set it to at most 4" \
        in result.stdout
    assert not (tmp_path / "out" / "adapter").exists()
