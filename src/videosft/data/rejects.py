"""Rejected items: one JSONL line each, with a stable code and its reason in words, counted per kind,
and a stage failure past a set fraction.

A check that rejects an item raises :class:`videosft.errors.Rejected` with one of
:data:`videosft.errors.REASONS`' codes; the code is what scripts and the report count by, the reason
what a person reads, and the message says which item, what is wrong with it and what to do. Any other exception an item raises is kept too, as
``unexpected`` with its class name: one bad sample never loses the others.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

from ..errors import REASONS, Rejected, UserError

class TooManyRejects(UserError, RuntimeError):
    pass


class Rejects:
    """Collects bad items so that one bad sample never loses the others.

    Each item lands in ``path`` as ``{"where": ..., "code": ..., "reason": ..., "error": ..., **extra}``,
    appended as it is rejected, so the file is complete even if the stage dies later. ``kept``: a copy
    beside the stage's log (:func:`videosft.provenance.kept_path`), which outlives a failed job's outputs
    (Snakemake removes them): the messages point there.
    """

    def __init__(self, path: Path, kept: Path | None = None):
        self.path = Path(path)
        self.kept = Path(kept) if kept else None
        self.items: list[dict] = []
        self.lock = threading.Lock()
        for file in self.files:
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text("")

    @property
    def files(self) -> list[Path]:
        return [self.path] + ([self.kept] if self.kept else [])

    @property
    def shown(self) -> Path:
        """The file the messages name: the one that is still there after a failure."""
        return self.kept or self.path

    @classmethod
    def merged(cls, path: Path, sources: list[Path], kept: Path | None = None) -> "Rejects":
        """One list from several stages' (or shards') rejects files, written to ``path`` (and ``kept``)."""
        rejects = cls(path, kept)
        rejects.items = [item for source in sources for item in read_rejects(source)]
        for file in rejects.files:
            file.write_text("".join(json.dumps(item, default=str) + "\n" for item in rejects.items))
        return rejects

    def add(self, where: str, error: BaseException | str, code: str | None = None, **extra) -> None:
        """One rejected item: ``error`` a :class:`Rejected` (its code), another exception (``unexpected``), or a
        message with its ``code``."""
        if isinstance(error, Rejected):
            code = error.code
        elif isinstance(error, BaseException):
            code = "unexpected"
            error = f"{type(error).__name__}: {error}"
        code = code or "unexpected"
        item = {"where": where, "code": code, "reason": REASONS[code], "error": str(error), **extra}
        with self.lock:  # predict prepares the next video on a thread while it answers this one
            self.items.append(item)
            for file in self.files:
                with open(file, "a") as handle:
                    handle.write(json.dumps(item, default=str) + "\n")
            print(f"rejected {where} ({REASONS[code]}): {error}", flush=True)

    def __len__(self) -> int:
        return len(self.items)

    def summary(self) -> dict:
        return {"count": len(self.items), "by_reason": dict(Counter(item["reason"] for item in self.items)),
                "by_code": dict(Counter(item["code"] for item in self.items))}

    def check(self, max_fraction: float, total: int, what: str) -> None:
        """Fail when more than ``max_fraction`` of ``total`` items were rejected."""
        if total and len(self.items) / total > max_fraction:
            listing = "\n".join(f"  {item['where']}: {item['error']}" for item in self.items[:20])
            more = f"\n  ... and {len(self.items) - 20} more" if len(self.items) > 20 else ""
            raise TooManyRejects(
                f"{len(self.items)} of {total} {what} rejected (limit data.max_reject_fraction="
                f"{max_fraction}); see {self.shown}:\n{listing}{more}\n"
                "Fix or remove these items, or raise data.max_reject_fraction to go on without them."
            )


def read_rejects(path: Path) -> list[dict]:
    """The items of a rejects file in the order they were rejected: ``where``, ``code``, ``reason`` (its
    words), ``error`` (the message) and what the stage added; an empty file rejected nothing."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
