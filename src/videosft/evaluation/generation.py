"""Greedy answers of a model to sample prompts: the one generation code of the verify stage's
evaluation (:mod:`videosft.evaluation.answers`) and of the predict stage.

A prompt is a sample cut where its answer begins (:func:`prompt_of`). Prompts are answered in
left-padded batches, so that every prompt ends where its answer begins, with the KV cache; a batch
of one is the one-prompt-at-a-time case, and batches give the same answers (a test holds them
equal on the demo model in fp32). An answer ends at its family's end token (``generation_end`` in
:mod:`videosft.models.families`: ``<|im_end|>``); one that repeats a token or a short run of tokens,
or has not ended within ``max_new_tokens``, is degenerate (as the field notes saw with
``<argmax>11</argmax>``).
"""

from __future__ import annotations

from ..encoding.chat import IGNORE_INDEX, generated_answer
from ..models.families import family_of
# A token repeated this many times in a row, or an n-gram (n <= 4) repeated this many times in a
# row, makes an answer degenerate.
REPEATS = 4


def prompt_of(row: dict) -> dict:
    """The sample up to the assistant's answer: what the model sees before it must answer."""
    start = next(i for i, label in enumerate(row["labels"]) if label != IGNORE_INDEX)
    return {**row, "input_ids": row["input_ids"][:start], "labels": [IGNORE_INDEX] * start,
            "mm_token_type_ids": row["mm_token_type_ids"][:start]}


def is_degenerate(tokens: list[int], ended: bool) -> bool:
    if not ended:
        return True
    for n in range(1, 5):
        for start in range(len(tokens) - n * REPEATS + 1):
            gram = tokens[start:start + n]
            if all(tokens[start + k * n:start + (k + 1) * n] == gram for k in range(1, REPEATS)):
                return True
    return False


def greedy_answers(model, prompts: list[dict], tokenizer, video_processor, max_new_tokens: int,
                   think_block: str = "prompt", batch_size: int = 1) -> list[dict]:
    """Each prompt's greedy answer, in order: ``text`` as generated (up to the family's end token),
    ``answer`` the text to parse (``text`` without the empty think block where answers were trained
    to begin with it, ``think_block`` "answer") and whether it is ``degenerate``."""
    import torch

    from ..training.batches import collate

    end_id = tokenizer.convert_tokens_to_ids(family_of(model.config).generation_end)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    answers = []
    for first in range(0, len(prompts), batch_size):
        batch = {key: value.to(device) for key, value in
                 collate(prompts[first:first + batch_size], pad_id, video_processor, left=True).items() if key != "labels"}
        with torch.no_grad():
            output = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=end_id,
                                    pad_token_id=pad_id, use_cache=True)
        for new in output[:, batch["input_ids"].shape[1]:].tolist():
            ended = end_id in new
            tokens = new[:new.index(end_id)] if ended else new
            text = tokenizer.decode(tokens)
            answers.append({"text": text, "answer": generated_answer(text) if think_block == "answer" else text,
                            "degenerate": is_degenerate(tokens, ended)})
    return answers
