"""`videosft.stages.train` with timing probes, for measuring a first run (issue 18). Started by torchrun in its place:

    python -m torch.distributed.run --standalone --nproc_per_node=1 bench/first_run_train.py \\
        --config ... --samples ... --probe ... --out ...

It runs the train stage's own `main` unchanged; around it, it records (one JSON line per event in
$GPU18_EVENTS.rank<R>.jsonl, times in seconds since $GPU18_LAUNCH_T0, the moment the driver launched torchrun):
  * each import (torch, triton, deepspeed, transformers, peft, fla, the Qwen3.5 modeling module, videosft.stages.train);
  * the train stage's phases: model build, checkpoint load, the Gated-DeltaNet check, the fused-kernel check,
    LoRA / DeepSpeed setup, every step's start and end;
  * inside the checks, every run of a candidate (fla, bf16) or reference (torch, fp32 / bf16) with its
    token count, seconds (CUDA-synchronised), GPU memory allocated before / after and the peak so far;
  * every Triton JIT compile (kernel, seconds, whether inside an autotune) and every autotune (kernel,
    key, wall seconds, Triton's own benchmark time, whether the result came from the disk cache), and
    which autotune keys were used in the checks and in the training steps.
Nothing here changes what the stage computes.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time

T_START = time.time()
LAUNCH = float(os.environ.get("GPU18_LAUNCH_T0", T_START))
RANK = os.environ.get("RANK", "0")
_events = open(os.environ.get("GPU18_EVENTS", "/tmp/gpu18_events") + f".rank{RANK}.jsonl", "a")
_phase = ["startup"]
_autotune_depth = [0]
_keys_used: dict[str, set] = {}  # phase group -> {(kernel, key)}
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as train.main does, before CUDA


def now() -> float:
    return time.time() - LAUNCH


def emit(kind: str, **fields) -> None:
    record = {"t": round(now(), 4), "kind": kind, "phase": _phase[-1], **fields}
    _events.write(json.dumps(record, default=str) + "\n")
    _events.flush()


emit("process_start", python_started_s=round(T_START - LAUNCH, 3))


def timed_import(name: str):
    started = time.time()
    try:
        module = importlib.import_module(name)
    except Exception as error:  # noqa: BLE001 - record and go on (fla may be absent on CPU)
        emit("import", module=name, seconds=time.time() - started, error=f"{type(error).__name__}: {error}")
        return None
    emit("import", module=name, seconds=time.time() - started)
    return module


torch = timed_import("torch")
triton = timed_import("triton")
timed_import("deepspeed")
timed_import("transformers")
timed_import("peft")
timed_import("fla.ops.gated_delta_rule")
timed_import("fla.modules")
timed_import("transformers.models.qwen3_5.modeling_qwen3_5")
train = timed_import("videosft.stages.train")
gated_deltanet = importlib.import_module("videosft.kernels.gated_deltanet")
fused = importlib.import_module("videosft.kernels.fused")
deepspeed = sys.modules["deepspeed"]

CUDA = torch.cuda.is_available()
GIB = 2**30


def sync():
    if CUDA:
        torch.cuda.synchronize()


def memory() -> dict:
    if not CUDA:
        return {}
    return {"allocated_gib": torch.cuda.memory_allocated() / GIB, "peak_gib": torch.cuda.max_memory_allocated() / GIB,
            "reserved_gib": torch.cuda.memory_reserved() / GIB}


def group() -> str:
    p = _phase[-1]
    return "step" if p.startswith("step") else ("check" if p.startswith(("gdn", "fused", "check")) else "other")


# ---------------------------------------------------------------- Triton: compiles and autotunes

if triton is not None:
    from triton.runtime import autotuner as _autotuner
    from triton.runtime import jit as _jit

    _do_compile = _jit.JITFunction._do_compile

    def do_compile(self, *args, **kwargs):
        started = time.time()
        try:
            return _do_compile(self, *args, **kwargs)
        finally:
            try:
                emit("compile", kernel=getattr(getattr(self, "fn", None), "__qualname__", str(self)),
                     seconds=time.time() - started, in_autotune=_autotune_depth[0] > 0)
            except Exception:  # noqa: BLE001 - never let the record break the run
                pass

    _jit.JITFunction._do_compile = do_compile

    _run = _autotuner.Autotuner.run

    def autotune_key(self, args, kwargs):
        named = {**dict(zip(self.arg_names, args)), **kwargs}
        named = {k: v for k, v in named.items() if k in self.arg_names}
        key = [named[k] for k in self.keys if k in named]
        key += [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
        return tuple(key)

    def autotuner_run(self, *args, **kwargs):
        name = getattr(self.base_fn, "__name__", "?")
        before = set(self.cache)
        self.bench_time = None
        _autotune_depth[0] += 1
        started = time.time()
        try:
            return _run(self, *args, **kwargs)
        finally:
            _autotune_depth[0] -= 1
            seconds = time.time() - started
            if len(self.configs) > 1:
                try:
                    _keys_used.setdefault(group(), set()).add((name, str(autotune_key(self, args, kwargs))))
                except Exception:  # noqa: BLE001 - the key is for the record only
                    pass
            try:
                new = [k for k in self.cache if k not in before]
                if new:
                    emit("autotune", kernel=name, key=str(new[0]), seconds=seconds, configs=len(self.configs),
                         bench_seconds=self.bench_time, from_disk_cache=self.bench_time is None)
            except Exception:  # noqa: BLE001 - never let the record break the run
                pass

    _autotuner.Autotuner.run = autotuner_run


# ---------------------------------------------------------------- the stage's phases


def phased(module, attribute: str, label: str, measure_memory: bool = False):
    original = getattr(module, attribute)

    def wrapper(*args, **kwargs):
        _phase.append(label)
        if measure_memory and CUDA:
            sync()
            torch.cuda.reset_peak_memory_stats()
        before = memory()
        emit("phase_start", name=label, **{f"before_{k}": v for k, v in before.items()})
        started = time.time()
        try:
            return original(*args, **kwargs)
        finally:
            sync()
            emit("phase_end", name=label, seconds=time.time() - started, **memory())
            _phase.pop()

    setattr(module, attribute, wrapper)


phased(train, "build_partitioned_model", "build_model")
phased(train, "load_checkpoint", "load_checkpoint")
phased(train, "select_gated_delta_rule", "check_gdn", measure_memory=True)
phased(train, "select_fused_kernels", "check_fused", measure_memory=True)
phased(train, "batch_vision_attention", "vision_attention")
phased(train, "add_lora", "add_lora")
phased(deepspeed, "initialize", "deepspeed_initialize")
phased(train, "gathered_lora_state", "gather_lora")
phased(train, "load_samples", "load_samples")


def check_run(module, label):
    """Time each forward + backward run inside a check, with the memory around it."""
    original = module._run

    def wrapper(*args, **kwargs):
        if module is gated_deltanet:
            function, inputs = args[0], args[1]
            upcast = args[2] if len(args) > 2 else kwargs["upcast"]
            role = "fla_bf16" if getattr(function, "implementation", None) == "fla" else (
                "torch_fp32_reference" if upcast else "torch_bf16")
            tokens, what = inputs["query"].shape[1], "gated_deltanet"
        else:
            site, forward, inputs, upcast = args[0], args[1], args[2], args[4] if len(args) > 4 else kwargs["upcast"]
            role = "torch_fp32_reference" if upcast else (
                "torch_bf16" if forward is fused.reference_forward(site) else "fla_bf16")
            what = site.kind
            if site.kind == "swiglu":
                tokens = inputs["gate"].shape[0]
            elif site.kind == "causal_conv1d":
                tokens = inputs["hidden_states"].shape[1]
            else:
                tokens = inputs["hidden_states"].shape[0] // site.shape["rows_per_token"]
        _phase.append(f"{label}:{what}:{role}:T={tokens}")
        sync()
        before = memory()
        started = time.time()
        try:
            return original(*args, **kwargs)
        finally:
            sync()
            emit("check_run", what=what, role=role, tokens=tokens, seconds=time.time() - started,
                 before_allocated_gib=before.get("allocated_gib"), **memory())
            _phase.pop()

    module._run = wrapper


def timed_helper(module, attribute, label):
    original = getattr(module, attribute)

    def wrapper(*args, **kwargs):
        started = time.time()
        try:
            return original(*args, **kwargs)
        finally:
            sync()
            emit("helper", name=label, seconds=time.time() - started, **memory())

    setattr(module, attribute, wrapper)


check_run(gated_deltanet, "gdn")
check_run(fused, "fused")
timed_helper(gated_deltanet, "check_inputs", "gdn_check_inputs")
timed_helper(fused, "check_inputs", "fused_check_inputs")
timed_helper(gated_deltanet, "relative_errors", "gdn_relative_errors")
timed_helper(fused, "relative_errors", "fused_relative_errors")

_step = [0]
steps = importlib.import_module("videosft.training.steps")
train_logs = importlib.import_module("videosft.data.train_logs")
_supervised_loss = steps.supervised_loss
_logged_step = train_logs.RankLogs.step


def supervised_loss(model, batch):
    if not _phase[-1].startswith("step"):
        _phase.append(f"step{_step[0]}")
        emit("step_start", step=_step[0])
    return _supervised_loss(model, batch)


def logged_step(self, entry, memory_keys):
    """The step's end: its peak memory is in the entry the train stage logs."""
    sync()
    emit("step_end", step=_step[0], **{key: entry[key] for key in memory_keys})
    if _phase[-1].startswith("step"):
        _phase.pop()
    _step[0] += 1
    return _logged_step(self, entry, memory_keys)


steps.supervised_loss = supervised_loss
train_logs.RankLogs.step = logged_step


def main() -> int:
    emit("train_main_start")
    try:
        code = train.main(sys.argv[1:])
    finally:
        emit("train_main_end", keys_used={g: sorted(map(list, keys)) for g, keys in _keys_used.items()})
    import gc

    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(main())
