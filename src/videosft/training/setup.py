"""Setting up a model for LoRA training under DeepSpeed ZeRO-3 (on one rank without ZeRO): precision, the
DeepSpeed config, the partitioned (or whole) build, gradient checkpointing, whole-block gathering, LoRA,
optimizer and schedule.

The pieces the train stage puts together in :func:`videosft.stages.train.build_engine`; benchmarks
and tests build their models with the same functions.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

from ..config import View
from ..errors import ConfigError
from ..models.checkpoint import model_class
from ..models.families import family_of
from ..models.lora import target_module_names
from .memory import whole_on_one_rank


SHM_COMM_OP = "deepspeed_shm_comm"  # DeepSpeed's name for its CPU shared-memory collectives op
# The train stage's CUDA allocator. A long clip allocates and frees blocks of many sizes (layer inputs
# coming back from the host, offloaded weights); segments that grow keep the cache from fragmenting
# (bench/RESULTS.md).
ALLOCATOR = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def use_train_allocator() -> None:
    """The train stage's allocator for this process, unless the user set one; before the first CUDA
    allocation (benchmarks that measure the stage's memory call it too)."""
    import os

    for key, value in ALLOCATOR.items():
        os.environ.setdefault(key, value)


def init_distributed(seed: int, timeout_s: int) -> int:
    """This process's place in the run (torchrun's environment): NCCL on GPUs, gloo on CPU; its rank."""
    import datetime as dt
    import os

    use_train_allocator()
    import deepspeed
    import torch

    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        # On CPU, DeepSpeed compiles a shared-memory C++ op on first use (30 s, minutes on a loaded
        # machine) that only its tensor-parallel inference all-reduce calls; training needs gloo alone.
        deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False
        one_gather_at_a_time()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo",
                               timeout=dt.timedelta(seconds=timeout_s))
    return torch.distributed.get_rank()


def end_distributed() -> None:
    import torch

    torch.distributed.destroy_process_group()


def choose_precision(requested: str) -> str:
    import torch

    if requested != "auto":
        return requested
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


def cap_device_memory(gib: float | None, device) -> None:
    """Behave like a card of ``gib`` GiB on a larger one (``train.memory_cap_gib``): PyTorch's allocator
    refuses past it, as the smaller card would. Nothing without a cap or off a GPU."""
    import torch

    device = torch.device(device)
    if not gib or device.type != "cuda":
        return
    if device.index is None:  # "cuda": the current device (the allocator's cap takes an index only)
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), device)


def deepspeed_config(path: Path, train_cfg: View, world: int, precision: str, backend: str = "nccl") -> dict:
    """The DeepSpeed config file with its "auto" values filled from our config, for the collectives of
    ``backend``; on one rank that ZeRO-3 would not partition (:func:`memory.whole_on_one_rank`), DeepSpeed
    without ZeRO."""
    ds = json.loads(Path(path).read_text())
    ds["train_micro_batch_size_per_gpu"] = train_cfg.micro_batch_size
    ds["gradient_accumulation_steps"] = train_cfg.grad_accum
    ds["train_batch_size"] = train_cfg.micro_batch_size * train_cfg.grad_accum * world
    ds["gradient_clipping"] = train_cfg.grad_clip
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": precision == "bf16"}
    ds["fp16"] = {**ds.get("fp16", {}), "enabled": precision == "fp16"}
    ds["zero_allow_untested_optimizer"] = True  # we bring torch's AdamW
    if ds.get("zero_optimization", {}).get("stage") != 3:
        raise ConfigError(f"{path}: zero_optimization.stage must be 3 (on one rank the train stage runs without "
                          "ZeRO by itself, unless train.zero3_on_one_rank is true)")
    if ds["zero_optimization"].get("offload_param", {}).get("device") == "nvme":
        raise ConfigError(f"{path}: offload_param to nvme is not supported (the loader writes each rank's partition "
                          "in place, in device or host memory); use \"device\": \"cpu\"")
    if whole_on_one_rank(ds["zero_optimization"], world, precision, train_cfg.zero3_on_one_rank):
        # DeepSpeed steps only the adapters, which are fp32 (memory.ADAPTER_BYTES), so in its fp32 mode it casts
        # nothing and keeps no master copy; the optimizer clips (clipped_adamw) and keeps the norm for the log
        ds["zero_optimization"] = {"stage": 0}
        ds["bf16"]["enabled"] = ds["fp16"]["enabled"] = False
        ds["gradient_clipping"] = 0.0
    elif backend == "gloo":
        # ZeRO-3 gathers the small persistent weights after each step as one asynchronous all-gather per
        # weight; on gloo that many in flight at once can leave every rank waiting in those gathers for
        # good, past the process-group timeout, while two ranks' gloo threads spin at 100% CPU (seen
        # with 4 ranks on 2 cores, py-spy: all ranks in _allgather_params_coalesced). One blocking
        # all-gather at a time on CPU, where nothing overlaps anyway (a module's fetch: see
        # one_gather_at_a_time); a value in the file wins.
        ds["zero_optimization"].setdefault("stage3_allgather_sequential", True)
    leftover = [key for key, value in ds.items() if value == "auto"]
    if leftover:
        raise ConfigError(f"{path}: no value for 'auto' keys {leftover}")
    return ds


