"""One optimizer step of the train stage: its micro-batches (each prepared on the host while the one
before it runs), forward and backward through the DeepSpeed engine, what it consumed, and the step
log's entry for it; and the check that LoRA learns at all."""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..data.adapter import gathered_lora_state
from .batches import BatchesAhead, tokens_in
from .loss import supervised_loss
from .sampling import Cursor, DataError
from .sequence_shards import SequenceGroup


@dataclasses.dataclass
class StepDone:
    """What a step consumed (index entries, in order), its loss (mean over micro-batches) and its tokens."""
    consumed: list
    loss: float
    tokens: int


def require_video(entries: list, rank: int) -> None:
    """Every rank runs the vision tower on every step: under ZeRO-3 a rank that skips it hangs the rest."""
    for entry in entries:
        if not entry.visual_tokens or not entry.frames:
            raise DataError(f"rank {rank}: sample {entry.window_id} has no video; every batch must carry one")


def train_step(engine, batches: BatchesAhead, cursor: Cursor, next_batch: Callable[[Cursor], tuple[int, list[int]]],
               index, rank: int, accumulate: int, last_step: bool, record_read: Callable,
               sequence: SequenceGroup | None = None) -> StepDone:
    """``accumulate`` micro-batches through the engine. ``next_batch(cursor)`` advances the cursor to the
    next (epoch, sample positions); ``record_read(epoch, position, entry)`` writes each sample to the ledger.
    The schedule is fixed, so the batch after each one is announced (read and prepared ahead) from a copy
    of the cursor, except after the run's very last. With ``sequence`` (train.sequence_parallel) the
    batches are this rank's shards and the loss is the whole sequence's."""
    done = StepDone([], 0.0, 0)
    for micro_step in range(accumulate):
        epoch, positions = next_batch(cursor)
        entries = [index[i] for i in positions]
        require_video(entries, rank)
        batch = batches.take(positions)
        if not (last_step and micro_step + 1 == accumulate):
            batches.announce(next_batch(dataclasses.replace(cursor))[1])
        if sequence is None:
            loss = supervised_loss(engine, batch)
            engine.backward(loss)
        else:
            loss = sequence.forward_backward(engine, batch)
        engine.step()
        done.loss += loss.item() / accumulate
        done.tokens += tokens_in(batch)
        done.consumed.extend(entries)
        for position, entry in zip(positions, entries):
            record_read(epoch, position, entry)
    return done


def step_entry(step: int, rank: int, done: StepDone, engine, scheduler, seconds: float, memory: dict,
               since_start: float) -> dict:
    """The step log's line for a step (:mod:`videosft.data.train_logs`)."""
    return {
        "step": step, "rank": rank, "loss": done.loss, "lr": scheduler.get_last_lr()[0],
        "grad_norm": _float(engine.get_global_grad_norm()),
        "samples": [e.window_id for e in done.consumed],
        "frames": [e.frames for e in done.consumed],
        "grid": [list(e.grid) for e in done.consumed],
        "input_tokens": [e.input_tokens for e in done.consumed],
        "supervised_tokens": [e.supervised_tokens for e in done.consumed],
        "step_seconds": seconds, "tokens_per_second": done.tokens / seconds, **memory,
        "since_start_s": since_start,  # a first run's cost shows at step 0
    }


def progress_note(entry: dict) -> str:
    grad_norm = "n/a" if entry["grad_norm"] is None else f"{entry['grad_norm']:.3g}"
    return (f"step {entry['step']}: loss {entry['loss']:.4f} lr {entry['lr']:.2e} grad norm {grad_norm} "
            f"{entry['step_seconds']:.2f} s {entry['tokens_per_second']:.0f} tokens/s")


class LoraWatch:
    """LoRA ``B`` starts at zero, so ``A`` gets no gradient on the first step by construction: only after
    the second step must every LoRA tensor have moved. A tensor that has not is a LoRA that cannot learn
    (frozen by mistake, cut off from the loss)."""

    def __init__(self, model, fresh: bool):
        self.initial = gathered_lora_state(model)  # a collective: every rank builds its watch
        nonzero_b = [name for name, value in self.initial.items() if "lora_B" in name and value.any()]
        if fresh and nonzero_b:
            raise RuntimeError(f"LoRA B matrices start non-zero: {nonzero_b[:3]}; the update check assumes B = 0")

    def unchanged(self, model) -> list[str]:
        current = gathered_lora_state(model)
        return [name for name, value in current.items() if value.equal(self.initial[name])]

    def check(self, model, required: bool) -> list[str]:
        """After the run's second step: the tensors that did not move, an error unless not ``required``."""
        unchanged = self.unchanged(model)
        if unchanged and required:
            raise RuntimeError(f"{len(unchanged)} of {len(self.initial)} LoRA tensors did not change in two steps: "
                               f"{unchanged[:5]}; set train.check_lora_updates: false to go on anyway")
        return unchanged


def _float(value) -> float | None:
    if value is None:
        return None
    return float(value.item() if hasattr(value, "item") else value)
