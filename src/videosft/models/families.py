"""The model families the pipeline trains, one record each: what makes Qwen2.5-VL, Qwen3-VL and
Qwen3.5 differ, in one place.

A record (:class:`Family`) holds, for one family: its ``model_type`` and transformers classes, its
chat and vision tokens, whether it tells time by its M-RoPE grid or by ``<t seconds>`` markers and
the video layouts that allows, the names of its decoder layers and vision tower (frozen, merger
included), its layer types and what LoRA touches in each, its published checkpoint's key layout,
the token that ends an answer, how vLLM maps its adapter keys, and its kernel facts. The library
reads them through :func:`family_of` (a config, a config.json's dict or a ``model_type``):

=======================  ===================================================================
field                    read by
=======================  ===================================================================
``model_class``          :func:`videosft.models.checkpoint.model_class` (every stage's model)
``modeling_module``      :func:`videosft.kernels.gated_deltanet.main` (the standalone check)
``decoder_layers``       :mod:`videosft.models.lora` (coverage per layer),
                         :func:`videosft.training.memory.model_facts` (the largest layer),
                         :func:`videosft.training.setup.decoder_layers` (train.uncheckpointed_layers)
``vision_tower``         :mod:`videosft.models.lora` (never adapted),
                         :func:`videosft.training.memory.model_facts` (vision parameters)
``generation_end``       :func:`videosft.evaluation.generation.greedy_answers`
``video_layouts``        :func:`videosft.encoding.layout.layout_name`, by how the family tells time
``chat``, ``vision``     :mod:`videosft.encoding.chat` and :mod:`videosft.encoding.layout`, which
                         take the processor, not the family: they use :data:`CHATML` and
                         :data:`QWEN_VISION`, and every family must have those (a test holds it)
=======================  ===================================================================

The other fields are facts that generic code finds by behaviour (``time_by_grid``: the processor
returns ``second_per_grid_ts``; ``thinking``: the labels find the empty think block in the ids;
``gated_deltanet`` and ``fused_kinds``: the kernels find their modules by what they compute;
``lora_modules``: the text config lists the layer types, LoRA takes the linear modules;
``checkpoint``: transformers' conversion rules map the keys), or that only the tests read
(``processor_class``; ``vllm``: tests/vllm_lora_keys.py). The tests hold each family to all of
them (tests/models/test_registry.py, tests/models/test_families.py), so a record that says
otherwise fails there.

Adding a family: one :class:`Family` in :data:`FAMILIES`, and one tiny-checkpoint builder keyed by
its name in tests/models/tiny_checkpoints.py; the test over the registry then runs every stage on
it (and fails, naming the family, when the builder is missing).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from ..errors import UserError


class UnknownFamilyError(UserError, ValueError):
    """A model whose family the registry has no record of."""


@dataclass(frozen=True)
class ChatTokens:
    """How the chat template writes a turn (ChatML) and the empty think block that hybrid-thinking
    templates write before the answer (``prompt.think_block`` says whose it is)."""

    turn_start: str = "<|im_start|>"
    turn_end: str = "<|im_end|>"
    assistant_header: str = "assistant\n"
    empty_think: str = "<think>\n\n</think>\n\n"


@dataclass(frozen=True)
class VisionTokens:
    """The tokens around a video in the prompt: ``start``, ``pad`` (one per visual token), ``end``."""

    start: str = "<|vision_start|>"
    pad: str = "<|video_pad|>"
    end: str = "<|vision_end|>"


@dataclass(frozen=True)
class CheckpointLayout:
    """Key prefixes of the family's published checkpoints (transformers' conversion rules map them onto
    the model's own names, ``model.language_model.*`` and ``model.visual.*``, in every family)."""

    language_model: str  # the decoder's keys: legacy "model." (model.layers.*) or "model.language_model."
    vision: str  # the vision tower's and its mergers' keys
    lm_head: str = "lm_head."
    extras: tuple[str, ...] = ()  # prefixes of tensors published beside the model that the class skips on load


