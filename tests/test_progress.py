"""Progress lines: the first and last item always, otherwise at most one line per interval, with rate and time left."""

from __future__ import annotations

from videosft.progress import ProgressLine, duration


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_lines_come_at_a_bounded_rate_with_the_first_and_last_item():
    clock, lines = Clock(), []
    shown = ProgressLine("preprocess shard 0/2", 1000, "windows", every=30, clock=clock, write=lines.append)
    for _ in range(1000):
        shown.advance(note="0 rejected")
        clock.now += 0.5  # 2 windows/s: 500 s in all
    # the first window, one line per 30 s (every 60 windows), and the last
    assert len(lines) == 1 + 999 // 60 + 1 == 18
    assert lines[0] == "preprocess shard 0/2: 1/1000 windows (0%); 0 rejected"
    assert lines[1] == "preprocess shard 0/2: 61/1000 windows (6%), 2 windows/s, 7 min 50 s left; 0 rejected"
    assert lines[-1] == "preprocess shard 0/2: 1000/1000 windows (100%), 2 windows/s; 0 rejected"


def test_items_done_together_count_and_a_short_run_shows_every_end():
    clock, lines = Clock(), []
    shown = ProgressLine("train", 4, "steps", every=30, clock=clock, write=lines.append)
    shown.advance(note="step 0: loss 1")
    clock.now += 1
    shown.advance(3, note="step 3: loss 0.5")
    assert lines == ["train: 1/4 steps (25%); step 0: loss 1", "train: 4/4 steps (100%), 3 steps/s; step 3: loss 0.5"]


def test_durations_read_as_people_say_them():
    assert [duration(s) for s in (0.4, 42, 185, 7620)] == ["0 s", "42 s", "3 min 05 s", "2 h 07 min"]
