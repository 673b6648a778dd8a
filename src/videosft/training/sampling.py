"""Which samples each rank reads, and the proof afterwards that none was lost.

Every rank walks the same seeded order; rank r reads every world-th sample from position r. A
sample count that does not divide into world size x micro batch is handled by the policy in
``train.tail`` (never by a silent slice), and every sample a rank consumes goes to its ledger,
which :func:`check_ledgers` compares with the schedule after training. With ``train.pack_tokens``
the micro-batches are packs of several samples instead (:func:`packed_epoch_plan`).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..data.train_logs import read_ledger
from ..errors import UserError


class DataError(UserError, RuntimeError):
    pass


@dataclass
class EpochPlan:
    per_rank: list[list[int]]
    padded: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    # per rank, the sample indices of each micro-batch when they are packs (None: micro_batch each)
    packs: list[list[list[int]]] | None = None

    def batch_at(self, rank: int, position: int, micro_batch: int) -> list[int] | None:
        """The micro-batch starting at ``position`` of the rank's samples; None after the last one."""
        samples = self.per_rank[rank]
        if self.packs is None:
            return samples[position:position + micro_batch] if position + micro_batch <= len(samples) else None
        start = 0
        for pack in self.packs[rank]:
            if start == position:
                return pack
            start += len(pack)
        if position < len(samples):
            raise DataError(f"position {position} of rank {rank} is not where a pack starts; the checkpoint's "
                            "data position does not belong to this schedule")
        return None


def seeded_order(n_samples: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n_samples))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


def epoch_plan(n_samples: int, world: int, micro_batch: int, tail: str, seed: int, epoch: int,
               smoke: bool = False) -> EpochPlan:
    """Sample indices per rank for one epoch, and what the tail policy padded or dropped."""
    if smoke:  # one sample, replicated so that every rank has a batch (a set-up check, not training)
        return EpochPlan([[0] * micro_batch for _ in range(world)])
    order = seeded_order(n_samples, seed, epoch)
    unit = world * micro_batch
    remainder = n_samples % unit
    plan = EpochPlan([])
    if remainder:
        if tail == "error":
            raise DataError(
                f"{n_samples} train samples do not divide into world size {world} x micro batch {micro_batch}; "
                "set train.tail to pad or drop, or change the data"
            )
        if tail == "pad":
            plan.padded = [order[i % n_samples] for i in range(unit - remainder)]
            order = order + plan.padded
        else:
            plan.dropped = order[n_samples - remainder:]
            order = order[: n_samples - remainder]
    plan.per_rank = [order[rank::world] for rank in range(world)]
    return plan


def packed_epoch_plan(lengths: list[int], world: int, budget: int, tail: str, seed: int, epoch: int,
                      smoke: bool = False) -> EpochPlan:
    """Packs of whole samples, at most ``budget`` tokens each, dealt to the ranks in turn.

    The simplest design that keeps every guarantee of :func:`epoch_plan`: walk the same seeded order
    and close a pack when the next sample would overflow it (next-fit: the order stays the seeded
    one, so a rank's ledger is still a prefix of its schedule and a resumed run continues exactly;
    a first-fit or sorted packing would fill packs better but reorder the samples). Pack p goes to
    rank p mod world, so ranks get packs of similar token counts, and a pack count that does not
    divide into the world size is evened out as ``train.tail`` says, by whole packs: ``pad`` repeats
    the first packs of the order, ``drop`` leaves the last ones out (recorded either way), because
    under ZeRO-3 every rank must run the same number of micro-batches. The pack count varies from
    epoch to epoch, so ``tail: error`` (which would stop in some later epoch) is refused up front.
    """
    if smoke:
        return EpochPlan([[0] for _ in range(world)], packs=[[[0]] for _ in range(world)])
    check_pack_budget(lengths, [f"#{i}" for i in range(len(lengths))], budget)
    packs: list[list[int]] = []
    used = budget
    for index in seeded_order(len(lengths), seed, epoch):
        if used + lengths[index] > budget:
            packs.append([])
            used = 0
        packs[-1].append(index)
        used += lengths[index]
    plan = EpochPlan([])
    remainder = len(packs) % world
    if remainder and tail == "pad":
        extra = [packs[i % len(packs)] for i in range(world - remainder)]
        plan.padded = [index for pack in extra for index in pack]
        packs += extra
    elif remainder:
        if tail != "drop":
            raise DataError(f"{len(packs)} packs do not divide into world size {world}; set train.tail to pad or drop")
        if len(packs) < world:
            raise DataError(f"{len(lengths)} train samples make {len(packs)} packs of train.pack_tokens={budget} for "
                            f"{world} ranks: with train.tail=drop a rank would get no batch and hang ZeRO-3. Lower "
                            "train.pack_tokens, add samples, or use train.tail=pad")
        plan.dropped = [index for pack in packs[len(packs) - remainder:] for index in pack]
        packs = packs[:len(packs) - remainder]
    plan.packs = [packs[rank::world] for rank in range(world)]
    plan.per_rank = [[index for pack in rank_packs for index in pack] for rank_packs in plan.packs]
    return plan


