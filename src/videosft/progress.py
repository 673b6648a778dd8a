"""Progress lines for logs people watch: counts, rate and time left, at a bounded rate.

A stage that works through thousands of windows or steps must neither stay silent until it ends
nor write a line per item: :class:`ProgressLine` prints the first item (so a start shows at
once), then at most one line every ``every`` seconds, and the last item.
"""

from __future__ import annotations

import time
from typing import Callable


def duration(seconds: float) -> str:
    """'42 s', '3 min 05 s', '2 h 07 min'."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class ProgressLine:
    """``what`` done of ``total`` ``unit``: a line at the first item, then at most every ``every``
    seconds, and at the last; rate and time left are measured from the first item on."""

    def __init__(self, what: str, total: int, unit: str, every: float = 30.0,  # README: "one every 30 s"
                 clock: Callable[[], float] = time.monotonic, write: Callable[[str], None] | None = None):
        self.what, self.total, self.unit, self.every, self.clock = what, total, unit, every, clock
        self.write = write or (lambda line: print(line, flush=True))
        self.done, self.started, self.last_line = 0, None, None

    def advance(self, count: int = 1, note: str = "") -> None:
        """``count`` more items done; ``note`` (e.g. the loss) goes at the end of a printed line."""
        now = self.clock()
        if self.started is None:
            self.started = now
        self.done += count
        if self.last_line is None or self.done >= self.total or now - self.last_line >= self.every:
            self.last_line = now
            self.write(self.line(now, note))

    def line(self, now: float, note: str = "") -> str:
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        text = f"{self.what}: {self.done}/{self.total} {self.unit}{share}"
        elapsed = now - self.started
        if self.done > 1 and elapsed > 0:  # the first item carries start-up costs: rate from the second on
            rate = (self.done - 1) / elapsed
            text += f", {rate:.3g} {self.unit}/s"
            if self.done < self.total:
                text += f", {duration((self.total - self.done) / rate)} left"
        return text + (f"; {note}" if note else "")
