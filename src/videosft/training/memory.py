"""Per-GPU peak memory of a LoRA + ZeRO-3 run, predicted before any GPU time is spent.

The model follows the lecture's accounting (weights, gradients, Adam states per parameter, plus
activations that grow with the sample), extended to ZeRO-3, LoRA and video:

* base weights in the training precision, partitioned over the ranks, plus the small
  "persistent" parameters every rank keeps whole;
* the gathered working set: the largest block ZeRO-3 must assemble at once (a decoder layer, or
  the embedding / LM head) plus the prefetch bucket; with whole-block gathering, the embedding and
  a whole decoder layer;
* LoRA: weights and gradients in fp32 whatever the training precision (:data:`ADAPTER_BYTES` says why),
  DeepSpeed's fp32 master copy and Adam's two moments: 20 bytes per trainable parameter, partitioned,
  plus the gradient reduce buffer; on one rank, which trains without ZeRO (:func:`whole_on_one_rank`),
  16 bytes and no reduce buffer;
* activations of the longest sample: the checkpointed input of every decoder layer, one layer's
  forward + backward working set during recomputation, the logits (only at supervised positions
  when the trainer slices them, else every position), and the vision tower's forward under
  ``no_grad`` (one block's buffers at a time);
* allocator slack: reserved = allocated x ``RESERVED_OVER_ALLOCATED``.

Coefficients that cannot be derived exactly (the working-set multipliers) are named constants,
calibrated against measured peaks (bench/RESULTS.md), one pair per kernel set: transformers' torch
forwards, flash-linear-attention's Gated-DeltaNet alone (``videosft.kernels.gated_deltanet``), or with the fused
norms, SwiGLU and convolution too (``videosft.kernels.fused``).

The probe plans for the longest sample of the preprocess stage's store (:func:`longest_sample`,
:func:`probe_plan`); the train stage puts the same prediction beside its measured peaks
(:func:`memory_comparison`). Both take the train config's options from :class:`PlanOptions`.
"""

from __future__ import annotations

import dataclasses
import os
import types
from dataclasses import asdict, dataclass
from pathlib import Path

from ..data.sample_store import read_samples
from ..kernels.fused import ENV as FUSED_ENV
from ..kernels.gated_deltanet import gpu_implementation
from ..models.families import family_of

GIB = 2**30
# One recomputed layer's forward + backward working set over its forward activations (the
# projections' outputs). Two would hold for plain attention layers; Qwen3.5's Gated-DeltaNet layers
# in transformers' torch fallback keep fp32 chunk intermediates, and the slope of measured peaks
# over sequence length on 2x H200 (Qwen3.5-4B, 64 and 128 frames, bench/RESULTS.md) gives 4.6.
BACKWARD_OVER_FORWARD = 4.6
# Caching allocator: reserved memory over the live peak (measured 1.085 and 1.094 in those runs).
RESERVED_OVER_ALLOCATED = 1.09
# The same two with flash-linear-attention's Gated-DeltaNet kernel but transformers' own norms,
# SwiGLU and convolution (train.fused_kernels: torch): from the measured peak at 128 frames on 2x
# H200 (9.96 GiB allocated, 11.46 reserved; bench/RESULTS.md), one point, so the layer factor also
# absorbs the other components' error there. Checked on 11 runs, 16 to 384 frames, both DeepSpeed
# profiles: within 15% of every peak (bench/RESULTS.md).
UNFUSED_BACKWARD_OVER_FORWARD = 1.8
UNFUSED_RESERVED_OVER_ALLOCATED = 1.15
# fla everywhere (its Gated-DeltaNet and videosft.kernels.fused's kernels), the default on a GPU with fla: the
# fused kernels keep fewer tensors for the backward pass. Fitted on two runs at 128 frames on 2x H200
# under expandable segments (Qwen3.5-4B 10.51 / 10.78 GiB, Qwen3-VL-8B 15.54 / 15.88; bench/RESULTS.md).
FLA_BACKWARD_OVER_FORWARD = 1.0
FLA_RESERVED_OVER_ALLOCATED = 1.06
COEFFICIENTS = {"torch": (BACKWARD_OVER_FORWARD, RESERVED_OVER_ALLOCATED),
                "fla-unfused": (UNFUSED_BACKWARD_OVER_FORWARD, UNFUSED_RESERVED_OVER_ALLOCATED),
                "fla": (FLA_BACKWARD_OVER_FORWARD, FLA_RESERVED_OVER_ALLOCATED)}
