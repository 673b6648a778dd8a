"""The train stage's logs: what each step did (``steps.rank<r>.jsonl``, and every rank's steps in
``steps.jsonl``) and which samples each rank read (``ledger.rank<r>.jsonl``), their writers and their
readers.

The train stage appends one line per step and per sample read to each rank's files (the live
progress logs, and what a resumed run continues from); after training it proves from the ledgers
that every sample was read (:func:`videosft.training.sampling.check_ledgers`), and rank 0 gathers
every rank's steps into ``steps.jsonl`` (:func:`write_all_steps`), the stage's declared output,
from which the report draws loss and memory per rank. They all read them here, so the writers and
the readers agree on names and fields. Every rank also writes TensorBoard event files of its
steps (``tensorboard --logdir results/train/tensorboard``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..errors import InputError

TENSORBOARD = "tensorboard"  # results/train/tensorboard/rank<r>
STEPS = "steps.rank{rank}.jsonl"
LEDGER = "ledger.rank{rank}.jsonl"
ALL_STEPS = "steps.jsonl"
SCALARS = ("loss", "lr", "grad_norm", "tokens_per_second")  # TensorBoard's train/ group; peaks go to memory/


def steps_path(out: Path, rank: int) -> Path:
    return Path(out) / STEPS.format(rank=rank)


def ledger_path(out: Path, rank: int) -> Path:
    return Path(out) / LEDGER.format(rank=rank)


def all_steps_path(out: Path) -> Path:
    return Path(out) / ALL_STEPS


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError as error:  # a full disk or a killed writer leaves half a line
            raise InputError(f"{path}, line {number}: not a JSON entry ({error.msg}); the file is damaged. Run the "
                             "train stage again (snakemake --forcerun train) to rewrite it") from None
    return entries


def read_steps(out: Path) -> dict[int, list[dict]]:
    """Rank -> its step entries, for every rank that wrote a step log in ``out``."""
    logs = {}
    for path in sorted(Path(out).glob(STEPS.format(rank="*"))):
        rank = path.name[len("steps.rank"):-len(".jsonl")]
        if rank.isdigit():
            logs[int(rank)] = [entry for entry in _read(path) if "step" in entry]
    return dict(sorted(logs.items()))


def write_all_steps(out: Path) -> Path:
    """Every rank's step entries from the step logs in ``out``, rank after rank, into one
    ``steps.jsonl`` there (each entry names its rank); call it once every rank's log is complete."""
    path = all_steps_path(out)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(entry) + "\n" for entries in read_steps(out).values() for entry in entries))
    tmp.replace(path)  # a reader never sees half a file
    return path


def read_all_steps(path: Path) -> dict[int, list[dict]]:
    """Rank -> its step entries, from a ``steps.jsonl`` of :func:`write_all_steps`."""
    logs: dict[int, list[dict]] = {}
    for entry in _read(Path(path)):
        logs.setdefault(entry["rank"], []).append(entry)
    return dict(sorted(logs.items()))


def read_ledger(out: Path, rank: int) -> list[dict]:
    """Every sample ``rank`` read, in order: epoch, step, position in the epoch's order, window id."""
    return _read(ledger_path(out, rank))


def clear(out: Path) -> None:
    """A fresh run's start: an earlier run's logs, ledgers and event files would mislead."""
    for stale in Path(out).glob("*.rank*.jsonl"):
        stale.unlink()
    all_steps_path(out).unlink(missing_ok=True)
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
