"""The export stage on Qwen3.5 checkpoints laid out as published (tests/published.py): every tensor of
the base is in the merged checkpoint (the mtp.* head, which transformers never loads, copied through
byte for byte), the adapter is merged exactly into its target weights and nowhere else, and both
tie_word_embeddings flags say what the files hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import saved_adapter, stage_json
from published import qwen35_config_at_small_widths, qwen35_weights
from videosft.errors import InputError
from videosft.models.checkpoint import read_checkpoint, read_tensors
from videosft.models.merged_checkpoint import ExportError, tie_flags
from videosft.stages import export

TARGETS = ["down_proj", "q_proj", "v_proj"]  # q/v: the one full-attention layer of four; down_proj: every layer
RANK, ALPHA = 4, 8
ADAPTER_PREFIX = "base_model.model."
SHARD = "500KB"  # several shards, as published


def small_config() -> dict:
    """Qwen3.5-4B's config at small widths, its vocabulary cut too: the export reads no token ids, and the
    published 248,320 rows would be nearly all of the bytes each export here writes."""
    config = qwen35_config_at_small_widths()
    config["text_config"]["vocab_size"] = 4096
    return config


@pytest.fixture(scope="module")
def tied_base(tmp_path_factory) -> Path:
    """Qwen3.5-4B's layout at small widths: tied head (no lm_head.weight), mtp.* in a shard of its own."""
    return qwen35_weights(tmp_path_factory.mktemp("qwen35-tied"), small_config(), shard_size=SHARD)


@pytest.fixture(scope="module")
def untied_base(tmp_path_factory) -> Path:
    """Qwen3.5-9B's choice: a head of its own (lm_head.weight in the files), both flags false."""
    config = small_config()
    config["tie_word_embeddings"] = config["text_config"]["tie_word_embeddings"] = False
    return qwen35_weights(tmp_path_factory.mktemp("qwen35-untied"), config, seed=1, shard_size=SHARD)


@pytest.fixture(scope="module")
def adapter(tied_base, tmp_path_factory) -> Path:
    """The adapter the exports merge (conftest.saved_adapter: non-zero B)."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    base = Qwen3_5ForConditionalGeneration.from_pretrained(tied_base, dtype=torch.float32)
    return saved_adapter(base, tmp_path_factory.mktemp("adapter"), RANK, ALPHA, TARGETS)


def run_export(model_dir: Path, adapter: Path, out: Path, dtype: str = "bfloat16") -> dict:
    cfg = {"model": {"path": str(model_dir)}, "export": {"dtype": dtype, "max_shard_size": SHARD}}
    assert export.main(["--config", stage_json("export", cfg), "--adapter", str(adapter), "--out", str(out)]) == 0
    return json.loads((out / "export.json").read_text())


def with_tie_flags(base: Path, out: Path, top: bool, text: bool) -> Path:
    """``base``'s files (linked) under a config.json whose tie flags say ``top`` and ``text``."""
    out.mkdir()
    for path in base.iterdir():
        if path.name != "config.json":
            (out / path.name).symlink_to(path)
    config = json.loads((base / "config.json").read_text())
    config["tie_word_embeddings"], config["text_config"]["tie_word_embeddings"] = top, text
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def lora_deltas(adapter: Path) -> dict:
    """Checkpoint key of each adapted weight -> the update LoRA adds to it (alpha / r x B @ A)."""
    from safetensors.torch import load_file

    tensors = load_file(adapter / "adapter_model.safetensors")
    return {key.removeprefix(ADAPTER_PREFIX).replace(".lora_A.weight", ".weight"):
            ALPHA / RANK * tensors[key.replace("lora_A", "lora_B")] @ tensors[key]
            for key in tensors if "lora_A" in key}