def check_pack_budget(lengths: list[int], names: list[str], budget: int) -> None:
    """Every sample fits a pack: samples are never cut, so a longer one could not be trained on."""
    from ..errors import ConfigError

    too_long = [(name, n) for name, n in zip(names, lengths) if n > budget]
    if too_long:
        shown = ", ".join(f"{name} ({n} tokens)" for name, n in too_long[:5])
        raise ConfigError(f"train.pack_tokens={budget} is less than the length of {len(too_long)} train samples: "
                          f"{shown}; raise train.pack_tokens to at least {max(n for _, n in too_long)} (samples "
                          "are never cut)")


def check_every_rank_has_a_batch(n_samples: int, world: int, micro_batch: int, tail: str, smoke: bool) -> None:
    """Under ZeRO-3 a rank without a batch hangs the others; fail at once instead, naming it."""
    if n_samples == 0:
        raise DataError("the train split is empty")
    if smoke or tail != "drop" or n_samples >= world * micro_batch:
        return
    idle = list(range(n_samples // micro_batch, world))
    raise DataError(
        f"{n_samples} train samples for {world} ranks x micro batch {micro_batch}: with train.tail=drop "
        f"ranks {idle} would get no batch and hang ZeRO-3. Add samples, use train.tail=pad, run fewer "
        "ranks, or set train.smoke to check a set-up with one sample."
    )


@dataclass
class Cursor:
    """Where a rank is in the sample stream; saved in checkpoints so a resumed run continues exactly."""

    epoch: int = 0
    position: int = 0

    def next_batch(self, plan_for, rank: int, micro_batch: int) -> tuple[int, list[int]]:
        batch = plan_for(self.epoch).batch_at(rank, self.position, micro_batch)
        if batch is None:
            self.epoch, self.position = self.epoch + 1, 0
            batch = plan_for(self.epoch).batch_at(rank, self.position, micro_batch)
        self.position += len(batch)
        return self.epoch, batch


def check_ledgers(out: Path, world: int, n_samples: int, plan_for, window_ids: list[str], smoke: bool = False,
                  sequence_parallel: int = 1) -> dict:
    """Compare what every rank consumed with the schedule; count what was padded and dropped.

    Each rank's ledger must be exactly its schedule, in order; and in each epoch that every rank
    finished, the ranks together must have read every train sample (once, plus the padded
    repeats; minus the dropped ones, which the record names). With ``sequence_parallel`` n, the n
    ranks of a group share the schedule of their data-parallel rank (rank // n); the first of each
    group counts for the coverage.
    """
    n = sequence_parallel
    consumed = {rank: read_ledger(out, rank) for rank in range(world)}
    epochs = max((row["epoch"] for rows in consumed.values() for row in rows), default=0)
    finished, padded, dropped = [], [], []
    for epoch in range(epochs + 1):
        plan = plan_for(epoch)
        by_rank = {rank: [row["index"] for row in rows if row["epoch"] == epoch] for rank, rows in consumed.items()}
        for rank, indices in by_rank.items():
            expected = plan.per_rank[rank // n][: len(indices)]
            if indices != expected:
                raise DataError(f"rank {rank} read {indices[:8]} in epoch {epoch}; the schedule says {expected[:8]}")
        if all(len(by_rank[rank]) == len(plan.per_rank[rank // n]) for rank in range(world)):
            finished.append(epoch)
            seen = Counter(i for rank, indices in by_rank.items() if rank % n == 0 for i in indices)
            missing = set(range(n_samples)) - set(seen) - set(plan.dropped)
            if missing and not smoke:
                raise DataError(f"epoch {epoch} finished without reading samples {sorted(missing)[:8]}")
            padded += plan.padded
            dropped += plan.dropped
    return {
        "consumed_per_rank": {rank: len(rows) for rank, rows in consumed.items()},
        "finished_epochs": len(finished),
        "every_sample_read_in_each_finished_epoch": not smoke,
        "smoke": smoke,
        "padded_repeats": [window_ids[i] for i in padded],
        "dropped": [window_ids[i] for i in dropped],
        "train_samples": n_samples,
    }
