"""Unit tests of the window arithmetic and the annotation checks (videosft.media.timeline,
videosft.data.windows, videosft.data.annotations; no video decoding)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from videosft import config as config_lib
from videosft.data.annotations import parse_annotation, qvhighlights_source
from videosft.data.windows import assign_splits, check_sources_whole, video_shards
from videosft.errors import Rejected
from videosft.media.timeline import Realigned, merge_ranges, realign, resolve_video, window_bounds

PROPERTY = settings(
    max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
EPS = 1e-6  # window_bounds keeps times to the microsecond; lengths may differ from `length` by that
FITS = 1e-9  # window_bounds counts a window that overshoots the end by less than this as fitting
ROUNDTRIP = 1e-9  # float slack for local + start vs source in the property tests (exact check: below)

DATA = config_lib.section("data")  # the data config parse_annotation reads
QVH_DATA = config_lib.section("data", {"format": "qvhighlights"})


# --------------------------------------------------------------------------------------------
# strategies


def _times(scale: int):
    """Seconds: either arbitrary floats or 'annotation-like' decimals (tenths / hundredths)."""
    return st.one_of(
        st.floats(min_value=0.05, max_value=scale, allow_nan=False, allow_infinity=False),
        st.integers(min_value=1, max_value=scale * 10).map(lambda n: n / 10),
        st.integers(min_value=5, max_value=scale * 100).map(lambda n: n / 100),
    )


@st.composite
def window_setups(draw):
    """(duration, length, stride, tail) with stride <= length (touching or overlapping windows)."""
    duration = draw(_times(600))
    length = draw(_times(120))
    stride = draw(
        st.one_of(
            st.just(length),
            st.just(length / 2),
            st.floats(min_value=0.1, max_value=1.0).map(lambda f: length * f),
            st.integers(min_value=1, max_value=10).map(lambda n: min(length, n / 2)),
        )
    )
    assume(stride > 0.01 and duration / stride < 3000)  # keeps the number of windows small
    tail = draw(st.sampled_from(["shift", "short", "drop"]))
    return duration, length, stride, tail


@st.composite
def keep_ranges(draw, duration: float, edges: list[float], span: float):
    """Valid [start, end] ranges within [0, duration]; endpoints sometimes exactly on window edges."""
    points = st.one_of(
        st.floats(min_value=0.0, max_value=1.0).map(lambda f: f * duration),
        st.sampled_from(edges),
        # near a window edge, either side
        st.tuples(st.sampled_from(edges), st.floats(min_value=-1.0, max_value=1.0)).map(
            lambda p: min(max(p[0] + p[1] * span, 0.0), duration)
        ),
        st.integers(min_value=0, max_value=int(duration * 10)).map(lambda n: min(n / 10, duration)),
    )
    ranges = []
    for _ in range(draw(st.integers(min_value=0, max_value=8))):
        a, b = draw(points), draw(points)
        if a == b:
            continue
        ranges.append((min(a, b), max(a, b)))
    return ranges


# --------------------------------------------------------------------------------------------
# realign + window_bounds together


def _check_window(keep: list, start: float, end: float, min_fragment: float, result: Realigned) -> None:
    length = end - start
    assert len(result.local) == len(result.source)

    for (ls, le), (ss, se) in zip(result.local, result.source):
        # local ranges live in window time, inside [0, window length]
        assert 0.0 <= ls <= le <= length, (ls, le, length)
        # source ranges live inside the window, in source time
        assert start <= ss < se <= end
        # local + window start gives back the source range (exactness: test_realign_roundtrip_exact)
        assert math.isclose(ls + start, ss, abs_tol=ROUNDTRIP) and math.isclose(le + start, se, abs_tol=ROUNDTRIP)
        assert (ls, le) == (ss - start, se - start)
        # kept fragments are at least min_fragment long
        assert se - ss >= min_fragment

    for ds, de in result.dropped:
        assert start <= ds < de <= end
        assert de - ds < min_fragment

    overlapping = [(s, e) for s, e in keep if e > start and s < end]
    # nothing lost without being counted: each overlapping range is kept or dropped, once
    assert len(result.source) + len(result.dropped) == len(overlapping)
    accounted = list(result.source) + list(result.dropped)
    for s, e in overlapping:
        clipped = (max(s, start), min(e, end))
        assert clipped in accounted, (s, e, clipped, accounted)
        accounted.remove(clipped)
        if start <= s and e <= end and e - s >= min_fragment:
            # fully inside: unchanged, and local + start is the original range
            i = result.source.index((s, e))
            ls, le = result.local[i]
            assert math.isclose(ls + start, s, abs_tol=ROUNDTRIP) and math.isclose(le + start, e, abs_tol=ROUNDTRIP)
    # ranges that cross an edge are counted as clipped, and only those
    crossing = sum(1 for s, e in overlapping if s < start or e > end)
    assert result.clipped == crossing


@PROPERTY
@given(data=st.data(), setup=window_setups(), min_fragment=st.one_of(st.just(0.0), st.floats(0.0, 5.0)))
def test_realign_over_windows_property(data, setup, min_fragment):
    duration, length, stride, tail = setup
    bounds = window_bounds(duration, length, stride, tail)
    edges = sorted({t for w in bounds for t in w if 0 <= t <= duration} | {0.0, duration})
    raw = data.draw(keep_ranges(duration, edges, min(length, duration)))
    keep, _ = merge_ranges(raw)
    for start, end in bounds:
        _check_window(keep, start, end, min_fragment, realign(keep, start, end, min_fragment))


@PROPERTY
@given(
    setup=window_setups(),
    offset=st.floats(min_value=0.0, max_value=1.0),
    span=st.floats(min_value=0.0, max_value=1.0),
)
def test_realign_range_inside_window_is_unchanged(setup, offset, span):
    """A single range strictly inside a window comes back unchanged (local + start == source)."""
    duration, length, stride, tail = setup
    for start, end in window_bounds(duration, length, stride, tail):
        s = start + offset * (end - start)
        e = s + span * (end - s)
        if not start <= s < e <= end:
            continue
        result = realign([(s, e)], start, end, 0.0)
        assert result.source == [(s, e)]
        assert result.clipped == 0 and result.dropped == []
        (ls, le), = result.local
        assert (ls, le) == (s - start, e - start)
        assert math.isclose(ls + start, s, abs_tol=ROUNDTRIP) and math.isclose(le + start, e, abs_tol=ROUNDTRIP)


def test_realign_concrete_cases():
    keep = [(1.0, 3.0), (7.5, 9.0), (9.9, 12.0), (15.0, 15.1), (20.0, 30.0)]
    result = realign(keep, 8.0, 16.0, 0.25)
    # (7.5, 9.0) crosses the start -> (8, 9); (9.9, 12) inside; (15, 15.1) inside but too short;
    # (1, 3) and (20, 30) do not overlap
    assert result.source == [(8.0, 9.0), (9.9, 12.0)]
    assert result.local == [(0.0, 1.0), (9.9 - 8.0, 4.0)]
    assert result.dropped == [(15.0, 15.1)]
    assert result.clipped == 1

    # a range crossing both edges is clipped once, to the whole window
    result = realign([(0.0, 100.0)], 8.0, 16.0, 0.25)
    assert result.source == [(8.0, 16.0)] and result.local == [(0.0, 8.0)] and result.clipped == 1

    # a clipped sliver shorter than min_fragment is dropped and counted as clipped too
    result = realign([(15.9, 20.0)], 8.0, 16.0, 0.25)
    assert result.local == [] and result.clipped == 1
    assert result.dropped == [(15.9, 16.0)]

    # ranges only touching the window edge do not overlap it
    result = realign([(4.0, 8.0), (16.0, 18.0)], 8.0, 16.0, 0.0)
    assert result.local == result.source == result.dropped == [] and result.clipped == 0


@pytest.mark.parametrize(
    "keep, start, end",
    [
        ((0.9, 1.9), 0.2, 2.2),    # window_bounds(2.2, 2.0, 1.0) has the window (0.2, 2.2)
        ((0.7, 1.7), 0.4, 1.9),    # window_bounds(1.9, 1.5, 0.7, "shift") has the window (0.4, 1.9)
        ((1.007812, 5.039062), 1.007812, 9.070312),
    ],
)
def test_realign_roundtrip_exact(keep, start, end):
    """A range inside a window: the source range is kept as given, and local + window start gives
    it back to within float rounding (one ulp; exact equality is not possible in binary floats,
    e.g. (0.9 - 0.2) + 0.2 == 0.8999999999999999)."""
    result = realign([keep], start, end, 0.0)
    assert result.source == [keep]
    (ls, le), = result.local
    assert (ls + start, le + start) == pytest.approx(keep, abs=1e-12, rel=0)


# --------------------------------------------------------------------------------------------
# window_bounds


def _assert_covers(bounds: list, duration: float) -> None:
    assert bounds, "no windows"
    ordered = sorted(bounds)
    assert ordered[0][0] <= EPS
    reach = ordered[0][1]
    for start, end in ordered[1:]:
        assert start <= reach + EPS, f"gap between {reach} and {start}"
        reach = max(reach, end)
    assert reach >= duration - EPS


@PROPERTY
@given(setup=window_setups())
@example(setup=(0.05, 0.05000000000000001, 0.05000000000000001, "drop"))  # one window, within float noise
def test_window_bounds_properties(setup):
    duration, length, stride, tail = setup
    bounds = window_bounds(duration, length, stride, tail)
    for start, end in bounds:
        assert 0.0 <= start < end <= duration, (start, end, duration)
        assert end - start <= length + EPS
    starts = [s for s, _ in bounds]
    assert starts == sorted(starts) and len(set(bounds)) == len(bounds)

    if tail in ("shift", "short"):
        _assert_covers(bounds, duration)
    if duration < length - FITS:  # shorter than one window beyond float noise
        assert bounds == ([] if tail == "drop" else [(0.0, duration)])
        return
    if tail == "shift":
        assert all(math.isclose(e - s, length, rel_tol=1e-9, abs_tol=EPS) for s, e in bounds)
        assert math.isclose(bounds[-1][1], duration, abs_tol=EPS)
    elif tail == "short":
        assert all(math.isclose(e - s, length, rel_tol=1e-9, abs_tol=EPS) for s, e in bounds[:-1])
        assert math.isclose(bounds[-1][1], duration, abs_tol=EPS)
    else:  # drop: only full-length windows, the first at 0
        assert bounds[0][0] == 0.0
        assert all(math.isclose(e - s, length, rel_tol=1e-9, abs_tol=EPS) for s, e in bounds)
        # nothing more fits: the next window would run past the end
        assert bounds[-1][0] + stride + length > duration - EPS
        # windows start every `stride` seconds
        assert all(math.isclose(s, i * stride, abs_tol=EPS) for i, (s, _) in enumerate(bounds))


def test_window_bounds_concrete():
    assert window_bounds(20.0, 8.0, 8.0, "shift") == [(0.0, 8.0), (8.0, 16.0), (12.0, 20.0)]
    assert window_bounds(20.0, 8.0, 8.0, "short") == [(0.0, 8.0), (8.0, 16.0), (16.0, 20.0)]
    assert window_bounds(20.0, 8.0, 8.0, "drop") == [(0.0, 8.0), (8.0, 16.0)]
    # exact multiple: no extra window for any tail
    for tail in ("shift", "short", "drop"):
        assert window_bounds(16.0, 8.0, 8.0, tail) == [(0.0, 8.0), (8.0, 16.0)]
    # overlapping windows
    assert window_bounds(10.0, 4.0, 2.0, "shift") == [(0.0, 4.0), (2.0, 6.0), (4.0, 8.0), (6.0, 10.0)]
    assert window_bounds(11.0, 4.0, 2.0, "short") == [(0.0, 4.0), (2.0, 6.0), (4.0, 8.0), (6.0, 10.0), (8.0, 11.0)]


@pytest.mark.parametrize("tail", ["shift", "short", "drop"])
def test_window_bounds_end_never_past_duration(tail):
    """No window may end after the video (float stepping once gave 29.1 + 0.1 == 29.200000000000003)."""
    bounds = window_bounds(29.2, 0.1, 0.1, tail)
    assert max(end for _, end in bounds) <= 29.2


@pytest.mark.parametrize("tail", ["shift", "short", "drop"])
def test_window_bounds_video_shorter_than_window(tail):
    bounds = window_bounds(3.5, 8.0, 8.0, tail)
    assert bounds == ([] if tail == "drop" else [(0.0, 3.5)])


@pytest.mark.parametrize("duration", [0.0, -1.0, -1e-12, float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("tail", ["shift", "short", "drop"])
def test_window_bounds_bad_duration(duration, tail):
    with pytest.raises(ValueError, match="duration"):
        window_bounds(duration, 8.0, 8.0, tail)


# --------------------------------------------------------------------------------------------
# merge_ranges


def test_merge_ranges_concrete():
    merged, merges = merge_ranges([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (3.0, 4.0), (8.0, 9.0), (5.5, 5.7)])
    # (0,2)+(1,3) overlap, (3,4) touches, (5.5,5.7) inside (5,6)
    assert merged == [(0.0, 4.0), (5.0, 6.0), (8.0, 9.0)]
    assert merges == 3
    assert merge_ranges([]) == ([], 0)
    assert merge_ranges([(1.0, 2.0)]) == ([(1.0, 2.0)], 0)
    assert merge_ranges([(1.0, 2.0), (2.5, 3.0)]) == ([(1.0, 2.0), (2.5, 3.0)], 0)
    assert merge_ranges([(1.0, 2.0), (1.0, 2.0)]) == ([(1.0, 2.0)], 1)


_pairs = st.tuples(st.integers(0, 100), st.integers(1, 30)).map(lambda p: (p[0] / 4, (p[0] + p[1]) / 4))


@PROPERTY
@given(ranges=st.lists(_pairs, max_size=15))
def test_merge_ranges_properties(ranges):
    merged, merges = merge_ranges(ranges)
    # sorted, disjoint and not touching
    for (s1, e1), (s2, e2) in zip(merged, merged[1:]):
        assert e1 < s2
    assert all(s < e for s, e in merged)
    # each merge removes one range
    assert len(merged) + merges == len(ranges)
    # same set of covered points: every input inside one output; every output endpoint from the input
    for s, e in ranges:
        assert any(ms <= s and e <= me for ms, me in merged)
    starts = {s for s, _ in ranges}
    ends = {e for _, e in ranges}
    assert all(ms in starts and me in ends for ms, me in merged)
    # every point of an output range is covered by some input (check on a quarter-grid)
    for ms, me in merged:
        t = ms
        while t < me:
            assert any(s <= t < e for s, e in ranges)
            t += 0.25
    # idempotent and order-independent
    assert merge_ranges(merged) == (merged, 0)
    assert merge_ranges(list(reversed(ranges)))[0] == merged


# --------------------------------------------------------------------------------------------
# assign_splits


_names = st.lists(
    st.text(alphabet="abcdefghij/_.0123456789", min_size=1, max_size=12), min_size=0, max_size=30, unique=True
)


@PROPERTY
@given(
    videos=_names,
    val_fraction=st.sampled_from([0.0, 0.1, 0.34, 0.5, 0.9, 1.0]),
    seed=st.integers(0, 2**31),
    shuffle_seed=st.integers(0, 1000),
)
def test_assign_splits_properties(videos, val_fraction, seed, shuffle_seed):
    splits = assign_splits(videos, val_fraction, seed)
    # every video exactly once, in one of the two splits
    assert set(splits) == set(videos)
    assert set(splits.values()) <= {"train", "val"}
    # independent of the order of the input (and of duplicates)
    shuffled = list(videos) + list(videos[:3])
    random.Random(shuffle_seed).shuffle(shuffled)
    assert assign_splits(shuffled, val_fraction, seed) == splits

    n_val = sum(v == "val" for v in splits.values())
    if val_fraction == 0:
        assert n_val == 0
    elif len(videos) >= 2:
        assert 1 <= n_val <= len(videos) - 1
        assert n_val == min(max(round(val_fraction * len(videos)), 1), len(videos) - 1)


def test_assign_splits_two_videos_both_splits():
    for seed in range(20):
        splits = assign_splits(["a.mp4", "b.mp4"], 0.01, seed)
        assert sorted(splits.values()) == ["train", "val"]
        splits = assign_splits(["a.mp4", "b.mp4"], 1.0, seed)
        assert sorted(splits.values()) == ["train", "val"]


def test_assign_splits_val_fraction_zero_all_train():
    videos = [f"v{i}.mp4" for i in range(10)]
    assert assign_splits(videos, 0.0, 7) == {v: "train" for v in videos}
    assert assign_splits([], 0.5, 0) == {}


def test_assign_splits_seed_matters():
    videos = [f"clips/v{i:03d}.mp4" for i in range(20)]
    results = {tuple(sorted(assign_splits(videos, 0.3, seed).items())) for seed in range(10)}
    assert len(results) > 1
    # but a given seed is deterministic
    assert assign_splits(videos, 0.3, 3) == assign_splits(list(reversed(videos)), 0.3, 3)


# --------------------------------------------------------------------------------------------
# video_shards


def test_shards_keep_a_video_together_and_balance_the_windows():
    rng = np.random.default_rng(0)
    windows = [{"video": f"v{v:03d}.mp4"} for v in range(40) for _ in range(int(rng.integers(1, 30)))]
    assignment = video_shards(windows, 3)
    load = [sum(assignment[w["video"]] == shard for w in windows) for shard in range(3)]
    assert sum(load) == len(windows) and max(load) - min(load) <= 2  # 40 videos of 1-29 windows
    shuffled = [windows[i] for i in rng.permutation(len(windows))]
    assert video_shards(shuffled, 3) == assignment  # every shard process agrees


# --------------------------------------------------------------------------------------------
# resolve_video


def test_resolve_video_nested_relative(tmp_path: Path):
    root = tmp_path / "root"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "clip.mp4").write_bytes(b"")
    assert resolve_video(root, "a/b/clip.mp4") == (root / "a" / "b" / "clip.mp4").resolve()
    # '..' that stays inside the root is fine
    assert resolve_video(root, "a/../a/b/clip.mp4") == (root / "a" / "b" / "clip.mp4").resolve()
    assert resolve_video(root, "clip.mp4") == (root / "clip.mp4").resolve()


@pytest.mark.parametrize("relative", ["../outside.mp4", "a/../../outside.mp4", "a/b/../../../x/clip.mp4", ".."])
def test_resolve_video_rejects_escape(tmp_path: Path, relative: str):
    root = tmp_path / "root"
    (root / "a" / "b").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"data\.root") as info:
        resolve_video(root, relative)
    assert "leaves" in str(info.value) and relative in str(info.value)


def test_resolve_video_rejects_absolute(tmp_path: Path):
    root = tmp_path / "root"
    root.mkdir()
    inside = str((root / "clip.mp4").resolve())  # absolute even when it points inside the root
    for path in (inside, "/etc/passwd"):
        with pytest.raises(ValueError, match=r"absolute.*data\.root"):
            resolve_video(root, path)


# --------------------------------------------------------------------------------------------
# parse_annotation


def test_parse_annotation_valid():
    row = parse_annotation('{"video": "a/b.mp4", "query": "the dog jumps", "keep": [[0, 1.5], [2.25, 4]]}', DATA)
    assert row == {"video": "a/b.mp4", "query": "the dog jumps", "id": None, "duration": None,
                   "keep": [(0.0, 1.5), (2.25, 4.0)], "source": "a/b.mp4"}
    assert all(isinstance(v, float) for pair in row["keep"] for v in pair)
    # query and keep are optional; without "source" the video is its own source
    assert parse_annotation('{"video": "x.mp4"}', DATA) == {"video": "x.mp4", "query": None, "id": None,
                                                           "duration": None, "keep": [], "source": "x.mp4"}
    assert parse_annotation('{"video": "x.mp4", "keep": []}', DATA)["keep"] == []


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"video": "a.mp4", "keep": [[0, 1]', "not valid JSON"),
        ("not json at all", "not valid JSON"),
        ("", "not valid JSON"),
        ('{"keep": [[0, 1]]}', '"video"'),
        ('{"video": 3, "keep": [[0, 1]]}', '"video"'),
        ('["a.mp4"]', '"video"'),
        ('{"video": "a.mp4", "keep": "0-1"}', '"keep" must be a list'),
        ('{"video": "a.mp4", "keep": {"0": 1}}', '"keep" must be a list'),
        ('{"video": "a.mp4", "keep": [[0, 1, 2]]}', "not a \\[start, end\\] pair"),
        ('{"video": "a.mp4", "keep": [[0]]}', "not a \\[start, end\\] pair"),
        ('{"video": "a.mp4", "keep": [["0", 1]]}', "not a \\[start, end\\] pair"),
        ('{"video": "a.mp4", "keep": [[0, null]]}', "not a \\[start, end\\] pair"),
        ('{"video": "a.mp4", "keep": [0, 1]}', "not a \\[start, end\\] pair"),
        ('{"video": "a.mp4", "keep": [{"start": 0, "end": 1}]}', "not a \\[start, end\\] pair"),
        ('{"video": "a.mp4", "keep": [[2, 1]]}', "start >= end"),
        ('{"video": "a.mp4", "keep": [[1, 1]]}', "start >= end"),
        ('{"video": "a.mp4", "keep": [[-0.5, 1]]}', "starts before 0"),
        ('{"video": "a.mp4", "keep": [[NaN, 1]]}', "non-finite"),
        ('{"video": "a.mp4", "keep": [[0, NaN]]}', "non-finite"),
        ('{"video": "a.mp4", "keep": [[0, Infinity]]}', "non-finite"),
        ('{"video": "a.mp4", "keep": [[-Infinity, 1]]}', "non-finite"),
        ('{"video": "a.mp4", "keep": [[0, 1e999]]}', "non-finite"),
        ('{"video": "a.mp4", "query": 5}', '"query" must be a string'),
        ('{"video": "a.mp4", "source": 5}', '"source" 5 must be a non-empty string'),
        ('{"video": "a.mp4", "source": ""}', '"source" \'\' must be a non-empty string'),
        ('{"video": "a.mp4", "source": null}', '"source" None must be a non-empty string'),
    ],
)
def test_parse_annotation_rejects(line, message):
    with pytest.raises(ValueError, match=message):
        parse_annotation(line, DATA)


def test_parse_annotation_error_names_the_pair():
    with pytest.raises(ValueError) as info:
        parse_annotation('{"video": "a.mp4", "keep": [[0, 1], [5, 3]]}', DATA)
    assert "[5, 3]" in str(info.value)
    with pytest.raises(ValueError) as info:
        parse_annotation('{"video": "a.mp4", "keep": [[0, 1]', DATA)
    assert "column" in str(info.value)


def test_parse_annotation_rejects_booleans_as_times():
    """JSON true/false are not numbers; bool is an int subclass in Python, so it must be excluded."""
    with pytest.raises(ValueError, match="not a \\[start, end\\] pair"):
        parse_annotation('{"video": "a.mp4", "keep": [[false, true]]}', DATA)


def test_parse_annotation_huge_integer_is_a_value_error():
    """A time too large for a float is bad input: ValueError, like the other bad times."""
    with pytest.raises(ValueError):
        parse_annotation('{"video": "a.mp4", "keep": [[0, 1' + "0" * 400 + "]]}", DATA)


@PROPERTY
@given(
    keep=st.lists(
        st.tuples(st.floats(0, 1e6), st.floats(1e-3, 1e3)).map(lambda p: [p[0], p[0] + p[1]]), max_size=6
    ),
    video=st.text(min_size=1, max_size=20),
)
def test_parse_annotation_roundtrip(keep, video):
    keep = [pair for pair in keep if pair[0] < pair[1]]
    row = parse_annotation(json.dumps({"video": video, "keep": keep}), DATA)
    assert row["video"] == video and row["query"] is None
    assert row["keep"] == [tuple(pair) for pair in keep]


# --------------------------------------------------------------------------------------------
# the split's source: a recording's clips go to one split


@pytest.mark.parametrize("vid, youtube_id", [
    ("-4Mlqc7PbZY_210.0_360.0", "-4Mlqc7PbZY"),
    ("2vFzBa_WKNg_60.0_210.0", "2vFzBa_WKNg"),  # "_" inside the id
    ("-_s0sXOfS3w_510.0_660.0", "-_s0sXOfS3w"),  # "-" and "_" inside the id
    ("0_eIFN2FDoU_360.0_510.0", "0_eIFN2FDoU"),
    ("ab_12_34_xyz_0_150", "ab_12_34_xyz"),  # only the last two fields are the clip's times
    ("a_1_2_30_180", "a_1_2"),
])
def test_qvhighlights_source_takes_the_clip_times_off_the_end(vid, youtube_id):
    assert qvhighlights_source(vid) == youtube_id
    line = json.dumps({"vid": vid, "qid": 1, "query": "q", "relevant_windows": [[0, 2]]})
    assert parse_annotation(line, QVH_DATA)["source"] == youtube_id
    # a "source" on the line wins (a user's own clips in the QVHighlights format)
    line = json.dumps({"vid": vid, "qid": 1, "query": "q", "relevant_windows": [[0, 2]], "source": "rec"})
    assert parse_annotation(line, QVH_DATA)["source"] == "rec"


@pytest.mark.parametrize("vid", ["-4Mlqc7PbZY", "clip_1.0", "_1_2", "abc_1.0_x", "abc_1.0_2.0.mp4", "a_-1_2"])
def test_a_qvhighlights_vid_without_clip_times_is_rejected_with_the_fix(vid):
    with pytest.raises(Rejected, match='<youtube id>_<start>_<end>.*add a "source" field') as info:
        parse_annotation(json.dumps({"vid": vid, "query": "q", "relevant_windows": []}), QVH_DATA)
    assert info.value.code == "bad_fields" and repr(vid) in str(info.value)
    # ... and accepted when the line names its source
    line = json.dumps({"vid": vid, "query": "q", "relevant_windows": [], "source": "rec"})
    assert parse_annotation(line, QVH_DATA)["source"] == "rec"


QVHIGHLIGHTS = Path(__file__).resolve().parents[3] / "shared" / "data" / "qvhighlights" / "highlight_val_release.jsonl"


@pytest.mark.skipif(not QVHIGHLIGHTS.exists(), reason="shared QVHighlights annotations not present")
def test_every_shipped_qvhighlights_clip_has_an_11_character_youtube_id():
    vids = {json.loads(line)["vid"] for line in QVHIGHLIGHTS.read_text().splitlines()}
    sources = {qvhighlights_source(vid) for vid in vids}
    assert all(len(source) == 11 for source in sources), sorted(s for s in sources if len(s) != 11)[:5]
    assert len(vids) == 1519 and len(sources) == 474
    assert any("_" in s for s in sources) and any(s.startswith("-") for s in sources)


def _rows(*placed):
    return [{"video": video, "split": split} for video, split in placed]


def test_check_sources_whole_passes_a_grouped_split():
    source_of = {"a1.mp4": "a", "a2.mp4": "a", "b1.mp4": "b"}
    check_sources_whole(_rows(("a1.mp4", "train"), ("a2.mp4", "train"), ("a1.mp4", "train"), ("b1.mp4", "val")),
                        source_of)
    check_sources_whole([], {})


def test_check_sources_whole_fails_on_a_source_in_both_splits():
    # the split by clip that the window stage used to make: two clips of one recording, one per side
    source_of = {"-4Mlqc7PbZY_60.0_210.0.mp4": "-4Mlqc7PbZY", "-4Mlqc7PbZY_210.0_360.0.mp4": "-4Mlqc7PbZY",
                 "b.mp4": "b"}
    rows = _rows(("-4Mlqc7PbZY_60.0_210.0.mp4", "train"), ("-4Mlqc7PbZY_210.0_360.0.mp4", "val"), ("b.mp4", "val"))
    with pytest.raises(AssertionError, match=r"1 source videos have windows in more than one split.*'-4Mlqc7PbZY' "
                                             r"\(train: \['-4Mlqc7PbZY_60.0_210.0.mp4'\], val: "):
        check_sources_whole(rows, source_of)


def test_check_sources_whole_fails_on_one_video_in_both_splits():
    with pytest.raises(AssertionError, match=r"'v' \(train: \['v.mp4'\], val: \['v.mp4'\]\)"):
        check_sources_whole(_rows(("v.mp4", "train"), ("v.mp4", "val")), {"v.mp4": "v"})


@PROPERTY
@given(sources=st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=30), seed=st.integers(0, 2**31),
       val_fraction=st.sampled_from([0.0, 0.34, 0.5, 1.0]))
def test_splitting_by_source_keeps_every_source_whole(sources, seed, val_fraction):
    source_of = {f"{source}_{i}.mp4": source for i, source in enumerate(sources)}
    splits = assign_splits(list(source_of.values()), val_fraction, seed)
    check_sources_whole([{"video": video, "split": splits[source]} for video, source in source_of.items()], source_of)

