"""How vLLM names the modules a LoRA adapter's keys point at, for the three families, written out
from vLLM 0.33.0's source (read, not installed; docs/video-layout.md): ``lora/utils.py`` strips
``base_model.model.`` and the ``.lora_A/B.weight`` suffix, then the model class's
``hf_to_vllm_mapper`` renames prefixes (the first that matches, ``None`` drops the key); the
language model's layers live under ``language_model.model.layers.``. An adapter key that does not
land there loads without effect (vLLM PR 39369)."""

from __future__ import annotations

PREFIXES = {
    "qwen3_5": [("model.visual.", "visual."), ("lm_head.", "language_model.lm_head."),
                ("model.language_model.", "language_model.model."), ("mtp.", None)],
    "qwen3_vl": [("model.visual.", "visual."), ("lm_head.", "language_model.lm_head."),
                 ("model.language_model.", "language_model.model.")],
    "qwen2_5_vl": [("model.language_model.", "language_model.model."), ("model.visual.", "visual."),
                   ("lm_head.", "language_model.lm_head."), ("model.", "language_model.model.")],
}
# Linear modules vLLM's classes accept LoRA on: the members of its packed modules (qkv_proj,
# gate_up_proj and, for Qwen3.5's linear attention, in_proj_qkvz / in_proj_ba) and the plain ones.
LORA_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"}
LAYERS = "language_model.model.layers."


def vllm_module(key: str, family: str) -> str | None:
    """The module name vLLM gives an adapter key, or None when its mapper drops the key."""
    name = key.removeprefix("base_model.model.")
    for suffix in (".lora_A.weight", ".lora_B.weight"):
        name = name.removesuffix(suffix)
    for old, new in PREFIXES[family]:
        if name.startswith(old):
            return None if new is None else new + name[len(old):]
    return name


def unloadable(keys, family: str) -> list[str]:
    """The adapter keys vLLM would not apply to a language-model layer's linear module."""
    return [key for key in keys
            if not ((module := vllm_module(key, family)) and module.startswith(LAYERS)
                    and module.rsplit(".", 1)[-1] in LORA_MODULES)]