# fp32 logits upcast + their gradient, on top of the logits in the training precision.
LOGIT_EXTRA_BYTES = 8
# peft creates the adapters in fp32 and DeepSpeed's engine does not cast parameters added after the
# partitioned build, so they and their gradient partitions (in the dtype of the optimizer's first parameter)
# are fp32 whatever the training precision; the reduce bucket is in the communication dtype, the precision's.
ADAPTER_BYTES = 4
# An adapter parameter, its gradient, DeepSpeed's fp32 master copy of it and Adam's two moments (a run
# without ZeRO, :func:`whole_on_one_rank`, keeps no master copy: its optimizer steps the fp32 adapters).
LORA_BYTES = 5 * ADAPTER_BYTES
# The LoRA of the runs the coefficients above were fitted on (the schema's defaults): what its adapters keep for
# the backward pass is inside them; a plan adds what other targets or dropout keep beyond it (AdapterInputs).
CALIBRATED_LORA_TARGETS = ("q_proj", "v_proj")
CALIBRATED_LORA_DROPOUT = 0.05


def adapter_bytes(inputs: float, precision: str, dropout: float) -> float:
    """Bytes a token that peft's adapter path keeps for the backward pass in a layer whose adapted projections
    read ``inputs`` values a token. The adapters are fp32 (:data:`ADAPTER_BYTES`): in a bf16 / fp16 run peft
    copies each adapted projection's input to fp32 and the adapter keeps the copy for its weight gradient
    (with dropout, the dropped-out copy, beside a one-byte mask on CUDA); in an fp32 run without dropout it
    keeps the layer's own tensor, nothing of its own."""
    cast = precision != "fp32"
    return inputs * ((ADAPTER_BYTES if cast or dropout else 0) + (1 if dropout else 0))


@dataclass(frozen=True)
class AdapterInputs:
    """Per decoder layer, the values a token that its LoRA-adapted projections read, with the run's targets and
    with those the coefficients were fitted on (:func:`videosft.models.lora.adapted_inputs`)."""

    targets: tuple[int, ...]
    calibrated: tuple[int, ...]
    dropout: float

    def extra(self, precision: str) -> tuple[float, ...]:
        """Bytes a token, per layer, that the run's adapters keep beyond what the coefficients hold."""
        return tuple(adapter_bytes(mine, precision, self.dropout) - adapter_bytes(fitted, precision,
                                                                               CALIBRATED_LORA_DROPOUT)
                     for mine, fitted in zip(self.targets, self.calibrated))


@dataclass(frozen=True)
class ModelFacts:
    """Sizes read off the model built on the meta device."""

    parameters: int
    vision_parameters: int
    largest_layer_parameters: int
    embedding_parameters: int  # input embedding (and the LM head when tied)
    lm_head_parameters: int  # 0 when tied to the embedding
    small_parameters: int  # parameters in tensors at or below the persistence threshold
    layers: int
    hidden: int
    intermediate: int
    attention_width: int  # q + k + v + o projection widths of a full-attention layer
    vocab: int
    vision_hidden: int
    vision_intermediate: int
    vision_heads: int
    merge: int


@dataclass(frozen=True)
class SampleFacts:
    input_tokens: int
    visual_tokens: int
    supervised_tokens: int
    frames: int
    # text tokens each further frame pair brings besides its visual tokens: its <t seconds> marker
    # and vision start / end tokens (about 8 with Qwen3's markers)
    text_per_pair: float = 0.0


