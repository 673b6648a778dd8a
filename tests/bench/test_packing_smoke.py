"""bench/packing.py's CPU smoke run: the packed-batch benchmark the performance guard runs on a GPU
still runs against today's library (it broke unnoticed once, when the config became typed views)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import packing  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from videosft.kernels import attention_backends  # noqa: E402


@pytest.mark.slow
def test_the_packed_mode_runs_on_a_tiny_model_and_its_first_pack_equals_its_samples():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "packing.py"), "--device", "cpu", "--modes", "packed",
                           "--memory-cap-gib", "12",  # a GPU card's size: nothing to cap on the CPU
                           "--no-results"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")][-1]
    assert result["mode"] == "packed" and result["micro_batches"] >= 1 and result["tokens_per_second"] > 0
    steps = result["steps"]  # every timed step, adding up to the mode's figure
    assert len(steps) == result["micro_batches"]
    made = int(next(line for line in done.stdout.splitlines() if " samples of " in line).split()[0])
    assert result["samples"] == made  # the timed pass is a whole epoch: the first pass was the warm-up
    assert abs(sum(s["tokens"] for s in steps) / sum(s["seconds"] for s in steps) / result["tokens_per_second"] - 1) < 0.01
    assert all(s["autotuned"] == 0 and s["new_buckets"] == 0 and s["reserved_gib_added"] == 0 for s in steps)  # CPU
    same = next(line for line in done.stdout.splitlines() if line.startswith("first pack vs its samples alone"))
    differences = json.loads(same.split(": ", 1)[1].replace("'", '"'))["max_relative_difference_per_sample"]
    assert len(differences) >= 2 and max(differences) < 1e-6


def test_a_step_names_the_attention_buckets_it_met_first(monkeypatch):
    """With cuDNN's buckets on (a Hopper GPU), a step counts the buckets of its samples that no step before
    it met: 300 and 310 tokens share the 512 bucket, 700 does not."""
    monkeypatch.setitem(attention_backends._buckets, "on", True)
    rows = [{"input_tokens": n} for n in (300, 310, 700, 300)]
    events = packing.StepEvents(torch.device("cpu"), rows)
    found = []
    for indices in ([0], [1, 2], [3]):
        events.start()
        found.append(events.end(indices))
    assert [f["new_buckets"] for f in found] == [1, 1, 0]
    assert all(f["autotuned"] == 0 and f["reserved_gib_added"] == 0 for f in found)


def test_a_warm_up_count_is_refused_where_a_whole_pass_is_the_warm_up(capsys):
    with pytest.raises(SystemExit) as stopped:
        packing.main(["--device", "cpu", "--warmup", "3", "--no-results"])
    assert stopped.value.code == 2 and "give it with --passes 1" in capsys.readouterr().err


class MatrixProducts(TorchDispatchMode):
    """Counts the matrix products run while it is on (the backward's include the checkpoint's recomputation)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
        return func(*args, **(kwargs or {}))


def test_less_recomputation_gives_the_same_gradients_with_fewer_matrix_products():
    """--uncheckpointed-layers, --selective and --checkpoint-part change what the backward recomputes, not what it
    computes: one pack's LoRA gradients equal whole-layer checkpointing's, while the backward runs fewer matrix
    products."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    from videosft.training.batches import host_positions, prepare
    from videosft.training.loss import supervised_loss
    from videosft.training.sampling import packed_epoch_plan

    config = packing.load_config("tiny")
    video_processor = Qwen3VLVideoProcessor(patch_size=config.vision_config.patch_size, temporal_patch_size=2,
                                            merge_size=config.vision_config.spatial_merge_size)
    opts = argparse.Namespace(samples=4, frame_size=[64, 64], window_seconds=16.0, fps=1.0, max_frames=128,
                              annotations=None, weights=None, checkpointing=True)
    rows = packing.make_samples(config, video_processor, opts)
    (pack, *_) = packed_epoch_plan([row["input_tokens"] for row in rows], 1, 512, "pad", 0, 0).packs[0]
    layers = config.text_config.num_hidden_layers
    gradients, products = {}, {}
    for keep, selective, part, part_layers in ((0, False, "layer", None), (1, False, "layer", None),
                                               (0, True, "layer", None), (layers, False, "layer", None),
                                               (0, False, "mlp", None), (0, False, "mixer", None),
                                               (0, False, "mixer", 1)):
        opts.uncheckpointed_layers, opts.selective, opts.checkpoint_part = keep, selective, part
        opts.part_layers = part_layers
        model, _, kernels = packing.build(config, torch.device("cpu"), torch.float32, 512, opts)
        parted = 0 if part == "layer" else layers if part_layers is None else part_layers
        assert kernels["checkpointing"] == {"checkpointed_layers": layers - keep, "selective": selective,
                                            "part": part, "part_layers": parted}
        batch = prepare([rows[i] for i in pack], 0, video_processor, host_positions(model), pin=False, pack=True)
        loss = supervised_loss(model, batch)
        with MatrixProducts() as counted:
            loss.backward()
        key = (keep, selective) if part == "layer" else (part, part_layers)
        products[key] = counted.count
        gradients[key] = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    whole = gradients[0, False]
    for found in gradients.values():
        assert found.keys() == whole.keys()
        assert all(torch.allclose(found[n], whole[n], rtol=1e-5, atol=1e-7) for n in whole)
    # no checkpointed layer: no recomputation; one layer less, or only the elementwise work, in between
    assert products[layers, False] < products[1, False] < products[0, False]
    assert products[0, True] < products[0, False]
    # a layer's products are its mixer's or its feed-forward block's, and torch's checkpoint stops recomputing
    # after the last tensor the backward needs: a block's last projection (output unsaved) runs again only where
    # the next block inside the same checkpoint needs its output, i.e. the mixer's in a whole layer
    none, mlp, mixer = products[layers, False], products["mlp", None], products["mixer", None]
    assert none < mlp < products[0, False] and none < mixer < products[0, False]
    assert (mlp - none) + (mixer - none) + layers == products[0, False] - none
    # --part-layers 1: the last checkpointed layer recomputes its mixer only, the others the whole layer
    assert mixer < products["mixer", 1] < products[0, False]
    assert products[0, False] - products["mixer", 1] == (products[0, False] - mixer) // layers


def test_a_part_layer_count_is_refused_without_a_part_to_recompute(capsys):
    with pytest.raises(SystemExit) as stopped:
        packing.main(["--device", "cpu", "--part-layers", "2", "--no-results"])
    assert stopped.value.code == 2 and "--part-layers 2: a count of layers" in capsys.readouterr().err