@dataclass(frozen=True)
class VllmLora:
    """How vLLM (0.33.0's source, read; docs/video-layout.md) names the module an adapter key points at: it
    strips ``base_model.model.`` and ``.lora_A/B.weight``, renames by the first matching prefix (``None``
    drops the key), and applies LoRA to the ``modules`` (its packed modules' members and the plain ones)
    of the language model's layers, under ``layers``. A key that lands elsewhere loads without effect."""

    prefixes: tuple[tuple[str, str | None], ...]
    modules: frozenset[str]
    layers: str = "language_model.model.layers."


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
GATED_DELTANET = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# What every Qwen family's tokenizer and template write; the encoding uses these (module docstring).
CHATML = ChatTokens()
QWEN_VISION = VisionTokens()
# The video layouts (videosft.encoding.layout): one block of every frame pair's tokens, the time in
# M-RoPE; or one block per frame pair after its <t seconds> marker, bare or inside one more pair.
GRID_LAYOUTS = ("single",)
MARKER_LAYOUTS = ("blocks", "nested")
UNTYPED_LAYER = "layer"  # the layer type LoRA's coverage gives layers of a text config that names none


@dataclass(frozen=True)
class Family:
    """What one family of video-language models is, to this pipeline."""

    name: str  # the registry's key: its main model_type
    title: str
    model_types: tuple[str, ...]  # config.model_type values (the text config's among them)
    model_class: str  # the transformers class every stage builds (image-text-to-text)
    processor_class: str  # the processor class its published checkpoints name
    chat: ChatTokens
    vision: VisionTokens
    # an empty think block in its chat template's last assistant turn (hybrid thinking: Qwen3.5)
    thinking: bool
    # time from a fixed step per frame pair in its M-RoPE positions (second_per_grid_ts) rather
    # than from <t seconds> markers before each frame pair
    time_by_grid: bool
    video_layouts: tuple[str, ...]  # the layouts it can be given; the first where the configured one is not
    decoder_layers: str  # the module holding the decoder layers (layer i: f"{decoder_layers}.{i}")
    # the text config's layer types (UNTYPED_LAYER where it names none) and the linear modules LoRA's
    # all-linear touches in each, as (layer type, modules) pairs
    lora_modules: tuple[tuple[str, tuple[str, ...]], ...]
    vision_tower: str  # the module of the vision tower and its merger(s): frozen, never adapted
    checkpoint: CheckpointLayout
    generation_end: str  # the token an answer ends at
    vllm: VllmLora
    gated_deltanet: bool  # linear-attention layers (videosft.kernels.gated_deltanet)
    fused_kinds: frozenset[str]  # the videosft.kernels.fused kinds its language model has

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple(kind for kind, _ in self.lora_modules)

    def layer_index(self, name: str) -> int | None:
        """The decoder layer a module or parameter name lies in (prefixes such as peft's allowed), or None."""
        match = re.search(rf"(?:^|\.){re.escape(self.decoder_layers)}\.(\d+)\.", name)
        return int(match.group(1)) if match else None

    def in_vision_tower(self, name: str) -> bool:
        """Whether a module or parameter name lies in the vision tower or its merger(s)."""
        return re.search(rf"(?:^|\.){re.escape(self.vision_tower)}\.", name) is not None

    def transformers_class(self):
        """The model class, imported now."""
        import transformers

        return getattr(transformers, self.model_class)

    @property
    def modeling_module(self) -> str:
        """transformers' modeling module of the family (where its layers' functions are bound)."""
        return self.transformers_class().__module__

    def video_layout(self, configured: str) -> str:
        """The layout a sample gets: the configured one where the family allows it, else its first."""
        return configured if configured in self.video_layouts else self.video_layouts[0]


QWEN2_5_VL = Family(
    name="qwen2_5_vl",
    title="Qwen2.5-VL",
    model_types=("qwen2_5_vl", "qwen2_5_vl_text"),
    model_class="Qwen2_5_VLForConditionalGeneration",
    processor_class="Qwen2_5_VLProcessor",
    chat=CHATML,
    vision=QWEN_VISION,
    thinking=False,
    time_by_grid=True,
    video_layouts=GRID_LAYOUTS,
    decoder_layers="model.language_model.layers",
    lora_modules=(("full_attention", ATTENTION + MLP),),
    vision_tower="model.visual",
    checkpoint=CheckpointLayout(language_model="model.", vision="visual."),  # model.layers.*, visual.*
    generation_end=CHATML.turn_end,
    vllm=VllmLora(prefixes=(("model.language_model.", "language_model.model."), ("model.visual.", "visual."),
                            ("lm_head.", "language_model.lm_head."), ("model.", "language_model.model.")),
                  modules=frozenset(ATTENTION + MLP)),
    gated_deltanet=False,
    fused_kinds=frozenset({"rms_norm", "swiglu"}),
)