def model_facts(model, persistence_threshold: int) -> ModelFacts:
    """Read the sizes the plan needs off a model (meta device is fine: only shapes are used)."""
    family = family_of(model.config)  # where its vision tower and decoder layers are
    text = model.config.get_text_config()
    vision = model.config.vision_config
    layer_sizes: dict[int, int] = {}
    vision_parameters = small = 0
    for name, parameter in model.named_parameters():
        count = parameter.numel()
        if family.in_vision_tower(name):
            vision_parameters += count
        if count <= persistence_threshold:
            small += count
        layer = family.layer_index(name)
        if layer is not None:
            layer_sizes[layer] = layer_sizes.get(layer, 0) + count
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    attention_width = head_dim * (2 * text.num_attention_heads + 2 * text.num_key_value_heads)
    return ModelFacts(
        parameters=sum(p.numel() for p in model.parameters()),
        vision_parameters=vision_parameters,
        largest_layer_parameters=max(layer_sizes.values(), default=0),
        embedding_parameters=embedding.numel(),
        lm_head_parameters=0 if head is embedding else head.numel(),
        small_parameters=small,
        layers=text.num_hidden_layers,
        hidden=text.hidden_size,
        intermediate=text.intermediate_size,
        attention_width=attention_width,
        vocab=text.vocab_size,
        vision_hidden=vision.hidden_size,
        vision_intermediate=vision.intermediate_size,
        vision_heads=getattr(vision, "num_heads", None) or vision.num_attention_heads,
        merge=vision.spatial_merge_size,
    )


# What the plan reads of each stored sample: its token counts, frames and token types
LENGTH_COLUMNS = ["input_tokens", "visual_tokens", "supervised_tokens", "frame_indices", "mm_token_type_ids"]


def text_per_frame_pair(token_types: list[int], frames: int) -> float:
    """Text tokens between consecutive frame pairs' video tokens (a pair's <t seconds> marker and its
    vision start / end tokens): what one more frame pair adds besides its visual tokens."""
    video = [i for i, kind in enumerate(token_types) if kind]
    pairs = frames // 2
    if pairs < 2 or not video:
        return 0.0
    return sum(1 for kind in token_types[video[0]:video[-1] + 1] if not kind) / (pairs - 1)


def longest_sample(manifest: Path) -> SampleFacts:
    """The sample with the most input tokens, in either split: it sets the activation peak."""
    rows = read_samples(manifest, "train", LENGTH_COLUMNS) + read_samples(manifest, "val", LENGTH_COLUMNS)
    row = max(rows, key=lambda r: r["input_tokens"])
    frames = len(row["frame_indices"])
    return SampleFacts(row["input_tokens"], row["visual_tokens"], row["supervised_tokens"], frames,
                       text_per_frame_pair(row["mm_token_type_ids"], frames))


def precision_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def largest_block(model: ModelFacts) -> int:
    """The most parameters ZeRO-3 assembles for one module: a decoder layer, the embedding or the LM head."""
    return max(model.largest_layer_parameters, model.embedding_parameters, model.lm_head_parameters)


def whole_on_one_rank(ds_zero: dict, world: int, precision: str, zero3_on_one_rank: bool = False) -> bool:
    """Whether the train stage runs without ZeRO (DeepSpeed stage 0, the model built whole): on one rank
    that keeps its weights and optimizer on its GPU ZeRO-3 partitions nothing, and its fetch and release
    hooks cost the host 0.14-0.16 s a step for no memory (bench/RESULTS.md). fp16 keeps ZeRO-3 for its
    loss scaling; an offload in the DeepSpeed config keeps it for the memory it buys; so does
    ``train.zero3_on_one_rank``."""
    offloaded = any(ds_zero.get(key, {}).get("device", "none") != "none" for key in ("offload_param",
                                                                                       "offload_optimizer"))
    return world == 1 and precision != "fp16" and not offloaded and not zero3_on_one_rank


def gathered_parameters(model: ModelFacts, world: int, ds_zero: dict, weights_on_host: bool,
                        whole_blocks: bool) -> int:
    """The parameters gathered whole at the peak, beside each rank's own partition."""
    if world == 1 and not weights_on_host:
        # DeepSpeed hands each module its partition, which is the whole tensor: nothing is gathered
        # (partition_parameters.py, NoGatherHandle)
        return 0
    if whole_blocks:
        # whole blocks are gathered past the live limit, and the whole embedding (the tied LM head
        # at the logits) is live beside a layer: the measured +1.39 GiB over per-module gathering on
        # 2x H200 at 128 frames
        return largest_block(model) + model.largest_layer_parameters
    prefetch = int(ds_zero.get("stage3_prefetch_bucket_size", 5e7))
    max_live = int(ds_zero.get("stage3_max_live_parameters", 1e9))
    return min(max_live, largest_block(model) + prefetch)  # the live limit caps per-module gathering


