"""How vLLM names the modules a LoRA adapter's keys point at, by each family's ``vllm`` record in
videosft.models.families (written out from vLLM 0.33.0's source, read, not installed;
docs/video-layout.md): ``lora/utils.py`` strips ``base_model.model.`` and the ``.lora_A/B.weight``
suffix, then the model class's ``hf_to_vllm_mapper`` renames prefixes (the first that matches,
``None`` drops the key); the language model's layers live under ``language_model.model.layers.``.
An adapter key that does not land there loads without effect (vLLM PR 39369)."""

from __future__ import annotations

from videosft.models.families import family_of


def vllm_module(key: str, family: str) -> str | None:
    """The module name vLLM gives an adapter key, or None when its mapper drops the key."""
    name = key.removeprefix("base_model.model.")
    for suffix in (".lora_A.weight", ".lora_B.weight"):
        name = name.removesuffix(suffix)
    for old, new in family_of(family).vllm.prefixes:
        if name.startswith(old):
            return None if new is None else new + name[len(old):]
    return name


def unloadable(keys, family: str) -> list[str]:
    """The adapter keys vLLM would not apply to a language-model layer's linear module."""
    vllm = family_of(family).vllm
    return [key for key in keys
            if not ((module := vllm_module(key, family)) and module.startswith(vllm.layers)
                    and module.rsplit(".", 1)[-1] in vllm.modules)]