def one_gather_at_a_time() -> bool:
    """On gloo, let each ZeRO-3 weight fetch's all-gather finish before the next one starts.

    With ``stage3_allgather_sequential`` (:func:`deepspeed_config`) DeepSpeed 0.19 gathers the weights
    after a step one blocking all-gather at a time, but a module's fetch in the forward and backward still
    starts one asynchronous all-gather per weight (``_dist_allgather_fn``) and waits for them afterwards:
    a whole block's twenty-odd gloo collectives in flight at once, each run on gloo's own threads with no
    order between them. That is the state every rank was found in when four CPU ranks on two cores hung
    for over 10 minutes (py-spy: all in ``MultipleAllGatherHandles.wait`` of a forward fetch), as the
    weights after a step had been before they went one at a time. Waiting for each where it starts
    leaves one collective in flight; on CPU nothing overlaps with it anyway. Returns whether it was put
    in place now (False: already)."""
    from deepspeed.runtime.zero import partition_parameters

    start = partition_parameters._dist_allgather_fn
    if getattr(start, "waits", False):
        return False

    def start_and_wait(input_tensor, output_tensor, group=None):
        handle = start(input_tensor, output_tensor, group=group)
        handle.wait()
        return handle  # DeepSpeed waits on it again: a finished gloo work returns at once

    start_and_wait.waits = True
    partition_parameters._dist_allgather_fn = start_and_wait
    return True


def check_train_options(train_cfg: View) -> None:
    """The train options that cannot work together, named before any model is built."""
    if train_cfg.profile_step is not None and train_cfg.profile_step >= train_cfg.steps:
        raise ConfigError(f"train.profile_step={train_cfg.profile_step} is not one of the "
                          f"{train_cfg.steps} steps (train.steps): nothing would be profiled")
    if train_cfg.gather_whole_blocks and not train_cfg.gradient_checkpointing:
        # DeepSpeed releases a leaf block's weights when its forward ends and, without a
        # recomputation to gather them again, its backward finds them partitioned
        raise ConfigError("train.gather_whole_blocks needs train.gradient_checkpointing: true; "
                          "set gather_whole_blocks: false to train without checkpointing")
    if train_cfg.uncheckpointed_layers and not train_cfg.gradient_checkpointing:
        raise ConfigError(f"train.uncheckpointed_layers={train_cfg.uncheckpointed_layers} exempts layers from "
                          "gradient checkpointing, which is off (train.gradient_checkpointing: false): every layer "
                          "keeps its activations already; set uncheckpointed_layers: 0")
    if train_cfg.offload_activations and not train_cfg.gradient_checkpointing:
        raise ConfigError("train.offload_activations moves the inputs that gradient checkpointing keeps; "
                          "it needs train.gradient_checkpointing: true")
    check_packing(train_cfg)


