"""Greedy answers of a model to sample prompts: the one generation code of the verify stage's
evaluation (:mod:`videosft.evaluation.answers`) and of the predict stage, which answers the prompts of
successive videos together (:func:`answered_in_order`).

A prompt is a sample cut where its answer begins (:func:`videosft.encoding.chat.prompt_of`). Prompts are answered in
left-padded batches, so that every prompt ends where its answer begins, with the KV cache; a batch
of one is the one-prompt-at-a-time case, and batches give the same answers (a test holds them
equal on the demo model in fp32). An answer ends at its family's end token (``generation_end`` in
:mod:`videosft.models.families`: ``<|im_end|>``); one that repeats a token or a short run of tokens,
or has not ended within ``max_new_tokens``, is degenerate (as the field notes saw with
``<argmax>11</argmax>``).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Callable, Iterable

from ..encoding.chat import generated_answer
from ..models.families import family_of

# A token repeated this many times in a row, or an n-gram (n <= 4) repeated this many times in a
# row, makes an answer degenerate.
REPEATS = 4


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
    """Each prompt's greedy answer, in order (:func:`batch_answers`), answered ``batch_size`` at a time."""
    answers = []
    for first in range(0, len(prompts), batch_size):
        batch = prompt_batch(prompts[first:first + batch_size], tokenizer, video_processor)
        answers += batch_answers(model, batch, tokenizer, max_new_tokens, think_block)
    return answers


def prompt_batch(prompts: list[dict], tokenizer, video_processor) -> dict:
    """Prompts as one left-padded batch of host tensors, pixels made from their frames: every prompt
    ends where its answer begins."""
    from ..training.batches import collate

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return {key: value for key, value in collate(prompts, pad_id, video_processor, left=True).items()
            if key != "labels"}


def batch_answers(model, batch: dict, tokenizer, max_new_tokens: int, think_block: str = "prompt") -> list[dict]:
    """The greedy answer to each prompt of a :func:`prompt_batch`: ``text`` as generated (up to the
    family's end token), ``answer`` the text to parse (``text`` without the empty think block where
    answers were trained to begin with it, ``think_block`` "answer") and whether it is ``degenerate``."""
    import torch

    end_id = tokenizer.convert_tokens_to_ids(family_of(model.config).generation_end)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    batch = {key: value.to(device) for key, value in batch.items()}
    with torch.no_grad():
        output = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=end_id,
                                pad_token_id=pad_id, use_cache=True)
    answers = []
    for new in output[:, batch["input_ids"].shape[1]:].tolist():
        ended = end_id in new
        tokens = new[:new.index(end_id)] if ended else new
        text = tokenizer.decode(tokens)
        answers.append({"text": text, "answer": generated_answer(text) if think_block == "answer" else text,
                        "degenerate": is_degenerate(tokens, ended)})
    return answers


@dataclasses.dataclass
class Prompts:
    """A run of one item's prompts (some of a video's windows) with a result entry for each; ``last``: the
    item's last run; ``seconds``: where making them spent its time."""
    item: object
    prompts: list[dict]
    results: list[dict]
    last: bool
    seconds: dict = dataclasses.field(default_factory=dict)


def answered_in_order(runs: Iterable, answer: Callable[[list[dict]], list[dict]], batch_size: int):
    """(item, its results, each updated with its prompt's answer) for each item, in order, once every
    prompt of it is answered. ``runs``: :class:`Prompts` in order (an item's runs one after another); anything
    else (a video skipped before its prompts) comes back as (it, []) in its place. The prompts of successive
    items are answered together in batches of ``batch_size`` (``answer``: prompts -> answers, one dict each),
    so an item of fewer prompts than a batch leaves no place in it empty, and the batches, cut from the
    prompts in order, are the same whatever the timing of whoever makes the runs."""
    waiting: deque = deque()  # [item, its results, how many are answered, whether its last run came]
    queued: list = []  # (its item's entry, result, prompt), not answered yet, in order

    def answer_first(count: int) -> None:
        batch, queued[:] = queued[:count], queued[count:]
        for (entry, result, _), answered in zip(batch, answer([prompt for _, _, prompt in batch]), strict=True):
            result.update(answered)
            entry[2] += 1

    def finished():
        while waiting and waiting[0][3] and waiting[0][2] == len(waiting[0][1]):
            item, results, _, _ = waiting.popleft()
            yield item, results

    for run in runs:
        if not isinstance(run, Prompts):
            waiting.append([run, [], 0, True])
        else:
            if not waiting or waiting[-1][0] is not run.item:
                waiting.append([run.item, [], 0, False])
            entry = waiting[-1]
            entry[1].extend(run.results)
            entry[3] = run.last
            queued.extend((entry, result, prompt) for result, prompt in zip(run.results, run.prompts, strict=True))
        while len(queued) >= batch_size:
            answer_first(batch_size)
        yield from finished()
    while queued:
        answer_first(batch_size)
    yield from finished()
