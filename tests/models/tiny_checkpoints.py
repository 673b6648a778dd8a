"""One tiny checkpoint per model family of the registry (videosft.models.families), keyed by the
family's name: what tests/models/test_families.py runs every stage on. A family added to the
registry needs one builder in ``BUILDERS``; without one, that test fails naming it.

* ``qwen2_5_vl``: saved by transformers, so in the legacy layout (``model.layers.*``, ``visual.*``),
  with the demo's tokenizer (its vision tokens are Qwen's);
* ``qwen3_vl``, ``qwen3_5``: laid out as published, with the real tokenizers (tests/published.py).

The conftest fixtures ``qwen25_dir`` and ``qwen3vl_dir`` (a Qwen3-VL saved by transformers, with the
demo's tokenizer) are built here too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from videosft.models.families import QWEN2_5_VL, QWEN3_VL

# a builder: (out, demo_dir) -> the checkpoint's directory
Builder = Callable[[Path, Path], Path]


def transformers_qwen25(out: Path, demo_dir: Path) -> Path:
    """A tiny Qwen2.5-VL checkpoint as transformers saves it: legacy model.layers.* / visual.* keys."""
    import transformers
    from transformers import AutoTokenizer, Qwen2_5_VLConfig
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(demo_dir / "model")
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, fullatt_block_indexes=[1]),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids(QWEN2_5_VL.vision.pad),
        vision_start_token_id=ids(QWEN2_5_VL.vision.start), vision_end_token_id=ids(QWEN2_5_VL.vision.end))
    QWEN2_5_VL.transformers_class()(config).save_pretrained(out, max_shard_size="200KB")
    geometry = dict(patch_size=14, temporal_patch_size=2, merge_size=2)
    processor = getattr(transformers, QWEN2_5_VL.processor_class)
    processor(image_processor=Qwen2VLImageProcessor(**geometry), tokenizer=tokenizer,
              video_processor=Qwen2VLVideoProcessor(**geometry)).save_pretrained(out)
    return out


def transformers_qwen3vl(out: Path, demo_dir: Path) -> Path:
    """A tiny Qwen3-VL checkpoint saved by transformers: model.language_model.* / model.visual.* keys."""
    from transformers import AutoProcessor, Qwen3VLConfig

    out.mkdir(parents=True, exist_ok=True)
    processor = AutoProcessor.from_pretrained(demo_dir / "model")
    ids = processor.tokenizer.convert_tokens_to_ids
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=len(processor.tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [4, 2, 2], "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0]),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids(QWEN3_VL.vision.pad),
        vision_start_token_id=ids(QWEN3_VL.vision.start), vision_end_token_id=ids(QWEN3_VL.vision.end),
        tie_word_embeddings=False)
    QWEN3_VL.transformers_class()(config).save_pretrained(out, max_shard_size="200KB")
    processor.save_pretrained(out)
    return out


def published_qwen3vl(out: Path, demo_dir: Path) -> Path:
    from published import published_qwen3vl as build

    return build(out)


def published_qwen35(out: Path, demo_dir: Path) -> Path:
    from published import published_qwen35 as build

    return build(out)


BUILDERS: dict[str, Builder] = {
    "qwen2_5_vl": transformers_qwen25,
    "qwen3_vl": published_qwen3vl,
    "qwen3_5": published_qwen35,
}


def missing_builder(family: str) -> str:
    return (f"the model family {family!r} of videosft.models.families has no tiny checkpoint: add a builder "
            f"(out, demo_dir) -> Path for it to BUILDERS in tests/models/tiny_checkpoints.py")


def tiny_checkpoint(family: str, out: Path, demo_dir: Path) -> Path:
    """The family's tiny checkpoint, built in ``out`` (``demo_dir``: the session's demo, for its tokenizer)."""
    if family not in BUILDERS:
        raise LookupError(missing_builder(family))
    return BUILDERS[family](out, demo_dir)
