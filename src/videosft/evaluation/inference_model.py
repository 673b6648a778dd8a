"""A checkpoint loaded whole for inference: the base model from ``from_pretrained`` on one device,
with a LoRA adapter over it; the verify stage checks the adapter as loaded, the predict stage folds
it into the weights."""

from __future__ import annotations

from pathlib import Path

from ..data.adapter import check_readable
from ..models.checkpoint import model_class


def load_model(model_dir: Path, adapter_dir: Path | None = None, dtype=None, merge: bool = False):
    """The checkpoint of ``model_dir`` in eval mode, on the GPU if there is one, else the CPU, in
    ``dtype`` (by default bf16 on a GPU, fp32 on the CPU); with the adapter of ``adapter_dir`` over
    it, merged into the weights when ``merge`` (for speed: nothing is left to compare)."""
    import torch
    from transformers import AutoConfig

    if adapter_dir is not None:
        check_readable(adapter_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype is None:
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = model_class(AutoConfig.from_pretrained(model_dir)).from_pretrained(model_dir, dtype=dtype,
                                                                                device_map=device)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
        if merge:
            model = model.merge_and_unload()
    return model.eval()
