"""Pretraining of the tiny base: full-parameter training of its language model on rendered clips, so
that it sees the ball and reads the clip's time markers before any LoRA is fitted.
"""

from __future__ import annotations

import numpy as np

from ..config import View
from .videos import QUERY, render_frames

# A random-init model knows nothing a LoRA could adapt, as a pretrained VLM does. The pretraining
# teaches it to see the ball and to read the clip's time markers, with an answer that the range
# format does not parse (a list of marker times, or "never"), so the base still scores zero on the
# pipeline's task: turning those times into keep ranges is left to the fine-tune.
PRETRAIN_INSTRUCTION = "At which of its marked times does this clip show {query}? List them, or say never."
NEVER = "never"


def pretraining_sample(rng: np.random.Generator, cfg: View, processor, system: str) -> dict:
    """A rendered clip, its prompt, and the answer: the time markers of the frame pairs with the ball."""
    import torch
    from transformers.video_utils import VideoMetadata

    from ..encoding.chat import assistant_labels, prompt_timestamps

    pretrain, fps = cfg.pretrain, cfg.fps
    seconds = int(pretrain.clip_seconds)
    n_frames = seconds * fps
    count = int(rng.choice(3, p=[0.15, 0.45, 0.4]))  # windows with 0, 1 or 2 keep ranges
    bounds = np.sort(rng.choice(np.arange(seconds + 1), size=2 * count, replace=False)) * fps
    intervals = [(int(bounds[2 * i]), int(bounds[2 * i + 1])) for i in range(count)]
    picks = np.linspace(0, n_frames - 1, int(seconds * pretrain.sample_fps) // 2 * 2).round().astype(int)
    frames = torch.from_numpy(render_frames(rng, cfg, intervals, n_frames, picks.tolist())).permute(0, 3, 1, 2)
    turns = [{"role": "system", "content": system},
             {"role": "user", "content": [{"type": "video"},
                                          {"type": "text", "text": PRETRAIN_INSTRUCTION.format(query=QUERY)}]}]
    metadata = VideoMetadata(total_num_frames=len(picks), fps=float(fps), frames_indices=picks.tolist(),
                             height=cfg.height, width=cfg.width)
    encoded = processor(text=[processor.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)],
                        videos=[frames], video_metadata=[metadata], return_tensors="pt",
                        videos_kwargs={"do_resize": False, "do_sample_frames": False, "return_metadata": True})
    tokenizer = processor.tokenizer
    prompt_ids = encoded["input_ids"][0].tolist()
    markers = prompt_timestamps(tokenizer.decode(prompt_ids))
    shown = [any(a <= i < b for a, b in intervals) for i in picks[::2]]
    if len(markers) != len(shown):
        raise RuntimeError(f"the processor marked {len(markers)} times for {len(shown)} frame pairs")
    answer = ", ".join(f"{time:.1f}" for time, seen in zip(markers, shown) if seen) or NEVER
    input_ids = prompt_ids + tokenizer(answer + "<|im_end|>\n", add_special_tokens=False)["input_ids"]
    answer_length = len(input_ids) - len(prompt_ids)
    return {
        "input_ids": torch.tensor(input_ids),
        "labels": torch.tensor(assistant_labels(input_ids, tokenizer, answer)),
        "mm_token_type_ids": torch.cat([encoded["mm_token_type_ids"][0],
                                        torch.zeros(answer_length, dtype=torch.int)]),
        "pixel_values_videos": encoded["pixel_values_videos"],
        "video_grid_thw": encoded["video_grid_thw"],
        "prompt_length": len(prompt_ids),
        "answer": answer,
    }


