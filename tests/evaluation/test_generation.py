"""Greedy generation (videosft.evaluation.generation), shared by the verify stage's evaluation and predict."""

from __future__ import annotations

from pathlib import Path

from videosft import config as config_lib
from videosft.evaluation.generation import Prompts, answered_in_order, greedy_answers, is_degenerate
from videosft.media.pixels import load_video_processor
from videosft.data.rejects import Rejects
from videosft.data.windows import read_windows
from videosft.encoding.prompts import window_prompts
from videosft.media.timeline import resolve_video
from videosft.media.video import VideoFile


def val_prompts(prepared, demo_config, rejects: Rejects) -> list[dict]:
    """The demo's val windows as predict builds their prompts (the training samples' code), each
    asked about something else, so that the prompts differ in length as real queries do."""
    from transformers import AutoProcessor

    cfg = config_lib.for_stage("predict", demo_config)
    processor = AutoProcessor.from_pretrained(cfg.model.path)
    windows = read_windows(prepared / "window" / "windows.parquet", "val")
    queries = ["the ball", "the red ball", "the red ball in the middle of the frame", "a red ball moving fast"]
    prompts = []
    for window, query in zip(windows, queries):
        path = resolve_video(Path(cfg.data.root), window["video"])
        made, _ = window_prompts(VideoFile(path), [{**window, "query": query}], processor, cfg, rejects)
        prompts += made
    return prompts


def test_batches_answer_as_one_prompt_at_a_time(prepared, demo_config, tmp_path):
    """Left padding and the KV cache change nothing: on the demo model in fp32, prompts of different
    lengths answered in one batch get the answers they get one at a time, token for token."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from videosft.models.checkpoint import model_class

    rejects = Rejects(tmp_path / "rejects.jsonl")
    prompts = val_prompts(prepared, demo_config, rejects)
    assert rejects.items == [] and len(prompts) == 4
    assert len({len(prompt["input_ids"]) for prompt in prompts}) >= 3, "the prompts must differ in length"
    model_dir = Path(demo_config["model"]["path"])
    model = model_class(AutoConfig.from_pretrained(model_dir)).from_pretrained(model_dir, dtype=torch.float32).eval()
    # the demo checkpoint answers every prompt with newlines, which no padding mistake could change:
    # larger random weights make the answers depend on the prompt
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.add_(torch.randn_like(parameter) * 0.5)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    video_processor = load_video_processor(model_dir)
    one_by_one = greedy_answers(model, prompts, tokenizer, video_processor, max_new_tokens=8)
    batched = greedy_answers(model, prompts, tokenizer, video_processor, max_new_tokens=8, batch_size=len(prompts))
    assert batched == one_by_one
    assert len({answer["text"] for answer in one_by_one}) > 1, one_by_one


def test_degenerate_answers():
    assert is_degenerate([5, 6, 7], ended=False)  # no end token within the budget
    assert is_degenerate([1, 9, 9, 9, 9], ended=True)  # one token four times in a row
    assert is_degenerate([3, 4, 3, 4, 3, 4, 3, 4], ended=True)  # a two-token run four times
    assert not is_degenerate([1, 2, 3, 1, 2, 3, 1, 2, 3], ended=True)  # three times is an answer's right


def test_prompts_of_successive_videos_are_answered_together_and_each_video_comes_back_whole_in_order():
    """predict's batches run across videos (a folder of short videos fills each one), are cut from the
    prompts in order (the same whatever the host threads' timing), and a video comes back once all of it is
    answered; a video skipped before its prompts keeps its place."""
    windows = {"a": 1, "b": 5, "empty": 0, "c": 2}

    def runs(video: str, size: int = 3):
        ids = [f"{video}#{i}" for i in range(windows[video])]
        for first in range(0, max(1, len(ids)), size):
            part = ids[first:first + size]
            yield Prompts(video, [{"id": i} for i in part], [{"window_id": i} for i in part],
                          first + size >= len(ids))

    batches = []

    def answer(prompts):
        batches.append([p["id"] for p in prompts])
        return [{"answer": f"to {p['id']}"} for p in prompts]

    skipped = {"shown": "broken.mp4"}
    stream = [*runs("a"), skipped, *runs("b"), *runs("empty"), *runs("c")]
    out = list(answered_in_order(iter(stream), answer, batch_size=3))
    assert batches == [["a#0", "b#0", "b#1"], ["b#2", "b#3", "b#4"], ["c#0", "c#1"]]
    assert [item for item, _ in out] == ["a", skipped, "b", "empty", "c"]
    for item, results in out:
        if item is not skipped:
            assert [r["window_id"] for r in results] == [f"{item}#{i}" for i in range(windows[item])]
            assert all(r["answer"] == f"to {r['window_id']}" for r in results)
    assert out[3][1] == []  # no prompt: predict skips it, never writes an empty cut list
