"""train.sequence_parallel through the real train stage under ZeRO-3 on CPU ranks: two ranks sharing
each sample train the adapter one rank trains alone, and a killed run with the weights' partition and the
checkpointed layer inputs in host memory resumes to the same adapter."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import PROJECT, run_torchrun
from videosft import config as config_lib
from test_train_policies import DIE_WHILE_SAVING, record_of, train_args, with_train

pytestmark = pytest.mark.slow  # trains on 2 ranks

STEPS = 6


def sequence_config(demo_config: dict, n: int, **train) -> dict:
    """LoRA on every linear layer (the Gated-DeltaNet layers' too) without dropout: dropout draws its masks
    per rank, so a shared sample's masks differ from one rank's (as they would with another seed)."""
    cfg = with_train(demo_config, steps=STEPS, save_every=2, sequence_parallel=n, **train)
    return {**cfg, "lora": {**cfg.get("lora", {}), "dropout": 0.0, "target_modules": ["all-linear"]}}


@pytest.fixture(scope="module")
def shared_and_alone(prepared, demo_config, tmp_path_factory):
    """The same steps, samples and order: one rank alone, and two ranks sharing every sample."""
    manifest = prepared / "preprocess" / "manifest.json"
    out = tmp_path_factory.mktemp("sequence-parallel-train")
    runs = {}
    for name, nproc, n in (("alone", 1, 1), ("shared", 2, 2)):
        cfg = sequence_config(demo_config, n)
        result = run_torchrun(train_args(cfg, manifest, prepared, out / name), nproc=nproc)
        assert result.returncode == 0, result.stdout[-3000:]
        runs[name] = out / name
    return runs, manifest, out


def test_two_ranks_sharing_each_sample_train_the_adapter_one_rank_trains(shared_and_alone, demo_config):
    """Float32 on the CPU. Every step's loss and gradient norm within 1e-5 relative (measured 1e-7 and
    1e-8: the split only reorders sums); a wrong weighting of the ranks' losses would scale the gradient
    norm by the group's size. The adapters: Adam moves an element by about the learning rate a step
    whatever its gradient's size, so rounding in a near-zero gradient can move it by up to that; they
    agree within 1% of lr x steps (measured 4e-4 of it)."""
    runs, _, _ = shared_and_alone
    alone, shared = (record_of(runs[name])["results"] for name in ("alone", "shared"))
    assert shared["sequence_parallel"] == 2 and alone["sequence_parallel"] == 1
    bound = shared["kernels"]["sequence_parallel"]
    assert bound["attention"] == "videosft_ulysses_sdpa" and bound["gated_deltanet_layers"] > 0
    logs = {name: [[json.loads(line) for line in (runs[name] / f"steps.rank{r}.jsonl").read_text().splitlines()]
                   for r in range(2 if name == "shared" else 1)] for name in runs}
    for figure in ("loss", "grad_norm"):
        ours = torch.tensor([e[figure] for e in logs["shared"][0]], dtype=torch.float64)
        theirs = torch.tensor([e[figure] for e in logs["alone"][0]], dtype=torch.float64)
        assert len(ours) == STEPS and torch.allclose(ours, theirs, rtol=1e-5, atol=0), figure
    assert [e["loss"] for e in logs["shared"][0]] == [e["loss"] for e in logs["shared"][1]]  # the group's loss
    assert [e["samples"] for e in logs["shared"][0]] == [e["samples"] for e in logs["shared"][1]] == \
        [e["samples"] for e in logs["alone"][0]]  # one sample a step, shared, in one rank's order
    lr = config_lib.resolve(sequence_config(demo_config, 2))["train"]["lr"]
    ours, theirs = (load_file(runs[name] / "adapter" / "adapter_model.safetensors") for name in ("shared", "alone"))
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert (ours[key] - theirs[key]).abs().max() <= 0.01 * lr * STEPS, key
    assert shared["ledger"]["every_sample_read_in_each_finished_epoch"]
    assert list(shared["ledger"]["consumed_per_rank"].values()) == [STEPS, STEPS]


def test_a_killed_offloaded_sequence_parallel_run_resumes_to_the_same_adapter(shared_and_alone, prepared,
                                                                              demo_config, tmp_path):
    """Offload moves where tensors live, not what is computed: the killed and resumed run with
    zero3_offload.json and offloaded activations ends with the shared run's adapter, bit for bit."""
    runs, manifest, _ = shared_and_alone
    cfg = sequence_config(demo_config, 2, offload_activations=True,
                          deepspeed_config=str(PROJECT / "workflow" / "deepspeed" / "zero3_offload.json"))
    interrupted = tmp_path / "interrupted"
    script = tmp_path / "die_while_saving.py"
    script.write_text(DIE_WHILE_SAVING)
    killed = run_torchrun([str(script), "step-4", *train_args(cfg, manifest, prepared, interrupted)[2:]])
    assert killed.returncode != 0 and (interrupted / "checkpoints" / "latest").read_text() == "step-2"
    resumed = run_torchrun(train_args(cfg, manifest, prepared, interrupted, "--resume"))
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    results, straight = record_of(interrupted)["results"], record_of(runs["shared"])["results"]
    assert results["resumed_from_step"] == 2 and results["losses_rank0"] == straight["losses_rank0"]
    ours, theirs = (load_file(out / "adapter" / "adapter_model.safetensors") for out in (interrupted, runs["shared"]))
    assert ours.keys() == theirs.keys() and all(ours[key].equal(theirs[key]) for key in ours)
    plan = results["memory"]["predicted"]["components_gib"]
    assert plan["weights_partitioned"] == 0 and plan["sequence_exchange"] > 0

