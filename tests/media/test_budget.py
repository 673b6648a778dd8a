"""Unit tests of videosft.media.budget, with a differential check against qwen-vl-utils."""

from __future__ import annotations

import math

import numpy as np
import pytest
from qwen_vl_utils import vision_process as qv

from videosft import config as config_lib
from videosft.media import budget as B
from videosft.media.budget import Budget, frame_count, frame_size, pixel_bounds, plan, resolve_budget

CASES = 1500  # per patch size, per differential test


def make_budget(fps=2.0, min_frames=4, max_frames=768, min_tokens=128, max_tokens=768) -> Budget:
    return Budget(fps=fps, min_frames=min_frames, max_frames=max_frames, min_tokens=min_tokens,
                  max_tokens=max_tokens, min_tokens_from="test", max_tokens_from="test")


def reference_pixel_bounds(min_tokens: int, max_tokens: int, factor: int, nframes: int, total_pixels=None):
    """What qwen-vl-utils' fetch_video computes; ``total_pixels=None`` means no total cap."""
    min_pixels = min_tokens * factor**2
    cap = math.inf if total_pixels is None else total_pixels / nframes * qv.FRAME_FACTOR
    max_pixels = max(min(max_tokens * factor**2, cap), int(min_pixels * 1.05))
    return min_pixels, max_pixels


def _outcome(fn, *args, **kwargs):
    try:
        return "ok", fn(*args, **kwargs)
    except ValueError:
        return "ValueError", None


def test_constants_match_qwen_vl_utils():
    assert B.FRAME_FACTOR == qv.FRAME_FACTOR
    assert B.MAX_ASPECT_RATIO == qv.MAX_RATIO
    assert B.ENV_MIN_TOKENS == "VIDEO_MIN_TOKEN_NUM" and B.ENV_MAX_TOKENS == "VIDEO_MAX_TOKEN_NUM"


# --------------------------------------------------------------------------------------------
# differential: frame_count vs smart_nframes


@pytest.mark.parametrize("seed", [0, 1])
def test_frame_count_matches_smart_nframes(seed):
    rng = np.random.default_rng(seed)
    raised = agreed = 0
    for _ in range(CASES):
        total_frames = int(rng.choice([rng.integers(0, 8), rng.integers(0, 400), rng.integers(0, 20000)]))
        video_fps = float(rng.choice([23.976, 24.0, 25.0, 29.97, 30.0, 50.0, 60.0, rng.uniform(0.5, 240.0)]))
        fps = float(rng.choice([0.5, 1.0, 2.0, 4.0, rng.uniform(0.05, 10.0)]))
        min_frames = int(rng.integers(1, 40))
        max_frames = int(rng.choice([rng.integers(1, 64), rng.integers(1, 1000)]))
        budget = make_budget(fps=fps, min_frames=min_frames, max_frames=max_frames)
        ours = _outcome(frame_count, total_frames, video_fps, budget)
        theirs = _outcome(qv.smart_nframes, {"fps": fps, "min_frames": min_frames, "max_frames": max_frames},
                          total_frames=total_frames, video_fps=video_fps)
        case = (total_frames, video_fps, fps, min_frames, max_frames)
        assert ours == theirs, case
        if ours[0] == "ok":
            agreed += 1
            n = ours[1]
            assert isinstance(n, int) and n % 2 == 0 and 2 <= n <= total_frames, case
        else:
            raised += 1
    # both branches were exercised
    assert raised > 50 and agreed > 500


@pytest.mark.parametrize("total_frames", [0, 1])
def test_frame_count_too_few_frames_raises(total_frames):
    with pytest.raises(ValueError, match="at least 2"):
        frame_count(total_frames, 30.0, make_budget())
    with pytest.raises(ValueError):
        qv.smart_nframes({"fps": 2.0, "min_frames": 4, "max_frames": 768}, total_frames=total_frames, video_fps=30.0)


def test_frame_count_concrete():
    # 8 s at 30 fps sampled at 2 fps: 16 frames
    assert frame_count(240, 30.0, make_budget(fps=2.0, min_frames=4, max_frames=768)) == 16
    # capped by max_frames (rounded down to even)
    assert frame_count(240, 30.0, make_budget(fps=2.0, min_frames=4, max_frames=11)) == 10
    # raised to min_frames (rounded up to even) for a short clip
    assert frame_count(30, 30.0, make_budget(fps=2.0, min_frames=7, max_frames=768)) == 8
    # never more than the clip has, and even
    assert frame_count(5, 30.0, make_budget(fps=2.0, min_frames=16, max_frames=768)) == 4


