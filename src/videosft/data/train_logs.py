"""The train stage's per-rank logs: what each step did (``steps.rank<r>.jsonl``) and which samples each
rank read (``ledger.rank<r>.jsonl``), their writer and their readers.

The train stage appends one line per step and per sample read; after training it proves from the
ledgers that every sample was read (:func:`videosft.training.sampling.check_ledgers`), and the
report draws loss and memory per rank from the step logs. Both read them here, so the writer and
the readers agree on names and fields. Every rank also writes TensorBoard event files of its
steps (``tensorboard --logdir results/train/tensorboard``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TENSORBOARD = "tensorboard"  # results/train/tensorboard/rank<r>
STEPS = "steps.rank{rank}.jsonl"
LEDGER = "ledger.rank{rank}.jsonl"
SCALARS = ("loss", "lr", "grad_norm", "tokens_per_second")  # TensorBoard's train/ group; peaks go to memory/


def steps_path(out: Path, rank: int) -> Path:
    return Path(out) / STEPS.format(rank=rank)


def ledger_path(out: Path, rank: int) -> Path:
    return Path(out) / LEDGER.format(rank=rank)


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def read_steps(out: Path) -> dict[int, list[dict]]:
    """Rank -> its step entries, for every rank that wrote a step log in ``out``."""
    logs = {}
    for path in sorted(Path(out).glob(STEPS.format(rank="*"))):
        rank = path.name[len("steps.rank"):-len(".jsonl")]
        if rank.isdigit():
            logs[int(rank)] = [entry for entry in _read(path) if "step" in entry]
    return dict(sorted(logs.items()))


def read_ledger(out: Path, rank: int) -> list[dict]:
    """Every sample ``rank`` read, in order: epoch, step, position in the epoch's order, window id."""
    return _read(ledger_path(out, rank))


def clear(out: Path) -> None:
    """A fresh run's start: an earlier run's logs, ledgers and event files would mislead."""
    for stale in Path(out).glob("*.rank*.jsonl"):
        stale.unlink()
    shutil.rmtree(Path(out) / TENSORBOARD, ignore_errors=True)


def trim(out: Path, rank: int, first_step: int) -> None:
    """On resume, forget log and ledger lines of steps from ``first_step`` on (they will run again)."""
    for path in (steps_path(out, rank), ledger_path(out, rank)):
        if path.exists():
            kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] < first_step]
            path.write_text("".join(line + "\n" for line in kept))


class RankLogs:
    """One rank's step log, ledger and TensorBoard events, appended as training goes."""

    def __init__(self, out: Path, rank: int, first_step: int):
        from tensorboardX import SummaryWriter

        self.steps = open(steps_path(out, rank), "a")
        self.ledger = open(ledger_path(out, rank), "a")
        # on resume, purge_step hides the earlier run's points from the checkpoint's step on (they run again)
        self.board = SummaryWriter(str(Path(out) / TENSORBOARD / f"rank{rank}"), purge_step=first_step or None,
                                   flush_secs=10)

    def read(self, epoch: int, step: int, index: int, window_id: str) -> None:
        self.ledger.write(json.dumps({"epoch": epoch, "step": step, "index": index, "window_id": window_id}) + "\n")

    def step(self, entry: dict, memory_keys) -> None:
        self.ledger.flush()
        self.steps.write(json.dumps(entry) + "\n")
        self.steps.flush()
        for key in (*SCALARS, *memory_keys):
            if entry[key] is not None:
                self.board.add_scalar(f"{'memory' if key in memory_keys else 'train'}/{key}", entry[key], entry["step"])

    def close(self) -> None:
        for handle in (self.steps, self.ledger, self.board):
            handle.close()
