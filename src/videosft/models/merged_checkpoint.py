"""What a merged checkpoint (base + adapter, the export stage's output) holds beyond the merged model's
own weights, and the config flags that must agree with its files.

* Copied through: a published checkpoint holds tensors its transformers class never loads, e.g.
  Qwen3.5's multi-token-prediction head ``mtp.*`` (serving engines use it for speculative decoding;
  config.json still announces it as ``mtp_num_hidden_layers``). ``save_pretrained`` of the merged model
  would drop them, so they are handed to it beside the model's weights and written as the base
  stores them (:func:`base_only_tensors`, :func:`differing_tensors`).
* Accounted for: every base tensor is in the merged files under its own name, except a tied alias
  (a second key of a tensor the model holds once, written once); anything else missing is an error
  (:func:`left_out`).
* Tie flags (:func:`tie_flags`): transformers ties the head by the top-level ``tie_word_embeddings``,
  while vLLM reads the text config's, so a config saying true at the top and false in ``text_config``
  (as the demo's once did) makes a strict loader look for an ``lm_head.weight`` the files do not hold.
  The rule: both flags say what the files do, true when they hold no separate ``lm_head.weight``,
  false when they do. A head that the files would lose (absent, yet different from the embedding it
  would be tied to) cannot be repaired by flags and is refused.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from .checkpoint import TensorInfo, map_checkpoint, read_tensors


class ExportError(UserError, ValueError):
    """The merged checkpoint would not hold what base + adapter make; the message says what and what to do."""


def base_only_tensors(model, base: dict[str, TensorInfo]) -> tuple[list[str], list[str]]:
    """(the base's keys the model holds no tensor for, which the export copies through; the base's keys
    that are tied aliases of another key the model holds as one tensor, which it writes once)."""
    report = map_checkpoint(model, base)
    extras = sorted(report.unexpected + report.ignored)
    aliases = sorted(set(base) - set(report.key_map) - set(extras))  # map_checkpoint maps one key per tensor
    return extras, aliases


def left_out(base: dict[str, TensorInfo], written: dict[str, TensorInfo], aliases: list[str]) -> list[dict]:
    """Each base tensor the merged files lack, with why; any that is not a tied alias is an error."""
    missing = sorted(set(base) - set(written))
    unexplained = [key for key in missing if key not in aliases]
    if unexplained:
        raise ExportError(f"the merged checkpoint lacks {len(unexplained)} tensors of the base "
                          f"(e.g. {unexplained[:3]}) under the base's key names; the base's key layout is not "
                          "one transformers writes back. Report this with the base's model.safetensors.index.json")
    return [{"tensor": key, "why": "a tied alias: the model holds it as one tensor with another key, written once"}
            for key in missing]


def differing_tensors(out_dir: Path, written: dict[str, TensorInfo], expected: dict) -> list[str]:
    """The keys whose tensor in the checkpoint at ``out_dir`` is not ``expected``'s, byte for byte."""
    import torch

    found = read_tensors(out_dir, written, sorted(expected))

    def same(a, b) -> bool:
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))

    return [key for key in sorted(expected) if not same(found[key], expected[key])]


def head_is_embedding(model) -> bool:
    """Whether the model's output head is its input embedding (tied), or equal to it element for element."""
    import torch

    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    return head is embedding or torch.equal(head, embedding)


def tie_flags(config: dict, lm_head_in_files: bool, head_equals_embedding: bool) -> tuple[dict, dict]:
    """``config`` (config.json's dict) with ``tie_word_embeddings`` at the top and in ``text_config`` set
    to what the files hold, and the record of the rule: the flags written, the files' fact, the base's
    flags (None: unset) and whether the config changed."""
    tied = not lm_head_in_files
    if tied and not head_equals_embedding:
        raise ExportError("the merged model's lm_head differs from its input embedding, but the files hold no "
                          "lm_head.weight (the base's config ties them), so every loader would tie them and "
                          "answer differently; leave lm_head and embed_tokens out of lora.target_modules, or "
                          "export from a base whose config.json says tie_word_embeddings: false")
    text = config.get("text_config")
    fixed = {**config, "tie_word_embeddings": tied}
    if isinstance(text, dict):
        fixed["text_config"] = {**text, "tie_word_embeddings": tied}
    record = {"config_top": tied, "text_config": tied if isinstance(text, dict) else None,
              "lm_head_in_files": lm_head_in_files,
              "base_config": {"config_top": config.get("tie_word_embeddings"),
                              "text_config": text.get("tie_word_embeddings") if isinstance(text, dict) else None},
              "config_changed": fixed != config}
    return fixed, record


def check_tie_read_back(model_dir: Path, tied: bool) -> None:
    """transformers reads the flags written to ``model_dir``'s config.json as written (a config class that
    overrides them makes the checkpoint inconsistent in a way flags cannot repair)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    read = {"top level": config.tie_word_embeddings,
            "text_config": getattr(config.get_text_config(), "tie_word_embeddings", tied)}
    wrong = {where: value for where, value in read.items() if value != tied}
    if wrong:
        raise ExportError(f"{model_dir}/config.json: transformers reads tie_word_embeddings as {wrong} although "
                          f"the files {'lack' if tied else 'hold'} lm_head.weight and the config says {tied}; "
                          "this transformers cannot load the merged checkpoint consistently")