# --------------------------------------------------------------------------------------------
# differential: pixel_bounds + frame_size vs fetch_video's bounds + smart_resize


def _random_frame(rng) -> tuple[int, int]:
    """Height, width in 16..4000, mostly ordinary aspect ratios, some beyond 200 (both must raise)."""
    kind = rng.random()
    if kind < 0.1:
        return tuple(int(v) for v in rng.choice([(2160, 3840), (1080, 1920), (720, 1280), (480, 640), (16, 16)]))
    if kind < 0.9:
        h = int(np.exp(rng.uniform(np.log(16), np.log(4000))))
        ratio = float(np.exp(rng.uniform(-np.log(20), np.log(20))))
    else:
        h = int(rng.integers(16, 40))
        ratio = float(rng.uniform(150, 260))
    w = int(min(max(round(h * ratio), 16), 4000))
    return (h, w) if rng.random() < 0.5 else (w, h)


@pytest.mark.parametrize("patch", [14, 16])
def test_frame_size_and_pixel_bounds_match_qwen(patch):
    factor = patch * 2  # patch size x spatial merge
    rng = np.random.default_rng(patch)
    outcomes = {"ok": 0, "ValueError": 0}
    for _ in range(CASES):
        h, w = _random_frame(rng)
        min_tokens = int(rng.choice([qv.VIDEO_MIN_TOKEN_NUM, rng.integers(1, 64), rng.integers(1, 1024)]))
        max_tokens = int(rng.choice([qv.VIDEO_MAX_TOKEN_NUM, min_tokens, min_tokens + rng.integers(0, 4096)]))
        nframes = int(rng.integers(1, 385)) * 2
        total_pixels = None if rng.random() < 0.6 else float(rng.uniform(1e5, 128000 * factor**2 * 0.9))
        budget = make_budget(min_tokens=min_tokens, max_tokens=max_tokens)

        bounds = pixel_bounds(budget, factor, nframes, total_pixels)
        expected = reference_pixel_bounds(min_tokens, max_tokens, factor, nframes, total_pixels)
        case = (h, w, factor, min_tokens, max_tokens, nframes, total_pixels)
        assert bounds == expected, case
        low, high = bounds
        assert high >= low

        ours = _outcome(frame_size, h, w, factor, low, high)
        theirs = _outcome(qv.smart_resize, h, w, factor=factor, min_pixels=low, max_pixels=high)
        if theirs[0] == "ok" and min(theirs[1]) == 0:
            # qwen-vl-utils floors a thin frame's short side to 0; ours keeps one patch there
            theirs = ("ok", (max(factor, theirs[1][0]), max(factor, theirs[1][1])))
        assert ours == theirs, case
        outcomes[ours[0]] += 1
        if ours[0] == "ok":
            out_h, out_w = ours[1]
            assert out_h % factor == 0 and out_w % factor == 0, case
            # (a side may come out 0 for long thin frames on a small budget, in both
            # implementations: test_frame_size_never_below_factor pins that)
        else:
            assert max(h, w) / min(h, w) > B.MAX_ASPECT_RATIO, case
    assert outcomes["ok"] > CASES * 0.8 and outcomes["ValueError"] > 10


@pytest.mark.parametrize("patch", [14, 16])
def test_pixel_bounds_defaults_equal_fetch_video(patch):
    """With qwen-vl-utils' default token numbers and its default total_pixels, the same bounds."""
    factor = patch * 2
    budget = make_budget(min_tokens=qv.VIDEO_MIN_TOKEN_NUM, max_tokens=qv.VIDEO_MAX_TOKEN_NUM)
    default_total = qv.MODEL_SEQ_LEN * factor * factor * 0.9
    for nframes in (2, 16, 64, 300, 768):
        assert pixel_bounds(budget, factor, nframes, default_total) == reference_pixel_bounds(
            qv.VIDEO_MIN_TOKEN_NUM, qv.VIDEO_MAX_TOKEN_NUM, factor, nframes, default_total)
        # without a total cap: the plain token bounds
        assert pixel_bounds(budget, factor, nframes) == (128 * factor**2, 768 * factor**2)


def test_pixel_bounds_max_never_below_min():
    # min == max tokens: max is lifted to int(1.05 * min_pixels)
    assert pixel_bounds(make_budget(min_tokens=100, max_tokens=100), 28, 16) == (78400, 82320)
    # a tight total cap is overruled by the floor as well
    assert pixel_bounds(make_budget(min_tokens=100, max_tokens=1000), 28, 768, total_pixels=1000.0) == (78400, 82320)