def pretraining_batch(samples: list[dict], pad_id: int, prompt_only: bool = False) -> dict:
    import torch

    def cut(sample, key):
        return sample[key][: sample["prompt_length"]] if prompt_only else sample[key]

    length = max(len(cut(s, "input_ids")) for s in samples)

    def padded(key: str, fill: int):
        return torch.stack([torch.nn.functional.pad(cut(s, key), (0, length - len(cut(s, key))), value=fill)
                            for s in samples])

    batch = {
        "input_ids": padded("input_ids", pad_id),
        "attention_mask": torch.stack([torch.arange(length) < len(cut(s, "input_ids")) for s in samples]).long(),
        "mm_token_type_ids": padded("mm_token_type_ids", 0),
        "pixel_values_videos": torch.cat([s["pixel_values_videos"] for s in samples]),
        "video_grid_thw": torch.cat([s["video_grid_thw"] for s in samples]),
    }
    if not prompt_only:
        batch["labels"] = padded("labels", -100)
    return batch


def held_out_accuracy(model, samples: list[dict], tokenizer) -> float:
    """Exact-match rate of greedy answers (one clip at a time: no left padding needed)."""
    import torch

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    right = 0
    model.eval()
    with torch.no_grad():
        for sample in samples:
            batch = pretraining_batch([sample], tokenizer.pad_token_id, prompt_only=True)
            output = model.generate(**batch, max_new_tokens=32, do_sample=False, eos_token_id=end,
                                    pad_token_id=tokenizer.pad_token_id)
            right += tokenizer.decode(output[0, sample["prompt_length"]:], skip_special_tokens=True) == sample["answer"]
    return right / len(samples)


def pretrain(model, processor, cfg: View, system: str) -> dict:
    """Full-parameter training of the language model (the vision tower stays as built) on rendered clips."""
    import time

    import torch

    pretrain_cfg = cfg.pretrain
    if cfg.height % 32 or cfg.width % 32:
        raise ValueError(f"demo.pretrain needs demo.height and demo.width in multiples of 32 (patch 16 x merge 2), "
                         f"not {cfg.height}x{cfg.width}")
    started = time.perf_counter()
    rng = np.random.default_rng(cfg.seed + 1)  # not the pipeline videos' stream
    samples = [pretraining_sample(rng, cfg, processor, system) for _ in range(pretrain_cfg.clips)]
    held_out, train = samples[: pretrain_cfg.held_out], samples[pretrain_cfg.held_out:]
    torch.manual_seed(cfg.seed)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".visual." not in f".{name}")
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=pretrain_cfg.lr, weight_decay=0.0)
    steps, batch_size = pretrain_cfg.steps, pretrain_cfg.batch_size
    order = torch.randperm(len(train) * (steps * batch_size // len(train) + 1)) % len(train)
    model.train()
    losses = []
    for step in range(steps):
        warm = min(1.0, (step + 1) / 20)  # a short warm-up, then a cosine to a tenth
        for group in optimizer.param_groups:
            group["lr"] = pretrain_cfg.lr * warm * (0.1 + 0.45 * (1 + np.cos(np.pi * step / steps)))
        rows = [train[i] for i in order[step * batch_size:(step + 1) * batch_size].tolist()]
        loss = model(**pretraining_batch(rows, processor.tokenizer.pad_token_id), use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            print(f"pretrain step {step} loss {loss.item():.4f}", flush=True)
    accuracy = held_out_accuracy(model, held_out, processor.tokenizer)
    facts = {"steps": steps, "clips": len(train), "held_out": len(held_out), "first_loss": losses[0],
             "last_loss": losses[-1], "held_out_exact_match": accuracy, "seconds": time.perf_counter() - started,
             "example": {"answer": held_out[0]["answer"]}}
    print(f"pretrain: held-out exact match {accuracy:.3f} after {steps} steps (loss {losses[0]:.3f} -> {losses[-1]:.4f})")
    if accuracy < pretrain_cfg.min_exact_match:
        raise RuntimeError(f"the pretrained base answers {accuracy:.0%} of held-out clips exactly, under "
                           f"demo.pretrain.min_exact_match={pretrain_cfg.min_exact_match}: raise demo.pretrain.steps")
    return facts
