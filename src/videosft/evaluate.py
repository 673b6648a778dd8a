"""Greedy answers on val windows, scored the same way for the base model and the fine-tune.

The answer parser is :func:`videosft.chat.parse_answer`, the one the preprocess stage's format
comes from. An answer that does not parse scores zero (as lmms-eval's Charades task does); a
degenerate one (a token or a short run of tokens repeated, or no end token within the budget,
as the field notes saw with ``<argmax>11</argmax>``) is counted as such too.
"""

from __future__ import annotations

from .chat import IGNORE_INDEX, generated_answer, parse_answer
from .metrics import window_metrics

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


def generate(model, rows: list[dict], tokenizer, max_new_tokens: int, collate, think_block: str = "prompt") -> list[dict]:
    """Greedy answers, with the raw text, whether they parse and whether they degenerate. Where the
    answers were trained to begin with the empty think block (``think_block`` "answer"), it is cut
    off before parsing."""
    import torch

    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    device = next(model.parameters()).device
    answers = []
    for row in rows:
        batch = {k: v.to(device) for k, v in collate([prompt_of(row)], tokenizer.pad_token_id or 0).items()
                 if k != "labels"}
        with torch.no_grad():
            output = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=end_id,
                                    pad_token_id=tokenizer.pad_token_id)
        new = output[0, batch["input_ids"].shape[1]:].tolist()
        ended = end_id in new
        tokens = new[: new.index(end_id)] if ended else new
        text = tokenizer.decode(tokens)
        answer = generated_answer(text) if think_block == "answer" else text
        answers.append({"window_id": row["window_id"], "text": text, "predicted": parse_answer(answer),
                        "target": [tuple(r) for r in row["keep_local"]], "degenerate": is_degenerate(tokens, ended)})
    return answers


def score(answers: list[dict]) -> dict:
    """Moment-retrieval metrics (fractions in [0, 1]) plus the rates of each kind of answer."""
    metrics = window_metrics({"predicted": a["predicted"], "target": a["target"]} for a in answers)
    count = len(answers)
    unparseable = sum(a["predicted"] is None for a in answers)
    degenerate = sum(a["degenerate"] for a in answers)
    return {**metrics, "well_formed_rate": (count - unparseable) / count, "unparseable_rate": unparseable / count,
            "degenerate_rate": degenerate / count}


def evaluate(model, rows: list[dict], tokenizer, max_new_tokens: int, collate, think_block: str = "prompt") -> dict:
    """Base (adapter disabled) and fine-tuned answers on the same windows, scored alike."""
    with model.disable_adapter():
        base = generate(model, rows, tokenizer, max_new_tokens, collate, think_block)
    tuned = generate(model, rows, tokenizer, max_new_tokens, collate, think_block)
    return {"windows": len(rows), "base": score(base), "fine_tuned": score(tuned),
            "answers": [{"window_id": b["window_id"], "target": b["target"], "base": b["text"], "fine_tuned": t["text"]}
                        for b, t in zip(base, tuned)]}


def table(result: dict) -> str:
    keys = [k for k in result["base"] if k != "num_samples"]
    lines = [f"{'metric':<18}{'base':>10}{'fine-tuned':>12}"]
    lines += [f"{key:<18}{result['base'][key]:>10.3f}{result['fine_tuned'][key]:>12.3f}" for key in keys]
    return "\n".join(lines)