@pytest.mark.parametrize("patch", [14, 16])
@pytest.mark.parametrize("height, width, tokens", [(32, 4000, 59), (4000, 32, 59), (100, 3000, 20)])
def test_frame_size_never_below_factor(patch, height, width, tokens):
    """A thin frame (aspect < 200) on a small budget must not come out with a 0-pixel side:
    transformers' Qwen2-VL smart_resize floors each side at ``factor`` (max(factor, floor(...))),
    and a 0 side gives an empty grid. (qwen-vl-utils' smart_resize has the same 0 result.)"""
    factor = patch * 2
    assert max(height, width) / min(height, width) < B.MAX_ASPECT_RATIO
    low, high = pixel_bounds(make_budget(min_tokens=tokens, max_tokens=tokens), factor, 16)
    out_h, out_w = frame_size(height, width, factor, low, high)
    assert out_h >= factor and out_w >= factor, (out_h, out_w)


@pytest.mark.parametrize("shape", [(1, 300), (300, 1), (16, 3300), (4000, 19)])
def test_frame_size_rejects_extreme_aspect(shape):
    with pytest.raises(ValueError, match="aspect ratio"):
        frame_size(*shape, 28, 28 * 28, 768 * 28 * 28)


# --------------------------------------------------------------------------------------------
# plan


