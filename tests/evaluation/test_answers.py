"""The verify stage's answers (videosft.evaluation.answers): windows answered in batches by the base and
the fine-tune, each window read from the store once."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from videosft.data.sample_store import LazySamples, SampleReader, index_samples
from videosft.encoding.chat import IGNORE_INDEX
from videosft.models.families import CHATML
from videosft.evaluation.answers import evaluate, window_answers
from videosft.media.pixels import load_video_processor


class CountedReads(Sequence):
    """The store's rows, counting each row read by its position (a slice reads nothing until its rows are
    used). Row k comes with k more tokens before its last turn (the assistant's, which begins with
    ``turn_start``), so that the prompts differ in length and text, as real queries make them: the demo's
    windows differ only in their pixels, and the answers of a model this small hardly depend on those."""

    def __init__(self, rows, turn_start: int, positions: range | None = None, reads: list | None = None):
        self.rows, self.turn_start, self.reads = rows, turn_start, [] if reads is None else reads
        self.positions = range(len(rows)) if positions is None else positions

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, item):
        if isinstance(item, slice):
            return CountedReads(self.rows, self.turn_start, self.positions[item], self.reads)
        position = self.positions[item]
        self.reads.append(position)
        row = self.rows[position]
        at = max(i for i, token in enumerate(row["input_ids"]) if token == self.turn_start)
        added = {"input_ids": [40 + 7 * position] * position, "labels": [IGNORE_INDEX] * position,
                 "mm_token_type_ids": [0] * position}
        return {**row, **{key: list(row[key][:at]) + extra + list(row[key][at:]) for key, extra in added.items()}}


def adapted_demo_model(model_dir: Path):
    """The demo checkpoint in fp32 with larger random weights (the demo's answers are all newlines, which no
    batching mistake could change) and a LoRA adapter whose B is not zero, so that base and fine-tune differ."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig

    from videosft.models.checkpoint import model_class
    from videosft.models.lora import target_module_names

    model = model_class(AutoConfig.from_pretrained(model_dir)).from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.add_(torch.randn_like(parameter) * 0.5)
    config = LoraConfig(r=4, lora_alpha=4, lora_dropout=0.0, init_lora_weights=False,
                        target_modules=target_module_names(model, ["all-linear"]))
    return get_peft_model(model, config).eval()


def test_windows_answered_in_batches_are_read_once_and_answered_as_one_at_a_time(prepared, demo_config):
    from transformers import AutoTokenizer

    model_dir = Path(demo_config["model"]["path"])
    model, tokenizer = adapted_demo_model(model_dir), AutoTokenizer.from_pretrained(model_dir)
    video_processor = load_video_processor(model_dir)
    reader = SampleReader(index_samples(prepared / "preprocess" / "manifest.json", "val"))
    windows = LazySamples(reader)
    assert len(windows) >= 3, "the batches must hold several windows, and one batch fewer than the rest"

    turn_start = tokenizer.convert_tokens_to_ids(CHATML.turn_start)
    answers = {}
    for batch_size, read_ahead in ((1, False), (2, True), (2, False), (len(windows), False)):
        rows = CountedReads(windows, turn_start)
        answers[batch_size, read_ahead] = window_answers(model, rows, tokenizer, video_processor, max_new_tokens=8,
                                                         batch_size=batch_size, read_ahead=read_ahead)
        assert sorted(rows.reads) == list(range(len(windows))), f"batch_size {batch_size} read {rows.reads}"
    base, tuned = answers[1, False]
    assert answers[2, True] == answers[2, False] == answers[len(windows), False] == (base, tuned)
    assert [answer["window_id"] for answer in base] == [row["window_id"] for row in windows]
    assert [answer["text"] for answer in base] != [answer["text"] for answer in tuned], "the adapter must matter"
    assert len({answer["text"] for answer in tuned}) > 1, tuned  # answers depend on the window

    evaluation = evaluate(model, CountedReads(windows, turn_start), tokenizer, video_processor, max_new_tokens=8, batch_size=2)
    assert [(a["base"], a["fine_tuned"]) for a in evaluation["answers"]] == [
        (b["text"], t["text"]) for b, t in zip(base, tuned)]
    reader.close()