def check_packing(train_cfg: View) -> None:
    """The options packed batches (train.pack_tokens) cannot work with."""
    if not train_cfg.pack_tokens:
        return
    if train_cfg.micro_batch_size != 1:
        raise ConfigError(f"train.pack_tokens={train_cfg.pack_tokens} makes each micro-batch one pack of samples; "
                          f"set train.micro_batch_size: 1 (it is {train_cfg.micro_batch_size}), or pack_tokens: null")
    if train_cfg.tail == "error":
        raise ConfigError("train.pack_tokens with train.tail: error: the number of packs changes from epoch to epoch, "
                          "so whether it divides into the ranks cannot be promised before training; set train.tail "
                          "to pad or drop (applied to whole packs)")


def runs_whole(ds_config: dict) -> bool:
    """Whether a run's DeepSpeed config (:func:`deepspeed_config`'s) builds the model whole, without ZeRO."""
    return ds_config["zero_optimization"]["stage"] == 0


def build_model(model_dir: Path, ds_config: dict, device, precision: str):
    """The model to load the checkpoint into: whole on ``device`` in ``precision`` for a run without ZeRO,
    else partitioned as it is built (:func:`build_partitioned_model`). Returns it and an object to keep
    referenced while the model is used."""
    import torch
    from transformers import AutoConfig

    if not runs_whole(ds_config):
        return build_partitioned_model(model_dir, ds_config)
    config = AutoConfig.from_pretrained(model_dir)
    cls = model_class(config)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    print("one rank: the model is built whole and DeepSpeed runs without ZeRO (ZeRO-3 would partition nothing; "
          "train.zero3_on_one_rank: true or an offload in train.deepspeed_config keeps it)", flush=True)
    with torch.device(device):
        return cls._from_config(config, dtype=dtype), None


def build_partitioned_model(model_dir: Path, ds_config: dict):
    """The model, partitioned across ranks as it is built.

    While an ``HfDeepSpeedConfig`` is alive, transformers builds inside ``deepspeed.zero.Init``
    with its own guards (RoPE buffer dtypes, initialisation of partitioned weights); the weights
    are then overwritten from the checkpoint by :func:`videosft.models.checkpoint.load_checkpoint`.
    The returned config object must stay referenced for as long as the model is used.
    """
    from transformers import AutoConfig
    from transformers.integrations import HfDeepSpeedConfig

    keep_alive = HfDeepSpeedConfig(ds_config)
    config = AutoConfig.from_pretrained(model_dir)
    model = model_class(config)._from_config(config)
    return model, keep_alive


def add_lora(model, lora_cfg: View, seed: int):
    import torch
    from peft import LoraConfig, get_peft_model

    for parameter in model.parameters():
        parameter.requires_grad_(False)
    targets = target_module_names(model, lora_cfg.target_modules)
    if not targets:
        raise ConfigError(f"lora.target_modules {lora_cfg.target_modules} match no module of the language model")
    torch.manual_seed(seed)  # every rank initialises the same LoRA weights before ZeRO partitions them
    peft_config = LoraConfig(r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                             target_modules=targets, bias="none")
    return get_peft_model(model, peft_config), targets


def enable_checkpointing(model, offload: bool, pin_memory: bool, uncheckpointed_layers: int = 0) -> None:
    """Gradient checkpointing of every decoder layer (non-reentrant) but the language model's last
    ``uncheckpointed_layers`` (train.uncheckpointed_layers), which keep their activations: the backward
    pass reaches them first, and memory left over on the card buys back their recomputation. With
    ``offload``, the input each checkpointed layer keeps for its recomputation waits in host memory instead
    (pinned on a GPU: the copies run asynchronously), and comes back when the backward pass reaches the layer.

    transformers' own ``offload=True`` always asks for pinned memory, which fails without a GPU; and
    a ``save_on_cpu`` around the whole model would also move every tensor saved outside the layers
    (the LM head's input and weight among them) on every step."""
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    layers = decoder_layers(model)
    if uncheckpointed_layers > len(layers):
        raise ConfigError(f"train.uncheckpointed_layers={uncheckpointed_layers}: the language model has "
                          f"{len(layers)} decoder layers; set it to at most {len(layers)}")
    for layer in layers[len(layers) - uncheckpointed_layers:]:
        layer.gradient_checkpointing = False
    if offload:
        for module in model.modules():
            if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
                module._gradient_checkpointing_func = functools.partial(
                    _checkpoint_inputs_on_host, module._gradient_checkpointing_func, pin_memory)