QWEN3_VL = Family(
    name="qwen3_vl",
    title="Qwen3-VL",
    model_types=("qwen3_vl", "qwen3_vl_text"),
    model_class="Qwen3VLForConditionalGeneration",
    processor_class="Qwen3VLProcessor",
    chat=CHATML,
    vision=QWEN_VISION,
    thinking=False,  # the Instruct models' template; the Thinking models' is another checkpoint's
    time_by_grid=False,
    video_layouts=MARKER_LAYOUTS,
    decoder_layers="model.language_model.layers",
    lora_modules=((UNTYPED_LAYER, ATTENTION + MLP),),  # its text config names no layer types
    vision_tower="model.visual",  # deepstack mergers included
    checkpoint=CheckpointLayout(language_model="model.language_model.", vision="model.visual."),
    generation_end=CHATML.turn_end,
    vllm=VllmLora(prefixes=(("model.visual.", "visual."), ("lm_head.", "language_model.lm_head."),
                            ("model.language_model.", "language_model.model.")),
                  modules=frozenset(ATTENTION + MLP)),
    gated_deltanet=False,
    fused_kinds=frozenset({"rms_norm", "swiglu"}),
)

QWEN3_5 = Family(
    name="qwen3_5",
    title="Qwen3.5",
    model_types=("qwen3_5", "qwen3_5_text"),
    model_class="Qwen3_5ForConditionalGeneration",
    processor_class="Qwen3VLProcessor",
    chat=CHATML,
    vision=QWEN_VISION,
    thinking=True,
    time_by_grid=False,
    video_layouts=MARKER_LAYOUTS,
    decoder_layers="model.language_model.layers",
    lora_modules=(("linear_attention", GATED_DELTANET + MLP), ("full_attention", ATTENTION + MLP)),
    vision_tower="model.visual",
    checkpoint=CheckpointLayout(language_model="model.language_model.", vision="model.visual.",
                                extras=("mtp.",)),  # multi-token prediction, which transformers skips
    generation_end=CHATML.turn_end,
    vllm=VllmLora(prefixes=(("model.visual.", "visual."), ("lm_head.", "language_model.lm_head."),
                            ("model.language_model.", "language_model.model."), ("mtp.", None)),
                  modules=frozenset(ATTENTION + MLP + GATED_DELTANET)),
    gated_deltanet=True,
    fused_kinds=frozenset({"rms_norm_zero_centered", "rms_norm_gated", "swiglu", "causal_conv1d"}),
)

FAMILIES: tuple[Family, ...] = (QWEN2_5_VL, QWEN3_VL, QWEN3_5)


def _model_type(config_or_model_type) -> str:
    if isinstance(config_or_model_type, str):
        return config_or_model_type
    if isinstance(config_or_model_type, dict):
        return str(config_or_model_type.get("model_type"))
    return str(getattr(config_or_model_type, "model_type", None))


def family_of(config_or_model_type) -> Family:
    """The family of a model: from its config (transformers' or config.json's dict; a PEFT model's
    config too) or its ``model_type``. An unknown one is an error naming it and the known families."""
    model_type = _model_type(config_or_model_type)
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    known = ", ".join(f"{family.name} ({family.title})" for family in FAMILIES)
    raise UnknownFamilyError(
        f"model_type {model_type!r} is not one of the model families videosft knows: {known}. A new family is "
        "one record in src/videosft/models/families.py and one tiny-checkpoint builder in "
        "tests/models/tiny_checkpoints.py")


def video_layouts(time_by_grid: bool) -> tuple[str, ...]:
    """The layouts of the families that tell time this way (by their grid, or by markers): code that
    has only the processor knows the family by that; the families that tell time alike allow the
    same layouts (a test holds it)."""
    return next(family.video_layouts for family in FAMILIES if family.time_by_grid == time_by_grid)


def missing_fields(family: Family) -> list[str]:
    """The fields of a record left empty (a record must say every one)."""
    return [field.name for field in fields(family) if getattr(family, field.name) in ("", (), None, frozenset())]
