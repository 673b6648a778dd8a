"""A window's prompt for a model to answer: its training sample (:func:`.samples.build_sample`) cut
where the answer begins, so that a model in use sees the tokens and pixels it was trained on. A prompt
carries the processor's pixels, not the stored frames a training sample keeps."""

from __future__ import annotations

import time

from ..config import View
from ..data.rejects import Rejects
from ..media.budget import resolve_budget
from ..media.video import VideoFile
from .chat import prompt_of
from .samples import build_sample, processor_geometry


def window_prompts(video: VideoFile, windows: list[dict], processor, cfg: View,
                   rejects: Rejects, timings: dict | None = None) -> tuple[list[dict], list[dict]]:
    """Each window's prompt, made as its training sample is (the answer cut off), and a result
    entry for it; a window that cannot be encoded goes to the rejects. ``timings`` gains the
    seconds spent decoding frames ("decode") and making prompts of them ("preprocess")."""
    budget, geometry = resolve_budget(cfg.video), processor_geometry(processor)
    timings = {"decode": 0.0, "preprocess": 0.0} if timings is None else timings
    prompts, results = [], []
    for window in windows:
        started = time.perf_counter()
        try:
            sample = build_sample({**window, "keep_local": []}, video, processor, cfg, budget, geometry,
                                  keep_pixels=True)
        except Exception as error:  # one bad window never loses the others
            rejects.add(window["window_id"], error, video=window["video"])
            continue
        timings["decode"] += sample["decode_seconds"]
        timings["preprocess"] += time.perf_counter() - started - sample["decode_seconds"]
        prompts.append(prompt_of(sample))
        results.append({"window_id": window["window_id"], "start": window["window_start"],
                        "end": window["window_end"], "prompt_tokens": len(prompts[-1]["input_ids"])})
    return prompts, results
