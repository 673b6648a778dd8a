"""One rank of the sequence-parallel exactness check (tests/training/test_sequence_parallel.py), under
torchrun on gloo: every rank builds the same tiny model with LoRA, computes the one-rank reference of
every sequence alone, then its own shard of its group's sequence, and rank 0 writes the largest
differences (and what each deliberate off-by-one did) to OUT/result.json.

    python -m torch.distributed.run --nproc_per_node 4 tests/training/sequence_parallel_worker.py \
        '{"runs": [{"n": 2, "cases": [{"family": "qwen3_5", "packed": true, "mutations": ["targets"]}]}]}' OUT
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from test_packing import sample as packing_sample, tiny_model as packing_model, video_processor  # beside this file
from videosft.encoding.chat import IGNORE_INDEX
from videosft.kernels import packed_attention, ulysses
from videosft.models.lora import target_module_names
from videosft.training.batches import host_positions, prepare
from videosft.training.sequence_shards import groups, shard_batch, shard_loss, split_sequence, supervised_count

PAIRS = 4  # frame pairs per sample: 2 merged tokens each
# (text before the video, text after it, answer tokens); the second longer than a Gated-DeltaNet chunk of 64
LAYOUTS = [(9, 5, 4), (60, 20, 9), (20, 8, 6), (14, 30, 5)]


def tiny_model(family: str):
    """The packing tests' tiny model with head counts that split over 4 ranks, its full attention bound as
    the train stage binds it."""
    model = packing_model(family, split_over=4)
    packed_attention.bind(model)
    return model


def sample(family: str, index: int, layout: tuple[int, int, int]) -> dict:
    return packing_sample(family, index, layout, pairs=PAIRS)


def with_lora(model):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                             target_modules=target_module_names(model, ["all-linear"])))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B = 0 would give A no gradient to compare
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model


def reference_losses(model, batch: dict):
    """One rank, the whole sequence: per-token losses at the supervised targets, in position order."""
    targets = batch["labels"][:, 1:]
    positions = torch.nonzero((targets != IGNORE_INDEX).any(dim=0)).flatten()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, logits_to_keep=positions, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.float()[0], targets[0, positions], reduction="none")


def lora_grads(model) -> dict:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if "lora_" in name}


def sharded(model, batch, split, place, group, n, mutation=None):
    """This rank's per-token losses and backward under the shard (``mutation``: one deliberate off-by-one)."""
    shard = shard_batch(batch, split, place)
    bounds = batch.get("cu_seq_lens_q")
    bounds = None if bounds is None else [int(b) for b in bounds.tolist()]
    if mutation == "targets":  # each position's own token as its target instead of the next one
        shard["targets"] = batch["labels"][:, split.cuts[place]:split.cuts[place + 1]]
    elif mutation == "positions":
        shard["position_ids"] = batch["position_ids"][..., split.cuts[place] + 1:split.cuts[place + 1] + 1]
        if shard["position_ids"].shape[-1] < shard["input_ids"].shape[-1]:
            shard["position_ids"] = torch.cat([shard["position_ids"], shard["position_ids"][..., -1:] + 1], dim=-1)
    elif mutation == "bounds":
        bounds = [bounds[0], bounds[1] + 1, *bounds[2:]]
    context = ulysses.Shard(group=group, rank=place, lengths=split.lengths, bounds=tuple(bounds) if bounds else None)
    with ulysses.sharding(context):
        loss, losses = shard_loss(model, shard, supervised_count(batch), n)
        if mutation is None:
            loss.backward()
    return losses


def gathered(losses, group, n):
    parts = [None] * n
    dist.all_gather_object(parts, losses.tolist(), group=group)
    return torch.tensor([x for part in parts for x in part])


def check(case: dict, n: int, rank: int, world: int, group, place: int) -> dict:
    """One family, packed or not: this rank's differences from the one-rank reference."""
    family = case["family"]
    model = with_lora(tiny_model(family))
    ulysses.bind(model)
    processor, positions = video_processor(family), host_positions(model)
    rows = [sample(family, i, layout) for i, layout in enumerate(LAYOUTS)]
    dp = world // n
    if case["packed"]:
        sequences = [prepare(rows[:3], 0, processor, positions, pin=False, pack=True),
                     prepare(rows[1:], 0, processor, positions, pin=False, pack=True)][:dp]
    else:
        sequences = [prepare([row], 0, processor, positions, pin=False) for row in rows[:dp]]
    for batch in sequences:
        batch.pop("attention_mask", None)
    merge = model.config.vision_config.spatial_merge_size
    splits = [split_sequence(b["mm_token_type_ids"][0].tolist(), b["video_grid_thw"].tolist(), merge, n)
              for b in sequences]

    model.zero_grad()
    references = [reference_losses(model, batch) for batch in sequences]
    torch.stack([losses.mean() for losses in references]).mean().backward()
    expected = lora_grads(model)

    model.zero_grad()
    mine = rank // n
    reference = references[mine].detach()
    losses = gathered(sharded(model, sequences[mine], splits[mine], place, group, n), group, n)
    got = lora_grads(model)
    for grad in got.values():
        dist.all_reduce(grad)
        grad /= world

    def difference(other) -> float:
        return (other - reference).abs().max().item() if other.numel() == reference.numel() else float("inf")

    result = {**case, "tokens": losses.numel(), "loss_difference": difference(losses),
              "grad_relative_difference": max(((got[k] - expected[k]).abs().max()
                                               / expected[k].abs().max().clamp_min(1e-12)).item() for k in expected),
              "lora_tensors": len(expected), "nonzero_grads": sum(bool(g.abs().max() > 0) for g in expected.values()),
              "lengths": [list(s.lengths) for s in splits], "mutations": {}}
    for mutation in case.get("mutations", []):
        if mutation == "bounds" and not case["packed"]:
            continue
        split = splits[mine]
        if mutation == "cut":  # one token into a frame pair: that rank's visual tokens no longer match its frames
            split = dataclasses.replace(split, cuts=(split.cuts[0], split.cuts[1] + 1, *split.cuts[2:]))
        with torch.no_grad():
            try:
                moved = gathered(sharded(model, sequences[mine], split, place, group, n, mutation), group, n)
                result["mutations"][mutation] = difference(moved)
            except Exception as error:  # noqa: BLE001 - a refused shard is a detected one
                result["mutations"][mutation] = f"{type(error).__name__}: {error}"[:300]
    return result


def main() -> None:
    """``{"runs": [{"n": sequence-parallel size, "cases": [case, ...]}, ...]}``: every run's cases in one world."""
    options, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for run in options["runs"]:
        n = run["n"]
        made = [dist.new_group(ranks) for ranks in groups(world, n)]  # every rank makes every group, in order
        results += [{"n": n, **check(case, n, rank, world, made[rank // n], rank % n)} for case in run["cases"]]
    everything = [None] * world
    dist.all_gather_object(everything, results)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(everything, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
