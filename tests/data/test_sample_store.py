"""The sample store's index and reader: every row found where the index says, a bounded cache."""

from __future__ import annotations

import random

import pytest

from videosft.data import sample_store
from videosft.errors import InputError


def sample(number: int) -> dict:
    return {"window_id": f"w{number:03d}", "split": "train", "input_tokens": 10 + number, "visual_tokens": 4,
            "supervised_tokens": 2, "frame_indices": [0, 1], "video_grid_thw": [1, 2, number],
            "input_ids": list(range(number + 1)), "frames": [bytes([number]) * 50, b"x"], "frames_shape": [2, 3, 1, 1]}


def write_store(out, numbers: list[int], max_bytes: int) -> object:
    writer = sample_store.ShardWriter(out, {"schema_version": sample_store.SCHEMA_VERSION}, max_bytes)
    for number in numbers:
        writer.add(sample(number))
    files = writer.close()
    sample_store.write_manifest(out, files, {"train": len(numbers)}, {}, {}, "", "prompt")
    return out / sample_store.MANIFEST


def test_the_index_finds_every_row_in_window_order_across_files_and_row_groups(tmp_path):
    numbers = list(range(40))
    random.Random(0).shuffle(numbers)
    manifest = write_store(tmp_path, numbers, max_bytes=1500)  # several files of several row groups
    index = sample_store.index_samples(manifest, "train")
    assert len(index.files) > 1 and max(entry.group for entry in index) > 0
    assert index.window_ids() == [f"w{n:03d}" for n in range(40)]
    assert index[7].input_tokens == 17 and index[7].frames == 2 and index[7].grid == (1, 2, 7)
    reader = sample_store.SampleReader(index, cached_groups=2)
    expected = {row["window_id"]: row for row in sample_store.read_samples(manifest, "train")}
    for position in [39, 0, 12, 12, 25]:
        (row,) = reader.read([position])
        assert row == expected[index[position].window_id]
        assert len(reader.groups) <= 2
    lazy = sample_store.LazySamples(reader)
    assert [row["window_id"] for row in lazy[5:9]] == ["w005", "w006", "w007", "w008"] and len(lazy[:3]) == 3
    reader.close()


def test_a_row_that_is_not_where_the_index_says_names_its_place(tmp_path):
    manifest = write_store(tmp_path, list(range(10)), max_bytes=10**9)
    index = sample_store.index_samples(manifest, "train")
    write_store(tmp_path, list(range(10, 20)), max_bytes=10**9)  # the store is rewritten after indexing
    with pytest.raises(InputError, match=r"train-00000.parquet, row group 0, row 3: holds w013, the index says w003"):
        sample_store.SampleReader(index).read([3])


def test_a_row_group_closes_at_its_byte_bound_so_reading_a_large_sample_reads_little_else(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    # sample(n) counts 51 bytes of frames and 8 per token (n + 1 tokens): 59, 67, 75, ... 131 bytes
    monkeypatch.setattr(sample_store, "ROW_GROUP_BYTES", 200)
    manifest = write_store(tmp_path, list(range(10)), max_bytes=10**9)
    (path,) = sample_store.sample_files(manifest, "train")
    sizes = [pq.ParquetFile(path).metadata.row_group(g).num_rows for g in range(pq.ParquetFile(path).num_row_groups)]
    assert sizes == [3, 3, 2, 2]  # each group closes on the sample that takes it past 200 bytes, long before 8 rows
    index = sample_store.index_samples(manifest, "train")
    reader = sample_store.SampleReader(index)
    assert [row["window_id"] for row in reader.read([9, 4])] == ["w009", "w004"]
    assert [table.num_rows for table in reader.groups.values()] == [3]  # only the last group read is held
