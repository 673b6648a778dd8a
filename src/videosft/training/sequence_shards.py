"""One sequence (a sample or a pack) split over the ranks of a sequence-parallel group
(``train.sequence_parallel``): where to cut it, each rank's part of the batch, the groups, and the loss.

**Cuts at frame-pair boundaries.** The vision tower encodes a video by frame pairs (one temporal
patch), each pair on its own; a pair's visual tokens are a contiguous run of the sequence. Cutting
only between pairs gives every rank the pixels of exactly the visual tokens of its slice, so each rank
runs the vision tower on its own frames and scatters them into its own slice. The cuts are the pair
starts nearest to equal token shares, and every rank gets at least one pair: under ZeRO-3 every rank
must run the vision tower, or the others wait for its gathers. The cut is made on the host before any
frame is decoded (:class:`videosft.media.pixels.EncodedFrames`): a rank decodes only its own frames.

**Positions for the whole sequence.** The multimodal rotary positions (and a pack's restarting text
positions) are computed on the host for the whole sequence by the model's own function, then sliced;
the pack's boundaries travel whole to the attention (:mod:`videosft.kernels.ulysses`).

**The loss.** Each rank takes logits at the supervised targets of its own positions (the target of its
last position is the next rank's first token, so the host hands each rank its shifted targets). The
rank's backward loss is its token losses' sum over the whole sequence's supervised count, times the
group's size: DeepSpeed averages gradients over all ranks, and a group of n ranks stands for one rank
of the one-GPU run, so the sum over the group must carry n times the one-GPU weight.

**Groups.** Ranks ``g*n .. g*n + n - 1`` share a sequence (neighbours: on one node when ``n`` divides the
GPUs per node); ranks with the same place in their groups form the data-parallel groups. ZeRO-3 keeps
partitioning parameters, gradients and optimizer states over the whole world, as DeepSpeed's own
Ulysses support does (its ``sequence_data_parallel_group`` is the world): every rank holds a different
part of the sequence, so every rank's gradient is a distinct partial sum, and the average over all
ranks is the one the loss weighting above is made for.
"""

from __future__ import annotations

import dataclasses

from ..encoding.chat import IGNORE_INDEX
from ..errors import ConfigError
from .batches import FRAMES


def head_counts(text_config) -> dict[str, int]:
    """The language model's head counts that a sequence-parallel size must divide."""
    heads = {"attention heads": text_config.num_attention_heads, "key/value heads": text_config.num_key_value_heads}
    if getattr(text_config, "linear_num_value_heads", None):
        heads["Gated-DeltaNet value heads"] = text_config.linear_num_value_heads
        heads["Gated-DeltaNet key heads"] = text_config.linear_num_key_heads
    return heads


def allowed_sizes(text_config, candidates=(1, 2, 4, 8)) -> list[int]:
    """The sizes among ``candidates`` that divide every head count (what the probe plans for)."""
    return [n for n in candidates if all(count % n == 0 for count in head_counts(text_config).values())]


def check_sequence_parallel(n: int, world: int, text_config, micro_batch_size: int) -> None:
    """Refuse a sequence-parallel size the run cannot use, naming the numbers."""
    if n == 1:
        return
    problems = []
    if world % n:
        problems.append(f"the world of {world} ranks is not a whole number of groups of {n}")
    heads = head_counts(text_config)
    problems += [f"{count} {what} do not split over {n} ranks" for what, count in heads.items() if count % n]
    if micro_batch_size != 1:
        problems.append(f"train.micro_batch_size is {micro_batch_size}: a shared sequence is one sample or one pack "
                        "(micro_batch_size 1, or train.pack_tokens)")
    if problems:
        raise ConfigError(f"train.sequence_parallel: {n} cannot be used: " + "; ".join(problems)
                          + f". Choose a size that divides the world ({world}) and every head count "
                          + f"({', '.join(f'{w} {c}' for w, c in heads.items())}), or 1 to turn it off")


def groups(world: int, n: int) -> list[list[int]]:
    """The sequence-parallel groups: neighbouring ranks (ranks at the same place in their groups read as
    one data-parallel rank, rank // n, and need no group of their own: ZeRO-3 reduces over the world)."""
    return [list(range(start, start + n)) for start in range(0, world, n)]


