"""Which modules get LoRA: one function, used by the probe to report and by the trainer to apply.

The vision tower and its merger(s) stay frozen whatever the targets say, and layers are named, by
the model family's record (:mod:`videosft.models.families`: ``vision_tower``, ``decoder_layers``).
"""

from __future__ import annotations

from collections import Counter

from .families import UNTYPED_LAYER, family_of

ALL_LINEAR = "all-linear"


def target_module_names(model, targets: list[str]) -> list[str]:
    """Full names of the language model's ``nn.Linear`` modules whose last name is in ``targets``.

    ``[all-linear]`` takes every linear layer of the language model (attention of both layer
    types in Qwen3.5, the MLPs), never the vision tower, its merger or the LM head.
    """
    import torch

    wanted = set(targets)
    family = family_of(model.config)
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and (ALL_LINEAR in wanted or name.rsplit(".", 1)[-1] in wanted)
        and not family.in_vision_tower(name)
        and not name.endswith("lm_head")
    ]


def coverage(model, targets: list[str], rank: int) -> dict:
    """What the targets touch, per layer type, and the trainable parameter count they add."""
    names = target_module_names(model, targets)
    modules = dict(model.named_modules())
    layer_types = list(getattr(model.config.get_text_config(), "layer_types", None) or [])
    family = family_of(model.config)
    per_type: Counter = Counter()
    layers_hit: dict[str, set] = {}
    for name in names:
        layer = family.layer_index(name)
        kind = layer_types[layer] if layer is not None and layer_types else UNTYPED_LAYER
        per_type[kind] += 1
        layers_hit.setdefault(kind, set()).add(-1 if layer is None else layer)
    trainable = sum(rank * (modules[n].in_features + modules[n].out_features) for n in names)
    missed_types = sorted(set(layer_types) - set(per_type))
    return {
        "targets": targets,
        "modules": len(names),
        "modules_per_layer_type": dict(per_type),
        "layers_per_layer_type": {k: len(v) for k, v in layers_hit.items()},
        "layer_type_counts": dict(Counter(layer_types)),
        "missed_layer_types": missed_types,
        "trainable_parameters": trainable,
        "examples": names[:4],
    }


def adapted_inputs(model, targets) -> tuple[int, ...]:
    """Per decoder layer of the language model, the values a token that its adapted projections read (the sum
    of their input widths): what peft copies for its adapters' backward pass (:mod:`videosft.training.memory`)."""
    family = family_of(model.config)
    modules = dict(model.named_modules())
    inputs = [0] * model.config.get_text_config().num_hidden_layers
    for name in target_module_names(model, targets):
        layer = family.layer_index(name)
        if layer is not None:
            inputs[layer] += modules[name].in_features
    return tuple(inputs)
