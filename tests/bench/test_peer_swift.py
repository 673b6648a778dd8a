"""bench/peer_swift.py's side of the comparison that runs without ms-swift: the samples in its format
(frames exactly the stored ones, our chat, a budget that keeps our frame size) and the step summary."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import packing  # noqa: E402
import peer_swift  # noqa: E402
from videosft.data.sample_store import read_manifest, read_samples  # noqa: E402
from videosft.media.pixels import frames_of  # noqa: E402


def test_the_export_holds_each_window_s_stored_frames_and_our_chat(prepared, tmp_path):
    manifest = prepared / "preprocess" / "manifest.json"
    facts = peer_swift.export(manifest, "train", tmp_path)
    rows = read_samples(manifest, "train")
    lines = [json.loads(line) for line in (tmp_path / "swift.jsonl").read_text().splitlines()]
    assert len(lines) == len(rows) == facts["samples"] > 0
    for row, line in zip(rows, lines):
        roles = [turn["role"] for turn in line["messages"]]
        assert roles == ["system", "user", "assistant"]
        user, answer = line["messages"][1]["content"], line["messages"][2]["content"]
        assert user.startswith("<video>") and user.count("<video>") == 1 and row["query"] in user
        assert answer == row["answer"]
        (files,) = line["videos"]
        stored = frames_of(row).permute(0, 2, 3, 1).numpy()
        assert len(files) == len(stored)
        assert all(np.array_equal(np.asarray(Image.open(f)), frame) for f, frame in zip(files, stored))
    _, height, width = rows[0]["video_grid_thw"]
    assert facts["env"]["VIDEO_MIN_TOKEN_NUM"] == facts["env"]["VIDEO_MAX_TOKEN_NUM"] == str(height * width // 4)
    times = rows[0]["frame_times"]
    assert float(facts["env"]["FPS"]) == pytest.approx((len(times) - 1) / (times[-1] - times[0]), rel=1e-5)
    assert facts["our_input_tokens"] == [row["input_tokens"] for row in rows]


def test_rows_in_memory_export_as_the_same_rows_read_from_the_store(prepared, tmp_path):
    manifest = prepared / "preprocess" / "manifest.json"
    from_store = peer_swift.export(manifest, "train", tmp_path / "store")
    merge_size = read_manifest(manifest)["geometry"]["merge_size"]
    from_rows = peer_swift.export_rows(read_samples(manifest, "train"), merge_size, tmp_path / "rows")
    assert from_rows == from_store
    lines = {name: (tmp_path / name / "swift.jsonl").read_text().replace(str((tmp_path / name).resolve()), "OUT")
             for name in ("store", "rows")}
    assert lines["rows"] == lines["store"] and lines["rows"].count("OUT/frames/") > 0


def test_packing_s_windows_export_with_their_frames_rate_and_budget(demo_config, tmp_path):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(demo_config["model"]["path"])
    opts = argparse.Namespace(annotations=None, samples=4, window_seconds=16.0, fps=1.0, max_frames=128,
                              frame_size=[64, 64])
    rows = packing.make_real_samples(processor, opts)
    facts = peer_swift.export_rows(rows[::-1], processor.video_processor.merge_size, tmp_path)  # in another order
    lines = [json.loads(line) for line in (tmp_path / "swift.jsonl").read_text().splitlines()]
    assert len(lines) == facts["samples"] == 4 and facts["frames"] == [16] * 4
    for row, line in zip(rows[::-1], lines):
        (files,) = line["videos"]
        stored = frames_of(row).permute(0, 2, 3, 1).numpy()
        assert len(files) == len(row["frame_times"]) == 16
        assert all(np.array_equal(np.asarray(Image.open(f)), frame) for f, frame in zip(files, stored))
        assert row["query"] in line["messages"][1]["content"] and line["messages"][2]["content"] == row["answer"]
    # 64x64 frames in patches of 16, merged 2x2: 4 tokens per frame pair, the budget that keeps them at that size
    assert facts["env"]["VIDEO_MIN_TOKEN_NUM"] == facts["env"]["VIDEO_MAX_TOKEN_NUM"] == "4"
    assert float(facts["env"]["FPS"]) == pytest.approx(1.0) and facts["env"]["FPS_MAX_FRAMES"] == "16"
    assert facts["our_input_tokens"] == [row["input_tokens"] for row in rows[::-1]]
    assert all(row["visual_tokens"] == 8 * 4 for row in rows)


LORA = {"r": 8, "alpha": 16, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"]}


def stand_in_options(tmp_path: Path, records: str, **options) -> argparse.Namespace:
    """run_swift's options with a stand-in for ms-swift's interpreter (ms-swift is not installed here), which
    runs ``records`` (Python) to keep what its process was given, and a model folder of one config."""
    tmp_path.mkdir(exist_ok=True)
    stand_in = tmp_path / "python"
    stand_in.write_text(f"#!{sys.executable}\nimport json, os, sys\n{records}\n")
    stand_in.chmod(0o755)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    return argparse.Namespace(model=tmp_path / "model", steps=2, lora=LORA, device="cuda", max_length=4096,
                              swift_python=str(stand_in), swift_path=None, **options)


def test_settings_differ_where_the_docstring_says(tmp_path):
    ours, recommended = (peer_swift.swift_arguments(Path("m"), "qwen3_5", Path("d"), tmp_path, name, 8, LORA, "cuda", 4096)
                         for name in ("ours", "recommended"))
    value = lambda args, flag: args[args.index(flag) + 1]  # noqa: E731
    assert value(ours, "--attn_impl") == "sdpa" and "--packing" not in ours and value(ours, "--deepspeed") == "zero3"
    assert value(recommended, "--attn_impl") == "flash_attn" and value(recommended, "--packing") == "true"
    assert value(recommended, "--deepspeed") == "zero2" and value(recommended, "--use_liger_kernel") == "true"
    for args in (ours, recommended):
        assert value(args, "--lora_rank") == "8" and value(args, "--torch_dtype") == "bfloat16"
        assert args[args.index("--target_modules") + 1:args.index("--target_modules") + 3] == ["q_proj", "v_proj"]
        assert value(args, "--gradient_accumulation_steps") == "1" and value(args, "--freeze_vit") == "true"


def test_the_summary_leaves_out_the_first_step_and_merges_losses(tmp_path):
    steps = tmp_path / "steps.jsonl"
    entries = [{"step": 0, "step_seconds": 5.0, "tokens": 100, "peak_allocated_gib": 3.0, "peak_reserved_gib": 4.0},
               {"step": 0, "loss": 2.5},
               {"step": 1, "step_seconds": 1.0, "tokens": 100, "peak_allocated_gib": 3.5, "peak_reserved_gib": 4.0},
               {"step": 2, "step_seconds": 0.5, "tokens": 100, "peak_allocated_gib": 3.0, "peak_reserved_gib": 4.5}]
    steps.write_text("".join(json.dumps(e) + "\n" for e in entries))
    summary = peer_swift.summarize(steps)
    assert summary["steps"] == 3 and summary["step0_loss"] == 2.5
    assert summary["tokens_per_second"] == 150.0 and summary["step_seconds"] == 0.75
    assert summary["tokens_per_step"] == [100] * 3 and summary["seconds_per_step"] == [5.0, 1.0, 0.5]
    assert (summary["peak_allocated_gib"], summary["peak_reserved_gib"]) == (3.5, 4.5)


def test_a_simulated_card_reaches_ms_swift_s_process_and_its_command(tmp_path):
    seen = tmp_path / "seen.json"
    records = (f"json.dump({{'cap': os.environ.get('PEER_MEMORY_CAP_GIB'), 'argv': sys.argv[1:]}}, "
               f"open({str(seen)!r}, 'w'))")
    facts = {"env": {"FPS": "1"}}
    for cap, expected in ((12.0, "12.0"), (0.0, "")):
        opts = stand_in_options(tmp_path / f"cap{cap:g}", records, memory_cap_gib=cap)
        run = peer_swift.run_swift(opts, facts, tmp_path / f"out{cap:g}", "ours")
        recorded = json.loads(seen.read_text())
        assert run["returncode"] == 0 and recorded["cap"] == expected
        assert recorded["argv"][0] == "-c" and "set_per_process_memory_fraction" in recorded["argv"][1]
        assert ("simulated 12.0 GiB card" in run["command"]) == bool(cap)


def test_ms_swift_runs_without_deepspeed_when_asked_as_one_gpu_s_users_run_it(tmp_path):
    bare = peer_swift.swift_arguments(Path("m"), "qwen3_5", Path("d"), tmp_path, "ours", 8, LORA, "cuda", 4096, "none")
    staged = peer_swift.swift_arguments(Path("m"), "qwen3_5", Path("d"), tmp_path, "ours", 8, LORA, "cuda", 4096, "zero2")
    assert "--deepspeed" not in bare and bare[bare.index("--torch_dtype") + 1] == "bfloat16"
    assert staged[staged.index("--deepspeed") + 1] == "zero2"
    assert [a for a in staged if a not in ("--deepspeed", "zero2")] == bare


def test_recommended_packs_one_epoch_with_the_flash_attention_asked_for(tmp_path):
    args = peer_swift.swift_arguments(Path("m"), "qwen3_5", Path("d"), tmp_path, "recommended", None, LORA, "cuda",
                                      16384, None, "flash_attention_4")
    value = lambda flag: args[args.index(flag) + 1]  # noqa: E731
    assert "--max_steps" not in args and value("--num_train_epochs") == "1"
    assert value("--attn_impl") == "flash_attention_4" and value("--packing") == "true"
    assert value("--max_length") == "16384" and value("--deepspeed") == "zero2"


def test_packing_names_the_deepspeed_stage_ms_swift_ran_under():
    stage = lambda settings, asked, gpu=True: packing.swift_deepspeed_stage(  # noqa: E731
        argparse.Namespace(swift_settings=settings, swift_deepspeed=asked), gpu)
    assert (stage("ours", None), stage("recommended", None)) == ("zero3", "zero2")
    assert stage("ours", "none") is None and stage("recommended", "zero3") == "zero3"
    assert stage("ours", None, gpu=False) is None


def test_ms_swift_s_process_reads_the_pth_files_of_its_path_folders(tmp_path):
    # pip install --target folders travel on PYTHONPATH, where Python skips .pth files; nvidia-cutlass-dsl
    # (flash-attn-4's) puts its packages on the path by one
    folder, ran = tmp_path / "site", tmp_path / "ran"
    folder.mkdir()
    (folder / "marker.pth").write_text(f"import pathlib; pathlib.Path({str(ran)!r}).write_text('yes')\n")
    env = {**os.environ, "PYTHONPATH": str(folder)}
    done = subprocess.run([sys.executable, "-c", peer_swift.STEP_TIMER, str(tmp_path / "steps.jsonl")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert ran.read_text() == "yes", done.stderr[-2000:]  # before ms-swift's import, which fails here


def test_flash_attn_4_is_given_ints_where_transformers_passes_a_tensor(tmp_path, monkeypatch):
    # flash-attn-4 is not installed here: a stand-in records the types its varlen entry point receives
    package = tmp_path / "flash_attn" / "cute"
    package.mkdir(parents=True)
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("def flash_attn_varlen_func(q, **kwargs):\n"
                                         "    return {key: type(value).__name__ for key, value in kwargs.items()}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PEER_FA4_SEQLEN_AS_INT", "1")
    exec(peer_swift.FA4_SEQLEN_AS_INT, {"os": os})
    import flash_attn.cute as fa4
    seen = fa4.flash_attn_varlen_func(None, max_seqlen_q=torch.tensor(13369), max_seqlen_k=torch.tensor(13369),
                                      cu_seqlens_q=torch.tensor([0, 13369]))
    assert seen == {"max_seqlen_q": "int", "max_seqlen_k": "int", "cu_seqlens_q": "Tensor"}
    assert peer_swift.FA4_SEQLEN_AS_INT in peer_swift.STEP_TIMER
    for mod in [m for m in sys.modules if m.split(".")[0] == "flash_attn"]:
        monkeypatch.delitem(sys.modules, mod)


def test_the_flash_attn_4_shim_is_asked_for_and_shown_only_with_flash_attn_4(tmp_path):
    seen = tmp_path / "seen.txt"
    records = (f"open({str(seen)!r}, 'w').write(os.environ.get('PEER_FA4_SEQLEN_AS_INT', '') + "
               f"os.environ.get('FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED', ''))")
    for attn, expected in (("flash_attention_4", "11"), ("flash_attn", "")):  # the shim, and the kernels' disk cache
        opts = stand_in_options(tmp_path / attn, records, attn_impl=attn)
        run = peer_swift.run_swift(opts, {"env": {}}, tmp_path / attn, "recommended")
        assert seen.read_text() == expected
        assert ("flash-attn-4 given max_seqlen as int" in run["command"]) == bool(expected)


def test_ms_swift_is_timed_over_its_last_epoch_as_ours_over_our_last_pass(demo_config, tmp_path):
    """With --passes 2 both trainers run the epoch twice and time the second (every kernel compiled by then,
    whichever ran first): the stand-in's first epoch is slow, as compiling is, and must not count; ms-swift's
    own packs are checked to hold one epoch's windows."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(demo_config["model"]["path"])
    made = argparse.Namespace(annotations=None, samples=4, window_seconds=16.0, fps=1.0, max_frames=128,
                              frame_size=[64, 64])
    rows = packing.make_real_samples(processor, made)
    epoch_tokens = sum(row["input_tokens"] for row in rows) + 6 * len(rows)  # its template: 6 more a window
    records = (  # two packs an epoch (or a window a step with --max_steps), the first epoch 5 s a step
        "args = sys.argv[4:]\n"
        "epochs = int(args[args.index('--num_train_epochs') + 1]) if '--num_train_epochs' in args else None\n"
        f"per_epoch = [{epoch_tokens // 2}, {epoch_tokens - epoch_tokens // 2}] if epochs else "
        f"[{', '.join(str(row['input_tokens'] + 6) for row in rows)}]\n"
        "steps = per_epoch * epochs if epochs else (per_epoch * 2)[:int(args[args.index('--max_steps') + 1])]\n"
        "with open(sys.argv[3], 'w') as out:\n"
        "    for k, tokens in enumerate(steps):\n"
        "        seconds = 5.0 if k < len(steps) // 2 else 1.0\n"
        "        out.write(json.dumps({'step': k, 'step_seconds': seconds, 'tokens': tokens, 'loss': 2.0, "
        "'peak_allocated_gib': 0.0, 'peak_reserved_gib': 0.0}) + '\\n')\n")
    stand_in = stand_in_options(tmp_path / "stand-in", records)
    for settings in ("recommended", "ours"):
        opts = argparse.Namespace(work=tmp_path / settings, swift_settings=settings, pack_tokens=16384, passes=2,
                                  warmup=2, swift_python=stand_in.swift_python, swift_path=None,
                                  fla_hopper_guard="off", swift_deepspeed=None, swift_attn="flash_attn",
                                  memory_cap_gib=0.0)
        swift = packing.run_swift_mode(list(range(len(rows))), rows, stand_in.model,
                                       processor.video_processor.merge_size,
                                       torch.device("cpu"), opts, lambda indices: float(len(indices)))
        assert "failed" not in swift, swift
        per_epoch = 2 if settings == "recommended" else len(rows)
        assert swift["micro_batches"] == per_epoch and swift["passes"] == 2
        assert swift["swift_tokens"] == epoch_tokens and swift["extra_tokens_per_window"] == [6, 6]
        assert swift["tokens_per_second"] == pytest.approx(epoch_tokens / per_epoch)  # 1 s steps only
        assert swift["samples"] == pytest.approx(len(rows))