def test_export_keeps_every_base_tensor_and_merges_exactly_the_adapter(tied_base, adapter, tmp_path):
    import torch
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

    out = tmp_path / "merged"
    results = run_export(tied_base, adapter, out, dtype="float32")
    base, written = read_checkpoint(tied_base), read_checkpoint(out)
    assert set(written) == set(base)  # every base tensor, under the base's key names, and nothing else
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(base) and len(set(index.values())) > 1  # sharded, and the index lists every tensor

    mtp = sorted(key for key in base if key.startswith("mtp."))
    before, after = read_tensors(tied_base, base, mtp), read_tensors(out, written, mtp)
    for key in mtp:  # copied through as the base stores them: bf16, byte for byte
        assert after[key].dtype == before[key].dtype == torch.bfloat16
        assert torch.equal(after[key].reshape(-1).view(torch.uint8), before[key].reshape(-1).view(torch.uint8)), key

    deltas = lora_deltas(adapter)
    assert len(deltas) == 6 and set(deltas) <= set(base)
    model_keys = [key for key in base if key not in mtp]
    before, after = read_tensors(tied_base, base, model_keys), read_tensors(out, written, model_keys)
    for key in model_keys:
        assert after[key].dtype == torch.float32, key  # export.dtype
        if key in deltas:
            assert not torch.equal(after[key], before[key].float()), key
            torch.testing.assert_close(after[key], before[key].float() + deltas[key], rtol=0, atol=1e-6)
        else:
            assert torch.equal(after[key], before[key].float()), key

    model, loading = Qwen3_5ForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"] and not loading["mismatched_keys"]
    config = AutoConfig.from_pretrained(out)
    assert config.tie_word_embeddings is config.text_config.tie_word_embeddings is ("lm_head.weight" not in written)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert (out / "config.json").read_text() == (tied_base / "config.json").read_text()  # consistent: unchanged

    assert results["merged"] == {"target_modules": TARGETS, "weights": 6,
                                 "by_module": {"down_proj": 4, "q_proj": 1, "v_proj": 1}}
    assert results["copied_tensors"]["count"] == len(mtp) == 6
    assert results["copied_tensors"]["by_prefix"] == {"mtp": {"count": 6, "bytes": sum(base[k].nbytes for k in mtp)}}
    assert results["left_out"] == [] and results["tensors"] == len(base)
    assert results["tie_word_embeddings"] == {
        "config_top": True, "text_config": True, "lm_head_in_files": False,
        "base_config": {"config_top": True, "text_config": True}, "config_changed": False}


@pytest.mark.parametrize("top, text", [(True, False), (False, True), (False, False)],
                         ids=["demo-style-text-untied", "text-tied", "consistent-untied"])
def test_both_tie_flags_of_the_export_say_what_its_files_hold(top, text, tied_base, untied_base, adapter, tmp_path):
    """A tied base (no lm_head.weight) exports true/true, an untied one false/false, whatever its
    text_config said; a consistent config is kept byte for byte."""
    from transformers import AutoConfig

    base = with_tie_flags(untied_base if top is False else tied_base, tmp_path / "base", top, text)
    out = tmp_path / "merged"
    tie = run_export(base, adapter, out)["tie_word_embeddings"]
    in_files = "lm_head.weight" in read_checkpoint(out)
    assert in_files is (not top)
    assert tie == {"config_top": top, "text_config": top, "lm_head_in_files": in_files,
                   "base_config": {"config_top": top, "text_config": text}, "config_changed": top != text}
    config = AutoConfig.from_pretrained(out)
    assert config.tie_word_embeddings is config.text_config.tie_word_embeddings is top
    if top == text:
        assert (out / "config.json").read_text() == (base / "config.json").read_text()
    written, original = (json.loads((d / "config.json").read_text()) for d in (out, base))
    for config_dict in (written, original):
        config_dict.pop("tie_word_embeddings"), config_dict["text_config"].pop("tie_word_embeddings")
    assert written == original  # nothing else changed


def test_a_head_the_files_would_lose_is_refused():
    config = {"tie_word_embeddings": True, "text_config": {"tie_word_embeddings": True}}
    fixed, record = tie_flags(config, lm_head_in_files=False, head_equals_embedding=True)
    assert fixed == config and not record["config_changed"]
    with pytest.raises(ExportError, match="lm_head differs from its input embedding, but the files hold no "
                                          "lm_head.weight.*lora.target_modules"):
        tie_flags(config, lm_head_in_files=False, head_equals_embedding=False)


def test_a_base_whose_files_lack_a_weight_its_config_asks_for_is_refused(tied_base, adapter, tmp_path):
    """Untied by its config, but with no lm_head.weight: the export would hold a random head."""
    base = with_tie_flags(tied_base, tmp_path / "base", False, False)
    with pytest.raises(InputError, match=r"lacks 1 weights of the model \(e.g. \['lm_head.weight'\]\)"):
        run_export(base, adapter, tmp_path / "merged")
    assert not (tmp_path / "merged" / "model.safetensors.index.json").exists()