@pytest.mark.parametrize("patch", [14, 16])
@pytest.mark.parametrize(
    "height, width, min_tokens, max_tokens",
    [
        (2160, 3840, 4, 196),   # 4K, heavily downscaled
        (1080, 1920, 16, 256),
        (720, 1280, 64, 768),
        (480, 640, 4, 16),      # the demo config's budget
        (64, 64, 128, 768),     # tiny source, upscaled to the minimum
        (1920, 1080, 32, 300),  # portrait
        (360, 360, 100, 400),
    ],
)
def test_plan_grid_and_tokens(patch, height, width, min_tokens, max_tokens):
    merge, temporal = 2, 2
    factor = patch * merge
    budget = make_budget(fps=2.0, min_frames=4, max_frames=32, min_tokens=min_tokens, max_tokens=max_tokens)
    result = plan(240, 30.0, height, width, budget, patch, merge, temporal)

    assert result.frames == frame_count(240, 30.0, budget) == 16
    assert result.height % factor == 0 and result.width % factor == 0
    assert result.grid == (result.frames // temporal, result.height // patch, result.width // patch)
    t, gh, gw = result.grid
    assert result.visual_tokens == t * gh * gw // merge**2
    assert (t * gh * gw) % merge**2 == 0
    per_pair = (result.height // factor) * (result.width // factor)
    assert result.visual_tokens == t * per_pair
    assert min_tokens <= per_pair <= max_tokens, (per_pair, result)
    # same answer as qwen-vl-utils would give
    low, high = reference_pixel_bounds(min_tokens, max_tokens, factor, result.frames)
    assert (result.height, result.width) == qv.smart_resize(height, width, factor=factor,
                                                            min_pixels=low, max_pixels=high)


def test_plan_4k_max_196_tokens():
    budget = make_budget(fps=2.0, min_frames=4, max_frames=768, min_tokens=4, max_tokens=196)
    result = plan(240, 30.0, 2160, 3840, budget, patch_size=14, merge_size=2, temporal_patch_size=2)
    assert (result.height, result.width) == (280, 504)
    assert result.grid == (8, 20, 36)
    assert result.visual_tokens == 8 * 180
    assert result.visual_tokens // result.grid[0] <= 196
    # aspect ratio roughly kept
    assert abs(result.width / result.height - 3840 / 2160) < 0.05


def test_plan_odd_frames_per_temporal_patch():
    # temporal patch 2 and even frame counts: the grid's t is frames / 2
    budget = make_budget(fps=1.0, min_frames=1, max_frames=9)
    result = plan(100, 10.0, 448, 448, budget, 14, 2, 2)
    assert result.frames == 8 and result.grid[0] == 4


def test_plan_too_short_clip_raises():
    with pytest.raises(ValueError):
        plan(1, 30.0, 480, 640, make_budget(), 14, 2, 2)


# --------------------------------------------------------------------------------------------
# resolve_budget

VIDEO_CFG = config_lib.section("video", {"fps": 2, "min_frames": 4, "max_frames": 16, "min_tokens": 4, "max_tokens": 16})


def test_resolve_budget_from_config():
    budget = resolve_budget(VIDEO_CFG, environ={})
    assert budget == Budget(fps=2.0, min_frames=4, max_frames=16, min_tokens=4, max_tokens=16,
                            min_tokens_from="config video.min_tokens", max_tokens_from="config video.max_tokens")
    assert isinstance(budget.fps, float)
    # empty strings count as unset
    assert resolve_budget(VIDEO_CFG, environ={"VIDEO_MIN_TOKEN_NUM": "", "VIDEO_MAX_TOKEN_NUM": ""}) == budget
    assert budget.as_dict()["max_tokens_from"] == "config video.max_tokens"


def test_resolve_budget_env_overrides():
    budget = resolve_budget(VIDEO_CFG, environ={"VIDEO_MIN_TOKEN_NUM": "8", "VIDEO_MAX_TOKEN_NUM": "768"})
    assert (budget.min_tokens, budget.max_tokens) == (8, 768)
    assert "VIDEO_MIN_TOKEN_NUM" in budget.min_tokens_from and "environment" in budget.min_tokens_from
    assert "VIDEO_MAX_TOKEN_NUM" in budget.max_tokens_from and "environment" in budget.max_tokens_from

    only_max = resolve_budget(VIDEO_CFG, environ={"VIDEO_MAX_TOKEN_NUM": "32"})
    assert (only_max.min_tokens, only_max.max_tokens) == (4, 32)
    assert only_max.min_tokens_from == "config video.min_tokens"
    assert "VIDEO_MAX_TOKEN_NUM" in only_max.max_tokens_from

    only_min = resolve_budget(VIDEO_CFG, environ={"VIDEO_MIN_TOKEN_NUM": "16"})
    assert (only_min.min_tokens, only_min.max_tokens) == (16, 16)
    assert "VIDEO_MIN_TOKEN_NUM" in only_min.min_tokens_from
    assert only_min.max_tokens_from == "config video.max_tokens"


def test_resolve_budget_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("VIDEO_MAX_TOKEN_NUM", "40")
    monkeypatch.delenv("VIDEO_MIN_TOKEN_NUM", raising=False)
    budget = resolve_budget(VIDEO_CFG)
    assert budget.max_tokens == 40 and "VIDEO_MAX_TOKEN_NUM" in budget.max_tokens_from


@pytest.mark.parametrize("variable", ["VIDEO_MIN_TOKEN_NUM", "VIDEO_MAX_TOKEN_NUM"])
@pytest.mark.parametrize("raw", ["abc", "1.5", "12k", "0x10"])
def test_resolve_budget_env_not_integer(variable, raw):
    with pytest.raises(ValueError, match=variable) as info:
        resolve_budget(VIDEO_CFG, environ={variable: raw})
    assert "integer" in str(info.value) and raw in str(info.value)


@pytest.mark.parametrize("variable", ["VIDEO_MIN_TOKEN_NUM", "VIDEO_MAX_TOKEN_NUM"])
@pytest.mark.parametrize("raw", ["0", "-3"])
def test_resolve_budget_env_below_one(variable, raw):
    with pytest.raises(ValueError, match=variable) as info:
        resolve_budget(VIDEO_CFG, environ={variable: raw})
    assert "at least 1" in str(info.value)


@pytest.mark.parametrize(
    "environ, named",
    [
        ({"VIDEO_MIN_TOKEN_NUM": "100", "VIDEO_MAX_TOKEN_NUM": "50"}, ["VIDEO_MIN_TOKEN_NUM", "VIDEO_MAX_TOKEN_NUM"]),
        ({"VIDEO_MIN_TOKEN_NUM": "17"}, ["VIDEO_MIN_TOKEN_NUM", "video.max_tokens"]),
        ({"VIDEO_MAX_TOKEN_NUM": "3"}, ["video.min_tokens", "VIDEO_MAX_TOKEN_NUM"]),
    ],
)
def test_resolve_budget_min_above_max(environ, named):
    with pytest.raises(ValueError, match="exceeds") as info:
        resolve_budget(VIDEO_CFG, environ=environ)
    for name in named:
        assert name in str(info.value)


def test_resolve_budget_config_min_frames_above_max():
    with pytest.raises(ValueError, match="min_frames"):
        resolve_budget(VIDEO_CFG.replace(min_frames=20), environ={})