def trained_state(trainable: int, world: int, ds_zero: dict, precision: str, zero: bool,
                  trainable_bytes: int | None) -> dict:
    """The bytes per rank of what trains (:func:`plan_peak`'s options; ``zero``: the run is under ZeRO):
    its weights, gradients and optimizer states, and under ZeRO the gradient reduce buffer."""
    if trainable_bytes is None:
        trainable_bytes = LORA_BYTES if zero else LORA_BYTES - ADAPTER_BYTES
    p = precision_bytes(precision)
    reduce_bucket = int(ds_zero.get("reduce_bucket_size", 5e8))
    # with contiguous_gradients DeepSpeed allocates a whole reduce bucket up front (stage3.py, "IPG")
    reduce_buffer = (reduce_bucket if ds_zero.get("contiguous_gradients", True) else 0) * p + \
        min(reduce_bucket, trainable) * p
    return {"lora_weights_grads_adam": trainable * trainable_bytes / world,
            "gradient_reduce_buffer": reduce_buffer if zero else 0}


def plan_peak(model: ModelFacts, sample: SampleFacts, trainable: int, world: int, ds_zero: dict,
              precision: str = "bf16", sliced_logits: bool = True, checkpointing: bool = True,
              kernels: str | None = None, offload_activations: bool = False, whole_blocks: bool = False,
              sequence_parallel: int = 1, uncheckpointed_layers: int = 0, trainable_bytes: int | None = None,
              zero3_on_one_rank: bool = False, adapter_extra: tuple[float, ...] = ()) -> dict:
    """Predicted peak bytes per rank, by component (``kernels``: a key of ``COEFFICIENTS``, the
    kernel set the run uses; None: as :func:`planned_kernels` says). ``ds_zero["offload_param"]``
    on the host takes the weights' partition off the GPU; ``offload_activations`` the checkpointed layer inputs
    (one comes back at a time, for its layer's recomputation); ``uncheckpointed_layers`` n: the last n
    layers keep their whole forward's activations instead of their input (train.uncheckpointed_layers);
    ``adapter_extra``: per layer, bytes a token that LoRA's adapters keep beyond the coefficients' own
    (:meth:`AdapterInputs.extra`);
    ``whole_blocks``: ZeRO-3 gathers whole decoder layers (train.gather_whole_blocks). ``sequence_parallel`` n: n
    ranks share the sequence (train.sequence_parallel), so a rank holds a slice of its tokens and frames, at
    most a 1/n share plus one frame pair (the cuts fall between pairs), while the weights stay partitioned over
    the whole world; its attention runs on every token for 1/n of the heads, as many bytes as its slice of all
    heads, and the all-to-alls hold a send and a receive copy of one layer's query, key and value slice. The
    supervised logits are planned whole on one rank (the answer follows the video, on the last).
    ``trainable_bytes``: per trainable parameter beside the base weights (default: an adapter's, :data:`LORA_BYTES`,
    less the master copy a run without ZeRO does not keep)."""
    kernels = kernels or planned_kernels()
    zero = not whole_on_one_rank(ds_zero, world, precision, zero3_on_one_rank)
    backward_over_forward, reserved_over_allocated = COEFFICIENTS[kernels]
    p = precision_bytes(precision)
    n = sequence_parallel
    pair_visual = sample.visual_tokens / max(1, sample.frames // 2)  # a rank's share may be one pair over 1/n
    tokens = sample.input_tokens / n + pair_visual + sample.text_per_pair if n > 1 else sample.input_tokens
    patches = (sample.visual_tokens / n + pair_visual if n > 1 else sample.visual_tokens) * model.merge**2
    checkpointed = model.layers - uncheckpointed_layers if checkpointing else 0
    activations = decoder_activations(model, tokens, p, checkpointed, offload_activations, backward_over_forward)
    logit_positions = sample.supervised_tokens if sliced_logits else tokens
    patches_per_frame_pair = pair_visual * model.merge**2
    vision = patches * p * (4 * model.vision_hidden + model.vision_intermediate) + \
        patches_per_frame_pair**2 * model.vision_heads * p
    weights_on_host = ds_zero.get("offload_param", {}).get("device", "none") in ("cpu", "nvme")
    gathered = gathered_parameters(model, world, ds_zero, weights_on_host, whole_blocks)
    components = {
        "weights_partitioned": 0 if weights_on_host else model.parameters * p / world,
        "persistent_small_parameters": model.small_parameters * p * (world - 1) / world,
        "gathered_working_set": gathered * p,
        # under offload_param the rank's partition of the block being gathered is staged on the GPU
        # for the all-gather (the largest: the embedding); fits the two measured offload peaks
        # (bench/RESULTS.md) within 8%, where without it they were 8% and 20% low
        "offload_staging": largest_block(model) * p / world if weights_on_host else 0,
        **trained_state(trainable, world, ds_zero, precision, zero, trainable_bytes),
        "activations_checkpointed_layers": activations,
        "lora_input_copies": adapter_copies(tokens, checkpointed, adapter_extra),
        "embeddings_in_and_out": 2 * tokens * model.hidden * p,
        "logits": logit_positions * model.vocab * (p + LOGIT_EXTRA_BYTES),
        "vision_forward_no_grad": vision,
        "sequence_exchange": 2 * tokens * model.attention_width * p if n > 1 else 0,
    }
    allocated = sum(components.values())
    return {"components_gib": {k: v / GIB for k, v in components.items()},
            "allocated_gib": allocated / GIB, "reserved_gib": allocated * reserved_over_allocated / GIB,
            "kernels": kernels, "without_zero": not zero}


def decoder_activations(model: ModelFacts, tokens: float, p: int, checkpointed: int, offload: bool,
                        backward_over_forward: float) -> float:
    """Bytes the decoder layers keep for the backward pass (``p``: bytes a value; the first ``checkpointed``
    layers checkpointed, the rest not): a checkpointed layer its input (one at a time when ``offload`` holds
    them on the host) and, while its backward runs, its recomputed forward scaled by ``backward_over_forward``;
    an uncheckpointed layer its whole forward's activations."""
    layer_forward = tokens * p * (model.attention_width + 3 * model.intermediate + 4 * model.hidden)
    if checkpointed <= 0:
        return model.layers * layer_forward
    kept_inputs = 1 if offload else checkpointed
    return kept_inputs * tokens * model.hidden * p + \
        (model.layers - checkpointed + backward_over_forward) * layer_forward


def adapter_copies(tokens: float, checkpointed: int, adapter_extra: tuple[float, ...]) -> float:
    """Bytes LoRA's adapters keep beyond the coefficients' own (``adapter_extra``: per layer, bytes a token), for
    as long as their layer's activations live: an uncheckpointed layer's all through, one of the first
    ``checkpointed`` while it is recomputed (the largest of them)."""
    extra = [tokens * bytes_a_token for bytes_a_token in adapter_extra] or [0.0]
    if checkpointed <= 0:
        return sum(extra)
    return sum(extra[checkpointed:]) + max(extra[:checkpointed])


def planned_kernels(fused: str = "auto") -> str:
    """The kernel set a GPU run in this environment will use, for planning without a GPU or a model
    (``fused``: train.fused_kernels; the environment variable wins, as in the run)."""
    if gpu_implementation() == "torch":
        return "torch"
    return "fla-unfused" if (os.environ.get(FUSED_ENV) or fused) == "torch" else "fla"


def sample_at_frames(sample: SampleFacts, frames: int) -> SampleFacts:
    """The same sample with ``frames`` frames at its per-frame budget (and its per-pair markers)."""
    pairs = max(1, sample.frames // 2)
    visual = int(sample.visual_tokens / pairs * frames / 2)
    text = sample.input_tokens - sample.visual_tokens + sample.text_per_pair * (frames / 2 - pairs)
    return SampleFacts(visual + round(text), visual, sample.supervised_tokens, frames, sample.text_per_pair)


def micro_batch(sample: SampleFacts, micro_batch_size: int = 1, pack_tokens: int | None = None) -> SampleFacts:
    """The largest micro-batch the train stage forms from samples like ``sample``, as the one sequence the
    plan sizes: ``micro_batch_size`` of them padded to the longest, or (``train.pack_tokens``) a pack
    filled to its budget with the sample's mix of visual, text and supervised tokens. Frames scale
    with the tokens, so each frame pair keeps its patches (the vision tower attends within a pair)."""
    scale = pack_tokens / sample.input_tokens if pack_tokens else micro_batch_size
    if scale == 1:
        return sample
    return SampleFacts(round(sample.input_tokens * scale), round(sample.visual_tokens * scale),
                       round(sample.supervised_tokens * scale), max(2, round(sample.frames * scale)),
                       sample.text_per_pair)


def largest_frames(model: ModelFacts, sample: SampleFacts, trainable: int, world: int, ds_zero: dict,
                   limit_gib: float, precision: str = "bf16", step: int = 2, cap: int = 4096,
                   micro_batch_size: int = 1, pack_tokens: int | None = None, **options) -> int:
    """Most frames per sample (a multiple of ``step``) whose micro-batch's predicted reserved peak stays
    under ``limit_gib``, and whose sample still fits a pack's budget (``options``: plan_peak's
    checkpointing and offload switches)."""
    best = 0
    frames = step
    while frames <= cap:
        scaled = sample_at_frames(sample, frames)
        if pack_tokens and scaled.input_tokens > pack_tokens:
            break
        peak = plan_peak(model, micro_batch(scaled, micro_batch_size, pack_tokens), trainable, world, ds_zero,
                         precision, **options)
        if peak["reserved_gib"] > limit_gib:
            break
        best = frames
        frames += step
    return best


def flowchart(model: ModelFacts, sample: SampleFacts, trainable: int, world: int, ds_zero: dict,
              limit_gib: float, bf16_supported: bool = True) -> list[dict]:
    """The lecture's decision chain, with the numbers behind each answer."""
    precision = "bf16" if bf16_supported else "fp16"
    steps = [{"question": "mixed precision?", "answer": precision,
              "why": "always train in mixed precision; bf16 where the GPU supports it (Ampere and newer), "
                     "else fp16 with loss scaling"}]
    # the whole model trains: its weights are counted already; a gradient in the precision, fp32 master and moments
    full = {"trainable_bytes": precision_bytes(precision) + 12}
    full_one = plan_peak(model, sample, model.parameters, 1, ds_zero, precision, checkpointing=False, **full)
    steps.append({"question": "full fine-tuning, batch 1, one GPU?", "predicted_gib": full_one["reserved_gib"],
                  "answer": "fits" if full_one["reserved_gib"] <= limit_gib else "does not fit",
                  "why": "16 bytes per parameter (weights, gradients, Adam) plus activations"})
    full_zero3 = plan_peak(model, sample, model.parameters, world, ds_zero, precision, **full)
    steps.append({"question": f"full fine-tuning, ZeRO-3 over {world} GPUs, gradient checkpointing?",
                  "predicted_gib": full_zero3["reserved_gib"],
                  "answer": "fits" if full_zero3["reserved_gib"] <= limit_gib else "does not fit",
                  "why": "ZeRO-3 partitions weights, gradients and optimizer states; activations are not partitioned"})
    lora = plan_peak(model, sample, trainable, world, ds_zero, precision)
    steps.append({"question": f"LoRA, ZeRO-3 over {world} GPUs, gradient checkpointing?",
                  "predicted_gib": lora["reserved_gib"],
                  "answer": "fits" if lora["reserved_gib"] <= limit_gib else "does not fit",
                  "why": "only the adapters carry gradients and optimizer states"})
    return steps


@dataclass(frozen=True)
class PlanOptions:
    """What of the train config shapes the peak (:data:`videosft.config.MEMORY_PLAN_KEYS`), made once for
    the probe's plan and for the train stage's prediction beside its measured peaks."""

    precision: str
    checkpointing: bool
    offload_activations: bool
    uncheckpointed_layers: int
    whole_blocks: bool
    kernels: str
    micro_batch_size: int
    pack_tokens: int | None
    sequence_parallel: int = 1
    zero3_on_one_rank: bool = False
    adapter_extra: tuple[float, ...] = ()

    @classmethod
    def of(cls, train_cfg, precision: str | None = None, kernels: str | None = None) -> "PlanOptions":
        """From the train section. The probe plans for bf16 where the run will choose (``auto``) and for the
        kernels this environment will bind; the train stage gives what it chose and bound."""
        precision = precision or ("bf16" if train_cfg.precision in ("auto", "bf16") else train_cfg.precision)
        return cls(precision, train_cfg.gradient_checkpointing, train_cfg.offload_activations,
                   train_cfg.uncheckpointed_layers, train_cfg.gather_whole_blocks,
                   kernels or planned_kernels(train_cfg.fused_kernels),
                   train_cfg.micro_batch_size, train_cfg.pack_tokens or None, train_cfg.sequence_parallel,
                   train_cfg.zero3_on_one_rank)

    @property
    def peak(self) -> dict:
        """:func:`plan_peak`'s keyword options."""
        return {"precision": self.precision, "checkpointing": self.checkpointing, "kernels": self.kernels,
                "offload_activations": self.offload_activations, "whole_blocks": self.whole_blocks,
                "uncheckpointed_layers": self.uncheckpointed_layers,
                "sequence_parallel": self.sequence_parallel, "zero3_on_one_rank": self.zero3_on_one_rank,
                "adapter_extra": self.adapter_extra}

    def with_adapters(self, adapters: "AdapterInputs | None") -> "PlanOptions":
        """These options with what ``adapters`` keep beyond the coefficients, at this plan's precision."""
        return dataclasses.replace(self, adapter_extra=adapters.extra(self.precision) if adapters else ())

    @property
    def batching(self) -> dict:
        """:func:`micro_batch`'s keyword options."""
        return {"micro_batch_size": self.micro_batch_size, "pack_tokens": self.pack_tokens}


def probe_plan(model: ModelFacts, sample: SampleFacts, trainable: int, ds_zero: dict, options: PlanOptions,
               limit_gib: float, world_sizes: list[int], sequence_sizes: list[int] = (1,),
               adapters: AdapterInputs | None = None) -> dict:
    """Predicted per-GPU peaks of the largest micro-batch (``options``' micro-batch of samples like
    ``sample``) for each world size (those that ``options.sequence_parallel`` divides), the largest frame
    count per sample under ``limit_gib``, the same for one micro-batch shared by n cards for each n of
    ``sequence_sizes`` (the sizes the model's head counts allow), and the lecture's flowchart (one sample)
    for the largest world size. ``adapters``: what the LoRA targets read, kept with the plan for the train
    stage's own prediction."""
    options = options.with_adapters(adapters)
    batch = micro_batch(sample, **options.batching)
    n = options.sequence_parallel
    per_world = {}
    for world in [w for w in world_sizes if w % n == 0] or [n]:
        per_world[str(world)] = planned_world(model, sample, batch, trainable, world, ds_zero, options, limit_gib)
    shared = {str(k): planned_world(model, sample, batch, trainable, k, ds_zero,
                                    dataclasses.replace(options, sequence_parallel=k), limit_gib)
              for k in sequence_sizes}
    return {
        "gpu_memory_gib": limit_gib,
        "precision": options.precision,
        "longest_sample": asdict(sample),
        "micro_batch": {**options.batching, **asdict(batch)},
        "model_facts": asdict(model),
        "adapter_inputs": asdict(adapters) if adapters else None,
        "sequence_parallel": n,
        "per_world_size": per_world,
        "per_sequence_parallel_size": shared,
        "flowchart": flowchart(model, sample, trainable, max(world_sizes), ds_zero, limit_gib),
    }


def planned_world(model: ModelFacts, sample: SampleFacts, batch: SampleFacts, trainable: int, world: int,
                  ds_zero: dict, options: PlanOptions, limit_gib: float) -> dict:
    """One world size's predicted peak for ``batch`` and the most frames per sample under ``limit_gib``."""
    peak = plan_peak(model, batch, trainable, world, ds_zero, **options.peak)
    peak["largest_frames_under_limit"] = largest_frames(model, sample, trainable, world, ds_zero, limit_gib,
                                                        **options.peak, **options.batching)
    peak["most_uncheckpointed_layers_under_limit"] = most_uncheckpointed_layers(
        model, batch, trainable, world, ds_zero, limit_gib, **options.peak)
    return peak


def most_uncheckpointed_layers(model: ModelFacts, batch: SampleFacts, trainable: int, world: int, ds_zero: dict,
                               limit_gib: float, **options) -> int | None:
    """Most decoder layers that may keep their activations (train.uncheckpointed_layers) with ``batch``'s
    predicted reserved peak still under ``limit_gib``: 0 when the plan as configured does not fit, None
    without gradient checkpointing (every layer keeps them already)."""
    if not options.get("checkpointing", True):
        return None
    options = {key: value for key, value in options.items() if key != "uncheckpointed_layers"}
    fits = [n for n in range(model.layers + 1)
            if plan_peak(model, batch, trainable, world, ds_zero, uncheckpointed_layers=n, **options)["reserved_gib"]
            <= limit_gib]
    return max(fits, default=0)


def micro_batch_words(plan: dict) -> str:
    """What a :func:`probe_plan`'s micro-batch is, in words."""
    batch, longest = plan["micro_batch"], plan["longest_sample"]["input_tokens"]
    if batch["pack_tokens"]:
        return f"a pack of {batch['pack_tokens']} tokens; the longest sample has {longest}"
    if batch["micro_batch_size"] > 1:
        return f"{batch['micro_batch_size']} samples padded to the longest, {longest} tokens"
    return f"the longest sample, {longest} tokens"


def kernel_set(kernels: dict) -> str:
    """The planner's name (a key of :data:`COEFFICIENTS`) for the kernels a train run bound, from its record."""
    if kernels["gated_deltanet"]["implementation"] == "torch":
        return "torch"
    if "fla" in kernels["fused"]["implementation"].values():
        return "fla"
    return "fla-unfused" if kernels["gated_deltanet"]["implementation"] == "fla" else "torch"


def planned_batches(index, packed_plan=None) -> list:
    """What a train run's prediction is sized by: its samples (index entries), or with packing each pack
    of ``packed_plan`` (the first epoch's) as one sample of all its tokens and frames."""
    if packed_plan is None:
        return list(index)
    return [types.SimpleNamespace(**{key: sum(getattr(index[i], key) for i in pack) for key in
                                     ("input_tokens", "visual_tokens", "supervised_tokens", "frames")})
            for packs in packed_plan.packs for pack in packs]


def memory_comparison(probe: dict, batches: list, world: int, ds_zero: dict, options: PlanOptions,
                      peaks: list[list[dict]]) -> dict:
    """The planner's prediction for a train run beside each rank's measured peak. ``batches``: the samples
    (padded micro-batches are sized here), or with packing its packs, each as one sample of all its tokens."""
    facts = probe.get("memory", {}) and probe["memory"].get("model_facts")
    measured = {rank: {key: max(step[key] for step in steps) for key in steps[0]} if steps else {}
                for rank, steps in enumerate(peaks)}
    if not facts:
        return {"measured": measured}
    longest = max(batches, key=lambda entry: entry.input_tokens)
    sample = micro_batch(SampleFacts(longest.input_tokens, longest.visual_tokens, longest.supervised_tokens,
                                     longest.frames), options.micro_batch_size)
    adapters = probe["memory"].get("adapter_inputs")
    options = options.with_adapters(AdapterInputs(**adapters) if adapters else None)
    predicted = plan_peak(ModelFacts(**facts), sample, probe["lora"]["trainable_parameters"], world, ds_zero,
                          **options.peak)
    return {"predicted": predicted, "measured": measured}