def decoder_layers(model) -> list:
    """The language model's decoder layers, in order, where the model's family record says they are."""
    return list(model.get_submodule(family_of(model.config).decoder_layers))


def _checkpoint_inputs_on_host(checkpoint, pin_memory: bool, function, *args, **kwargs):
    from torch.autograd.graph import save_on_cpu

    # torch's non-reentrant checkpoint saves the layer's inputs as saved tensors outside its own
    # hooks, so these hooks take them; inside the layer the checkpoint's hooks save nothing.
    with save_on_cpu(pin_memory=pin_memory):
        return checkpoint(function, *args, **kwargs)


def gather_whole_blocks(model, ds_config: dict | None = None) -> list[str]:
    """Mark the model's no-split blocks (decoder layers, vision blocks) as ZeRO-3 leaf modules; none
    where ``ds_config`` runs without ZeRO (:func:`runs_whole`), which gathers nothing.

    ZeRO-3 then fetches a block's weights in one gather when the block starts and releases them when
    it ends, instead of running its fetch / release hooks around every linear layer and norm inside
    it: on Qwen3.5-4B about 1,000 gathers of 5 MB and the hook work around each, three times a step
    (forward, recomputation, backward). Returns the block class names."""
    from deepspeed.utils import set_z3_leaf_modules

    if ds_config is not None and runs_whole(ds_config):
        return []
    wanted = set(getattr(model, "_no_split_modules", None) or [])
    classes = sorted({type(module) for module in model.modules() if type(module).__name__ in wanted},
                     key=lambda cls: cls.__name__)
    if not classes:
        raise ConfigError(f"train.gather_whole_blocks: {type(model).__name__} names no blocks to gather whole "
                          f"(_no_split_modules {sorted(wanted)}); set it to false for this model")
    set_z3_leaf_modules(model, classes)
    return [cls.__name__ for cls in classes]


def lr_lambda(train_cfg: View):
    """Linear warm-up over ``warmup_steps``, then a cosine from the full rate down to a tenth of it."""
    warmup, steps = train_cfg.warmup_steps, train_cfg.steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def optimizer_and_schedule(parameters: list, train_cfg: View, ds_config: dict | None = None):
    """torch's AdamW over the trainable parameters and the learning-rate schedule around it; where
    ``ds_config`` runs without ZeRO (:func:`runs_whole`) the optimizer clips the gradients itself
    (:func:`clipped_adamw`)."""
    import torch

    if ds_config is not None and runs_whole(ds_config):
        optimizer = clipped_adamw(parameters, train_cfg)
    else:
        optimizer = torch.optim.AdamW(parameters, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(train_cfg))


def clipped_adamw(parameters: list, train_cfg: View):
    """AdamW that first clips the gradients to a global norm of ``train.grad_clip`` (none: 0) and keeps the
    norm before clipping where DeepSpeed's engine reads it for the step log, as its ZeRO optimizer does:
    DeepSpeed's own clipping without ZeRO in fp32 keeps no norm."""
    import torch

    class ClippedAdamW(torch.optim.AdamW):
        def step(self, closure=None):
            with_grads = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
            self._global_grad_norm = torch.nn.utils.clip_grad_norm_(with_grads, train_cfg.grad_clip or math.inf)
            return super().step(closure)

    return ClippedAdamW(parameters, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay)
