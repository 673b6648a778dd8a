"""The model family registry (videosft.models.families): every record complete and true to the
transformers classes it names, found by any of its model types, and an unknown one named with the
known families; every family has a tiny checkpoint for the test that runs every stage on it."""

from __future__ import annotations

import dataclasses

import pytest

from tiny_checkpoints import BUILDERS, missing_builder, tiny_checkpoint
from videosft.errors import UserError
from videosft.kernels.fused import KINDS
from videosft.models import families
from videosft.models.families import FAMILIES, Family, UnknownFamilyError, family_of

BY_NAME = pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.name)


@BY_NAME
def test_every_record_says_every_field(family: Family):
    assert families.missing_fields(family) == []
    assert family.name in family.model_types and family.title
    assert family.video_layouts and set(family.video_layouts) <= {*families.GRID_LAYOUTS, *families.MARKER_LAYOUTS}
    assert family.fused_kinds <= set(KINDS)
    assert all(modules for _, modules in family.lora_modules) and len(set(family.layer_types)) == len(family.layer_types)
    assert family.generation_end in (family.chat.turn_end,)
    assert all(new is None or new.endswith(".") for _, new in family.vllm.prefixes)
    assert {module for _, modules in family.lora_modules for module in modules} <= family.vllm.modules, \
        "vLLM would not apply LoRA to every module all-linear adapts"


def test_missing_fields_names_an_empty_one():
    empty = dataclasses.replace(families.QWEN3_VL, model_class="", fused_kinds=frozenset())
    assert families.missing_fields(empty) == ["model_class", "fused_kinds"]


def test_names_and_model_types_are_one_familys_each():
    names = [family.name for family in FAMILIES]
    types = [model_type for family in FAMILIES for model_type in family.model_types]
    assert len(set(names)) == len(names) and len(set(types)) == len(types)


@BY_NAME
def test_the_record_names_the_classes_transformers_maps_its_model_types_to(family: Family):
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    from videosft.models.checkpoint import model_class

    config = AutoConfig.for_model(family.name)
    assert model_class(config) is MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)] is family.transformers_class()
    assert PROCESSOR_MAPPING_NAMES[family.name] == family.processor_class
    text = config.get_text_config()
    assert text.model_type in family.model_types
    assert set(getattr(text, "layer_types", None) or [families.UNTYPED_LAYER]) == set(family.layer_types)
    assert family.modeling_module == f"transformers.models.{family.name}.modeling_{family.name}"


@BY_NAME
def test_family_of_finds_the_record_by_each_model_type_config_and_dict(family: Family):
    from transformers import AutoConfig

    for model_type in family.model_types:
        assert family_of(model_type) is family
        assert family_of({"model_type": model_type}) is family
    config = AutoConfig.for_model(family.name)
    assert family_of(config) is family and family_of(config.get_text_config()) is family


def test_an_unknown_model_type_is_an_error_naming_it_and_the_known_families():
    with pytest.raises(UnknownFamilyError) as error:
        family_of("llava_next_video")
    message = str(error.value)
    assert "'llava_next_video'" in message and "src/videosft/models/families.py" in message
    assert all(f"{family.name} ({family.title})" in message for family in FAMILIES)
    assert isinstance(error.value, UserError)  # a stage ends on it with the message, no traceback
    with pytest.raises(UnknownFamilyError, match="'None'"):
        family_of({})


def test_building_a_model_of_no_known_family_names_the_families():
    from transformers import AutoConfig

    from videosft.models.checkpoint import model_class

    with pytest.raises(UnknownFamilyError, match="model_type 'llava' is not one of the model families"):
        model_class(AutoConfig.for_model("llava"))


def test_names_inside_the_model_are_read_by_the_record():
    family = families.QWEN3_5
    assert family.layer_index("base_model.model.model.language_model.layers.11.mlp.up_proj") == 11
    assert family.layer_index("model.language_model.layers.3.linear_attn.in_proj_z.weight") == 3
    assert family.layer_index("model.visual.blocks.1.mlp.linear_fc1") is None
    assert family.in_vision_tower("model.visual.merger.linear_fc2") and family.in_vision_tower("model.visual.deepstack_merger_list.0.norm.weight")
    assert not family.in_vision_tower("model.language_model.layers.0.mlp.up_proj") and not family.in_vision_tower("lm_head")


def test_the_encoding_takes_every_familys_tokens():
    """The encoding reads the processor, not the family: it writes and checks CHATML's turns and
    QWEN_VISION's video tokens, so every family must have those (one with others needs the family
    passed to the encoding), and the families that tell time alike must allow the same layouts."""
    from videosft.encoding import chat, layout

    assert all(family.chat == families.CHATML and family.vision == families.QWEN_VISION for family in FAMILIES)
    assert (layout.VIDEO_START, layout.VIDEO_PAD, layout.VIDEO_END) == (
        families.QWEN_VISION.start, families.QWEN_VISION.pad, families.QWEN_VISION.end)
    assert chat.EMPTY_THINK == families.CHATML.empty_think
    for by_grid in (True, False):
        assert len({family.video_layouts for family in FAMILIES if family.time_by_grid == by_grid}) == 1
    assert layout.layout_name("nested", tells_time_by_grid=True) == "single"
    assert layout.layout_name("nested", tells_time_by_grid=False) == "nested"
    assert families.QWEN2_5_VL.video_layout("blocks") == "single" and families.QWEN3_VL.video_layout("nested") == "nested"


def test_every_family_has_a_tiny_checkpoint():
    """The test over the registry (test_families.py) runs every stage on each family's tiny checkpoint."""
    missing = [family.name for family in FAMILIES if family.name not in BUILDERS]
    assert not missing, "; ".join(missing_builder(name) for name in missing)
    assert set(BUILDERS) == {family.name for family in FAMILIES}, "a builder for a family the registry lacks"


def test_a_family_without_a_tiny_checkpoint_is_named(tmp_path):
    with pytest.raises(LookupError, match="'qwen9_vl' .* has no tiny checkpoint: add a builder .* "
                                          "tests/models/tiny_checkpoints.py"):
        tiny_checkpoint("qwen9_vl", tmp_path, tmp_path)
