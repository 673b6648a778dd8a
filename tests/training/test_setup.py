"""The DeepSpeed config file as the train stage takes it: our values filled in, what cannot work refused."""

from __future__ import annotations

import json

import pytest

from videosft import config as config_lib
from videosft.errors import ConfigError
from videosft.training.setup import deepspeed_config

TRAIN = config_lib.section("train", {"micro_batch_size": 2, "grad_accum": 3, "grad_clip": 0.5})


def written(tmp_path, zero: dict, **extra):
    path = tmp_path / "zero.json"
    path.write_text(json.dumps({"zero_optimization": zero, **extra}))
    return path


def test_our_values_fill_the_file_and_its_precision_follows_the_device(tmp_path):
    ds = deepspeed_config(written(tmp_path, {"stage": 3}), TRAIN, world=4, precision="bf16")
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (2, 3, 24)
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]


def test_one_rank_runs_without_zero_unless_zero3_buys_something_there(tmp_path):
    """One rank: DeepSpeed at stage 0 in its fp32 mode (it steps only the fp32 adapters; the optimizer clips);
    fp16's loss scaling, an offload and train.zero3_on_one_rank keep the file's ZeRO-3."""
    ds = deepspeed_config(written(tmp_path, {"stage": 3, "reduce_bucket_size": 5}), TRAIN, world=1, precision="bf16")
    assert ds["zero_optimization"] == {"stage": 0} and ds["train_batch_size"] == 6
    assert not ds["bf16"]["enabled"] and not ds["fp16"]["enabled"] and ds["gradient_clipping"] == 0
    for zero, world, precision, train in (({"stage": 3}, 2, "bf16", TRAIN), ({"stage": 3}, 1, "fp16", TRAIN),
                                          ({"stage": 3, "offload_param": {"device": "cpu"}}, 1, "bf16", TRAIN),
                                          ({"stage": 3}, 1, "bf16", TRAIN.replace(zero3_on_one_rank=True))):
        kept = deepspeed_config(written(tmp_path, zero), train, world=world, precision=precision)
        assert kept["zero_optimization"]["stage"] == 3 and kept["gradient_clipping"] == 0.5, (zero, world, precision)


def test_the_optimizer_of_a_run_without_zero_clips_and_keeps_the_norm_before_clipping():
    import torch

    from videosft.training.setup import optimizer_and_schedule

    weights = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.ones(1))]
    weights[0].grad, weights[1].grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])  # norm 5; the third has none
    optimizer, _ = optimizer_and_schedule(weights, TRAIN.replace(lr=1.0, weight_decay=0.0), {"zero_optimization": {"stage": 0}})
    optimizer.step()
    assert optimizer._global_grad_norm.item() == pytest.approx(5.0)
    assert weights[0].grad.tolist() == pytest.approx([0.3, 0.0]) and weights[1].grad.item() == pytest.approx(0.4)
    assert weights[2].item() == 1.0 and weights[0][0].item() < 0  # stepped against the clipped gradient


def test_on_gloo_zero3_gathers_one_weight_at_a_time_unless_the_file_says(tmp_path):
    """Many asynchronous gloo all-gathers at once hung 4 CPU ranks for good (setup.deepspeed_config)."""
    assert deepspeed_config(written(tmp_path, {"stage": 3}), TRAIN, world=4, precision="fp32", backend="gloo")[
        "zero_optimization"]["stage3_allgather_sequential"] is True
    assert "stage3_allgather_sequential" not in deepspeed_config(
        written(tmp_path, {"stage": 3}), TRAIN, world=4, precision="bf16", backend="nccl")["zero_optimization"]
    chosen = written(tmp_path, {"stage": 3, "stage3_allgather_sequential": False})
    assert deepspeed_config(chosen, TRAIN, world=4, precision="fp32", backend="gloo")[
        "zero_optimization"]["stage3_allgather_sequential"] is False


def test_on_gloo_a_weight_fetch_has_one_all_gather_in_flight(monkeypatch):
    """A CPU rank's start makes DeepSpeed's fetch all-gather wait for itself (setup.one_gather_at_a_time), once:
    what it hands back is finished and holds every rank's part; a DeepSpeed that renamed it fails here."""
    import socket

    import deepspeed
    import torch
    from deepspeed.comm import comm
    from deepspeed.runtime.zero import partition_parameters

    from videosft.training.setup import SHM_COMM_OP, end_distributed, init_distributed, one_gather_at_a_time

    with socket.socket() as probe:  # a free port for this one-rank process group
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    # what a rank's start changes in this process besides, given back after the test
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(comm, "cdb", comm.cdb)
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, SHM_COMM_OP, deepspeed.ops.__compatible_ops__.get(SHM_COMM_OP))
    monkeypatch.setattr(partition_parameters, "_dist_allgather_fn", partition_parameters._dist_allgather_fn)
    with torch.random.fork_rng():
        init_distributed(seed=0, timeout_s=60)
    try:
        fetch = partition_parameters._dist_allgather_fn
        assert fetch.waits and fetch.__code__.co_name == "start_and_wait"
        assert one_gather_at_a_time() is False  # in place already: not wrapped twice
        part, whole = torch.arange(5.0), torch.zeros(5)
        handle = fetch(part, whole)
        assert handle.is_completed() and whole.equal(part)
    finally:
        end_distributed()


@pytest.mark.parametrize("zero, extra, message", [
    ({"stage": 2}, {}, "zero_optimization.stage must be 3"),
    ({"stage": 3, "offload_param": {"device": "nvme"}}, {}, "offload_param to nvme is not supported"),
    ({"stage": 3}, {"steps_per_print": "auto"}, "no value for 'auto' keys \\['steps_per_print'\\]"),
])
def test_a_file_that_cannot_work_is_refused_naming_it(tmp_path, zero, extra, message):
    path = written(tmp_path, zero, **extra)
    with pytest.raises(ConfigError, match=message) as raised:
        deepspeed_config(path, TRAIN, world=2, precision="fp32")
    assert str(path) in str(raised.value)


def test_uncheckpointed_layers_without_checkpointing_are_refused_naming_both_keys():
    from videosft.training.setup import check_train_options

    check_train_options(config_lib.section("train", {"uncheckpointed_layers": 2}))
    with pytest.raises(ConfigError, match=r"train.uncheckpointed_layers=2 .*train.gradient_checkpointing: false"):
        check_train_options(config_lib.section("train", {"uncheckpointed_layers": 2, "gradient_checkpointing": False,
                                                         "gather_whole_blocks": False}))