def frame_pairs(token_types: list[int], grids: list[list[int]], merge: int) -> list[tuple[int, int]]:
    """(start, end) token positions of every frame pair's visual tokens, videos in order: a run of video
    tokens holds one pair (Qwen3-VL and Qwen3.5 write a block per pair) or several (Qwen2.5-VL's one run
    per video)."""
    runs, start = [], None
    for position, kind in enumerate([*token_types, 0]):
        if kind and start is None:
            start = position
        elif not kind and start is not None:
            runs.append([start, position])
            start = None
    pairs = []
    for t, h, w in grids:
        per_pair = h * w // merge**2
        for _ in range(t):
            if not runs:
                raise ValueError(f"the token types hold fewer video tokens than the grids {grids} need")
            run = runs[0]
            pairs.append((run[0], run[0] + per_pair))
            run[0] += per_pair
            if run[0] > run[1]:
                raise ValueError(f"a run of video tokens ends inside a frame pair of {per_pair} tokens")
            if run[0] == run[1]:
                runs.pop(0)
    if runs:
        raise ValueError(f"{sum(e - s for s, e in runs)} video tokens beyond the grids {grids}")
    return pairs


def cut_points(length: int, pairs: list[tuple[int, int]], n: int) -> list[int]:
    """``n + 1`` token positions (0 ... length): rank r holds tokens [cuts[r], cuts[r + 1]). Every inner cut
    is the start of a frame pair, the one nearest to an equal share, and every rank holds a pair."""
    if len(pairs) < n:
        raise ValueError(f"a sequence of {len(pairs)} frame pairs cannot give each of {n} ranks a pair of its own")
    cuts, first = [0], 1
    for r in range(1, n):
        target = length * r / n
        last = len(pairs) - (n - r)  # leave a pair for every later rank
        choice = min(range(first, last + 1), key=lambda k: (abs(pairs[k][0] - target), k))
        cuts.append(pairs[choice][0])
        first = choice + 1
    return cuts + [length]


@dataclasses.dataclass(frozen=True)
class Split:
    """Where one sequence is cut: token positions and frame pairs per rank."""
    cuts: tuple[int, ...]  # n + 1 token positions
    pair_cuts: tuple[int, ...]  # n + 1 indices into the sequence's frame pairs

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(e - s for s, e in zip(self.cuts[:-1], self.cuts[1:]))


def split_sequence(token_types: list[int], grids: list[list[int]], merge: int, n: int) -> Split:
    pairs = frame_pairs(token_types, grids, merge)
    cuts = cut_points(len(token_types), pairs, n)
    starts = [s for s, _ in pairs]
    pair_cuts = [0] + [starts.index(cut) for cut in cuts[1:-1]] + [len(pairs)]
    return Split(tuple(cuts), tuple(pair_cuts))


def local_videos(grids: list[list[int]], first: int, end: int) -> list[tuple[int, int, list[int]]]:
    """(video index, its first pair in the range, its grid within the range) of the videos with frame
    pairs among the sequence's pairs [first, end), in order."""
    local, offset = [], 0
    for video, (t, h, w) in enumerate(grids):
        share = max(0, min(end, offset + t) - max(first, offset))
        if share:
            local.append((video, max(first, offset) - offset, [share, h, w]))
        offset += t
    return local


