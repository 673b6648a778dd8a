"""BatchesAhead: the batch announced is read and prepared on its thread, any other when taken."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from videosft.training.batches import BatchesAhead, collate, made_ahead
from videosft.media.pixels import stored_frames

# Qwen3-VL's video processor at its published geometry: two 32x32 frames make a 1x2x2 grid
VIDEO_PROCESSOR = Qwen3VLVideoProcessor(patch_size=16, temporal_patch_size=2, merge_size=2)


def sample(window_id: str, tokens: int, seed: int) -> dict:
    frames = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (2, 3, 32, 32), dtype=np.uint8))
    return {"window_id": window_id, "input_ids": list(range(1, tokens + 1)), "labels": [-100] * (tokens - 1) + [7],
            "mm_token_type_ids": [0] + [2] * (tokens - 1), **stored_frames(frames),
            "video_grid_thw": [1, 2, 2], "second_per_grid": None}


class Store:
    """Rows by position, noting which thread read which (the sample store's reader in training)."""

    def __init__(self, rows: list[dict]):
        self.rows, self.reads = rows, []

    def __call__(self, positions: list[int]) -> list[dict]:
        self.reads.append((threading.current_thread().name, list(positions)))
        return [self.rows[p] for p in positions]


class Recorder:
    """A position function that notes which thread ran it and for which batch."""

    def __init__(self, fail_on: str | None = None):
        self.calls: list[tuple[str, int]] = []
        self.fail_on = fail_on

    def __call__(self, batch: dict):
        length = batch["input_ids"].shape[1]
        self.calls.append((threading.current_thread().name, length))
        if self.fail_on and threading.current_thread().name.startswith(self.fail_on):
            raise ValueError(f"positions failed for a batch of {length} tokens")
        return torch.arange(length).expand(3, 1, length)


def test_the_announced_batch_is_read_and_prepared_on_the_host_thread_and_equals_collate():
    rows = [sample("a", 5, 0)]
    positions, store = Recorder(), Store(rows)
    batches = BatchesAhead(store, pad_id=0, video_processor=VIDEO_PROCESSOR, device=torch.device("cpu"),
                           positions=positions)
    batches.announce([0])
    taken = batches.take([0])
    batches.close()
    assert [name.startswith("batches-ahead") for name, _ in positions.calls] == [True]
    assert [(name.startswith("batches-ahead"), read) for name, read in store.reads] == [(True, [0])]
    expected = collate(rows, 0, VIDEO_PROCESSOR)
    assert set(taken) == set(expected) | {"position_ids"}
    assert all(torch.equal(taken[key], expected[key]) for key in expected)
    assert taken["pixel_values_videos"].dtype == torch.float16  # widened on the device by the model, not here


def test_a_batch_other_than_the_announced_one_is_prepared_when_taken():
    announced, wanted = [sample("a", 5, 0)], [sample("b", 9, 1)]
    positions, store = Recorder(), Store(announced + wanted)
    batches = BatchesAhead(store, pad_id=0, video_processor=VIDEO_PROCESSOR, device=torch.device("cpu"),
                           positions=positions)
    batches.announce([0])
    taken = batches.take([1])
    batches.close()
    assert taken["input_ids"].shape == (1, 9)
    assert torch.equal(taken["pixel_values_videos"], collate(wanted, 0, VIDEO_PROCESSOR)["pixel_values_videos"])
    assert (threading.current_thread().name, 9) in positions.calls  # prepared in the caller's thread
    assert (threading.current_thread().name, [1]) in store.reads


def test_an_error_while_preparing_ahead_reaches_the_training_loop():
    batches = BatchesAhead(Store([sample("a", 5, 0)]), pad_id=0, video_processor=VIDEO_PROCESSOR,
                           device=torch.device("cpu"), positions=Recorder(fail_on="batches-ahead"))
    batches.announce([0])
    with pytest.raises(ValueError, match="positions failed for a batch of 5 tokens"):
        batches.take([0])
    batches.close()


def test_without_a_position_function_the_model_computes_positions_itself():
    batches = BatchesAhead(Store([sample("a", 5, 0), sample("b", 3, 1)]), pad_id=0, video_processor=VIDEO_PROCESSOR,
                           device=torch.device("cpu"))
    taken = batches.take([0, 1])
    batches.close()
    assert "position_ids" not in taken
    assert taken["input_ids"].tolist()[1] == [1, 2, 3, 0, 0]  # padded to the longest


@pytest.mark.parametrize("pack", [False, True])
def test_pixels_made_where_the_batch_is_taken_equal_the_host_threads(pack):
    """The GPU path (the thread decodes, `take` runs the processor where the batch goes) on the CPU:
    the same keys and the same values, padded or packed, so only where the work runs changes."""
    rows = [sample("a", 5, 0), sample("b", 9, 1)]
    made = {}
    for on_device in (False, True):
        batches = BatchesAhead(Store(rows), pad_id=0, video_processor=VIDEO_PROCESSOR, device=torch.device("cpu"),
                               positions=Recorder(), pack=pack, pixels_on_device=on_device)
        batches.announce([0, 1])
        made[on_device] = batches.take([0, 1])
        batches.close()
    assert set(made[True]) == set(made[False])
    assert all(torch.equal(made[True][key], made[False][key]) for key in made[False])
    assert made[True]["pixel_values_videos"].shape[0] == 2 * 4  # two samples of 2x32x32: 1x2x2 patches each


def test_pixels_made_where_taken_refuse_a_grid_other_than_the_samples():
    wrong = {**sample("b", 5, 1), "video_grid_thw": [1, 4, 4]}
    batches = BatchesAhead(Store([wrong]), pad_id=0, video_processor=VIDEO_PROCESSOR, device=torch.device("cpu"),
                           pixels_on_device=True)
    with pytest.raises(Exception, match="sample b: the video processor makes grid \\[1, 2, 2\\]"):
        batches.take([0])
    batches.close()


def test_items_are_made_ahead_on_host_threads_in_order_and_an_error_reaches_the_caller():
    made_on = []

    def make(item):
        made_on.append(threading.current_thread().name)
        if item == "bad":
            raise ValueError("cannot read bad")
        return item.upper()

    assert list(made_ahead(["a", "b", "c"], make)) == ["A", "B", "C"]
    assert all(name.startswith("made-ahead") for name in made_on)
    ahead = made_ahead(["a", "bad"], make)
    assert next(ahead) == "A"
    with pytest.raises(ValueError, match="cannot read bad"):
        next(ahead)
    assert list(made_ahead([], make)) == []


def test_several_items_are_made_at_once_never_more_than_the_workers_ahead_of_the_caller():
    """Four workers: four items are being made at once (each waits for the others to start), and the lazy
    input is read no further than one ahead of what was handed to the workers."""
    started, read = threading.Barrier(4, timeout=10), []

    def items():
        for number in range(12):
            read.append(number)
            yield number

    def make(number):
        if number < 4:
            started.wait()  # breaks (an error) unless the first four run at the same time
        return number * 10

    ahead = made_ahead(items(), make, workers=4)
    assert next(ahead) == 0
    assert len(read) == 5  # four submitted, then one more once the first was taken
    assert list(ahead) == [10 * n for n in range(1, 12)]


@pytest.mark.parametrize("pack", [False, True])
def test_frames_decoded_by_worker_processes_make_the_same_batch(pack):
    rows = [sample("a", 5, 0), sample("b", 9, 1), sample("c", 4, 2)]
    made = {}
    for processes in (0, 2):
        batches = BatchesAhead(Store(rows), pad_id=0, video_processor=VIDEO_PROCESSOR, device=torch.device("cpu"),
                               positions=Recorder(), pack=pack, pixels_on_device=True, decode_processes=processes)
        batches.announce([0, 1, 2])
        made[processes] = batches.take([0, 1, 2])
        assert (batches.workers is None) == (processes == 0)
        batches.close()
    assert set(made[2]) == set(made[0])
    assert all(torch.equal(made[2][key], made[0][key]) for key in made[0])
