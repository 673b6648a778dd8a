"""What a measured training rate means: model and hardware FLOPs utilization of a LoRA step.

Per token of a training step on a frozen base with LoRA (LoRA's own FLOPs are negligible):

* **model FLOPs** (MFU's numerator, the work the model itself needs, as people compare it):
  the language model's forward, 2 x N_text, and the backward's input gradients, 2 x N_text (a
  frozen base computes no weight gradients); attention over the sequence in the full-attention
  layers, forward 4 x S x d_attn (scores and values) and backward 8 x S x d_attn, counted over the
  whole S x S matrix as PaLM's definition does (causal kernels compute about half of it); the
  vision tower's forward only (it is frozen and runs without a graph), 2 x N_vision per patch.
* **hardware FLOPs** (HFU's numerator, what the GPU really executes): the above plus the forward
  that gradient checkpointing recomputes, 2 x N_text + 4 x S x d_attn.

N_text excludes the embedding table (a lookup) and the LM head: the loss needs logits only at the
supervised positions (a few hundred of 13k tokens), which is all our train stage computes. The
Gated-DeltaNet recurrences are not counted (their projections are, in N_text). Both are divided by the GPU's
spec dense bf16 peak (H200: 989 TFLOP/s; the largest matmul measured here reaches about 787).
"""

from __future__ import annotations

from dataclasses import dataclass

H200_BF16_PEAK = 989e12  # FLOP/s, dense, from the spec sheet


@dataclass(frozen=True)
class Shape:
    n_text: int  # language-model parameters without the embedding table
    n_vision: int
    full_attention_layers: int
    d_attention: int  # heads x head dim
    tokens: int  # sequence length S
    patches: int  # vision patches of the sequence (merged visual tokens x merge^2)


def shape_of(config, tokens: int, visual_tokens: int) -> Shape:
    """Counts of a transformers config, from its model built on the meta device."""
    import torch

    from videosft.models.checkpoint import model_class

    with torch.device("meta"):
        model = model_class(config)._from_config(config)
    text, vision = config.get_text_config(), config.vision_config
    n_vision = sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}")
    tables = {id(model.get_input_embeddings().weight): model.get_input_embeddings().weight.numel(),
              id(model.get_output_embeddings().weight): model.get_output_embeddings().weight.numel()}
    n_text = sum(p.numel() for p in model.parameters()) - n_vision - sum(tables.values())
    layer_types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return Shape(n_text, n_vision, sum(t == "full_attention" for t in layer_types),
                 text.num_attention_heads * head_dim, tokens, visual_tokens * vision.spatial_merge_size ** 2)


def model_flops_per_token(shape: Shape) -> float:
    attention = 12 * shape.full_attention_layers * shape.tokens * shape.d_attention
    return 4 * shape.n_text + attention + 2 * shape.n_vision * shape.patches / shape.tokens


def hardware_flops_per_token(shape: Shape, recomputed: bool = True) -> float:
    recompute = 2 * shape.n_text + 4 * shape.full_attention_layers * shape.tokens * shape.d_attention
    return model_flops_per_token(shape) + (recompute if recomputed else 0)


def utilization(tokens_per_second: float, shape: Shape, peak: float = H200_BF16_PEAK,
                recomputed: bool = True) -> dict:
    """MFU and HFU of a measured per-GPU rate, fractions of ``peak``."""
    return {"mfu": tokens_per_second * model_flops_per_token(shape) / peak,
            "hfu": tokens_per_second * hardware_flops_per_token(shape, recomputed) / peak}