def shard_batch(batch: dict, split: Split, rank: int) -> dict:
    """Rank ``rank``'s part of a one-row batch (host or device tensors): its tokens, positions, shifted
    targets (``targets``, in place of ``labels``), pixels and grids. The pack's boundaries and the
    attention mask stay out: the attention takes the boundaries from the shard, and a shared sequence has
    no padding."""
    import torch

    start, end = split.cuts[rank], split.cuts[rank + 1]
    first, last = split.pair_cuts[rank], split.pair_cuts[rank + 1]
    grids = batch["video_grid_thw"].tolist()
    videos = local_videos(grids, first, last)
    labels = batch["labels"]
    targets = labels[:, start + 1:end + 1]
    if targets.shape[1] < end - start:  # the last position predicts nothing
        targets = torch.cat([targets, torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
    grid = batch["video_grid_thw"]
    shard = {"input_ids": batch["input_ids"][:, start:end], "targets": targets,
             "mm_token_type_ids": batch["mm_token_type_ids"][:, start:end],
             "video_grid_thw": torch.tensor([g for _, _, g in videos], dtype=grid.dtype, device=grid.device)}
    if FRAMES in batch:  # stored frames, decoded after the cut: each video's frames of its pairs
        shard[FRAMES] = [batch[FRAMES][v][first_pair * len(batch[FRAMES][v]) // grids[v][0]:
                                          (first_pair + g[0]) * len(batch[FRAMES][v]) // grids[v][0]]
                         for v, first_pair, g in videos]
    else:
        rows_per_pair = [h * w for t, h, w in grids for _ in range(t)]
        shard["pixel_values_videos"] = batch["pixel_values_videos"][sum(rows_per_pair[:first]):sum(rows_per_pair[:last])]
    if "position_ids" in batch:
        shard["position_ids"] = batch["position_ids"][..., start:end]
    if "second_per_grid_ts" in batch:
        shard["second_per_grid_ts"] = batch["second_per_grid_ts"][[v for v, _, _ in videos]]
    return shard


@dataclasses.dataclass(frozen=True)
class Sharded:
    """What a rank's step needs of the whole sequence besides its own shard."""
    lengths: tuple[int, ...]  # every rank's slice
    bounds: tuple[int, ...] | None  # a pack's sample boundaries
    supervised: int  # the whole sequence's supervised targets


def rank_shard(batch: dict, n: int, place: int, merge: int) -> dict:
    """Rank ``place``'s shard of a host batch, with the whole sequence's facts under ``"sequence"``."""
    split = split_sequence(batch["mm_token_type_ids"][0].tolist(), batch["video_grid_thw"].tolist(), merge, n)
    bounds = batch.get("cu_seq_lens_q")
    facts = Sharded(split.lengths, None if bounds is None else tuple(int(b) for b in bounds.tolist()),
                    supervised_count(batch))
    return {**shard_batch(batch, split, place), "sequence": facts}


def supervised_count(batch: dict) -> int:
    """The whole sequence's supervised targets: the denominator of every rank's share of the loss."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def shard_loss(model, shard: dict, total: int, n: int):
    """(the rank's backward loss, its per-token losses): logits only at this rank's supervised targets."""
    import torch

    targets = shard["targets"]
    positions = torch.nonzero((targets != IGNORE_INDEX).any(dim=0)).flatten()
    inputs = {key: value for key, value in shard.items() if key != "targets"}
    if positions.numel() == 0:  # no target here: the forward still runs (its layers' exchanges and gathers)
        logits = model(**inputs, logits_to_keep=torch.zeros(1, dtype=torch.long, device=targets.device),
                       use_cache=False).logits
        return logits.float().sum() * 0.0, logits.new_zeros(0, dtype=torch.float32)
    logits = model(**inputs, logits_to_keep=positions, use_cache=False).logits
    chosen = targets[:, positions].reshape(-1)
    losses = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), chosen,
                                               ignore_index=IGNORE_INDEX, reduction="none")[chosen != IGNORE_INDEX]
    return losses.sum() * n / total, losses.detach()


@dataclasses.dataclass
class SequenceGroup:
    """This rank's sequence-parallel group in a train run: its shard of each batch and its micro-step."""
    group: object  # the process group of the n ranks that share a sequence
    place: int  # this rank's place in it
    n: int
    merge: int  # the vision tower's spatial merge: visual tokens per frame pair are its patches / merge^2

    def shard(self, batch: dict) -> dict:
        """This rank's part of a host batch (BatchesAhead's ``shard``)."""
        return rank_shard(batch, self.n, self.place, self.merge)

    def forward_backward(self, engine, batch: dict):
        """The micro-batch's forward and backward on this rank's shard, the exchanges' shard in flight for
        both (checkpointed layers run their forward again in the backward); returns the whole sequence's
        loss (mean over its supervised targets), the same on every rank of the group."""
        import torch.distributed as dist

        from ..kernels import ulysses

        facts = batch.pop("sequence")
        with ulysses.sharding(ulysses.Shard(self.group, self.place, facts.lengths, facts.bounds)):
            loss, losses = shard_loss(engine, batch, facts.supervised, self.n)
            engine.backward(loss)
        whole = losses.sum().reshape(1) / facts.supervised
        dist.all_reduce(whole, group=self.group)
        return whole[0]


def sequence_group(model_dir, train_cfg, world: int) -> SequenceGroup | None:
    """This rank's group for ``train.sequence_parallel`` after its checks against the model's head counts,
    or None when it is 1. Every rank makes every group (a collective, in the same order everywhere)."""
    import torch.distributed as dist
    from transformers import AutoConfig

    n = train_cfg.sequence_parallel
    if n == 1:
        return None
    config = AutoConfig.from_pretrained(model_dir)
    check_sequence_parallel(n, world, config.get_text_config(), 1 if train_cfg.pack_tokens else
                            train_cfg.micro_batch_size)
    rank = dist.get_rank()
    made = [dist.new_group(ranks) for ranks in groups(world, n)]
    return SequenceGroup(made[rank // n], rank % n, n, config.vision_config.spatial_merge_size)
