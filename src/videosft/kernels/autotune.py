"""fla's Triton autotuning choices, kept per GPU model so that a fresh machine does not autotune again.

Each of fla's autotuned kernels benchmarks all its candidate configurations (block sizes, warps,
pipeline stages) the first time it meets a key (the shapes and dtypes it is tuned on) and keeps
the winner in its own choice cache. On a fresh H200 that cost 323 s and 365 compiles before the
first training step (bench/RESULTS.md, issue 18); Triton's cache directory, which a fresh machine
does not have, is the only place the choices survive. Here they survive in a table per GPU model:

* :func:`save` writes the choices every autotuner made in this process (the train stage writes
  ``results/train/autotune.json`` on rank 0 whenever fla ran);
* :func:`restore` puts a table's choices back into the autotuners' choice caches, exactly where
  autotuning would have put them, so each kernel compiles once and runs without benchmarking.
  A choice is restored only if the installed kernel still offers that configuration.
* Some keys follow the sequence length (fla's norms key on a row-block count), so another frame
  count or a dataset of varying lengths meets keys the table lacks; each would autotune mid-run
  (about 20 s, and Triton's benchmark allocates a 256 MB buffer on top of the step's peak). A
  kernel's restored cache therefore answers such a key with the choice for the table's nearest
  key (:class:`NearestChoices`), but only where the new key differs from it in positions the
  table's own keys for that kernel differ in (the lengths it was made at), never in a head size,
  dtype or flag; any other key autotunes as before.

``VIDEOSFT_AUTOTUNE`` picks the table: ``table`` (default) the one shipped for this GPU model in
``autotune_tables/<GPU>.json``, if any; ``full`` none (autotune everything); or a table's path (a
``results/train/autotune.json`` from a run on the same GPU model).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import re
import signal
import sys
from pathlib import Path

from ..errors import ConfigError
from ..provenance import package_versions

ENV = "VIDEOSFT_AUTOTUNE"
TABLES = Path(__file__).with_name("autotune_tables")
VERSION = 1
PACKAGES = ("triton", "fla-core")  # what a table's choices depend on, recorded beside them


def gpu_model(device) -> str:
    """The file-name form of the GPU model's name ('NVIDIA H200' -> 'NVIDIA_H200')."""
    import torch

    return re.sub(r"[^0-9A-Za-z]+", "_", torch.cuda.get_device_name(device)).strip("_")


def autotuners(prefix: str = "fla") -> dict[str, object]:
    """Every Triton autotuner defined in the loaded modules under ``prefix``, by 'module.kernel'."""
    from triton.runtime.autotuner import Autotuner

    found = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == prefix or name.startswith(prefix + ".")):
            continue
        for value in list(vars(module).values()):
            for _ in range(4):  # an autotuner may sit under @triton.heuristics wrappers
                if isinstance(value, Autotuner):
                    kernel = value.base_fn
                    found[f"{kernel.__module__}.{kernel.__name__}"] = value
                    break
                value = getattr(value, "fn", None)
    return found


def describe(config) -> dict:
    """A Triton config as JSON: what distinguishes one candidate from another."""
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": getattr(config, "num_ctas", 1), "maxnreg": getattr(config, "maxnreg", None)}


def choices(tuners: dict[str, object]) -> dict[str, list]:
    """Per kernel, [key, config] for every key autotuned (or restored) in this process; keys answered
    with a nearest key's choice are left out (nothing was tuned for them)."""
    tables = {}
    for name, tuner in sorted(tuners.items()):
        borrowed = getattr(tuner.cache, "borrowed", {})
        entries = [[list(key), describe(config)] for key, config in tuner.cache.items() if key not in borrowed]
        if entries:
            tables[name] = entries
    return tables


def varying_positions(keys: list[tuple]) -> set[int]:
    """The positions in which a kernel's keys (of one length) differ: those that follow the shapes
    the table was made at."""
    return {i for i in range(len(keys[0])) if len({key[i] for key in keys}) > 1} if keys else set()


def _numeric(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def nearest_key(key: tuple, known: list[tuple]) -> tuple | None:
    """The known key closest to ``key`` (by log-ratio of the differing sizes) among those that differ
    from it only in positions where the known keys differ among themselves; None if there is none."""
    same_length = [k for k in known if len(k) == len(key)]
    free = varying_positions(same_length)
    best, best_distance = None, math.inf
    for candidate in same_length:
        differing = [i for i, (a, b) in enumerate(zip(key, candidate)) if a != b]
        if not all(i in free and _numeric(key[i]) and _numeric(candidate[i]) for i in differing):
            continue
        distance = sum(abs(math.log2((key[i] + 1) / (candidate[i] + 1))) for i in differing)
        if distance < best_distance:
            best, best_distance = candidate, distance
    return best


class NearestChoices(dict):
    """A kernel's choice cache (Triton's ``Autotuner.cache``, consulted with ``key in cache`` before
    benchmarking) that answers an unknown key with the choice of its :func:`nearest_key` among the
    restored ones. ``borrowed`` maps each such key to the key whose choice it took."""

    def __init__(self, restored: dict, log: list):
        super().__init__(restored)
        self.borrowed: dict[tuple, tuple] = {}
        self.log = log

    def __contains__(self, key) -> bool:
        if dict.__contains__(self, key):
            return True
        nearest = nearest_key(tuple(key), [known for known in self if known not in self.borrowed])
        if nearest is None:
            return False
        self[key] = self[nearest]
        self.borrowed[key] = nearest
        self.log.append(f"{list(key)} <- {list(nearest)}")
        return True


def restore(kernels: dict[str, list], tuners: dict[str, object]) -> dict:
    """Fill the autotuners' choice caches from a table's ``kernels``; counts of what was and was not restored."""
    restored, stale, absent, borrowed = 0, [], [], {}
    for name, entries in kernels.items():
        tuner = tuners.get(name)
        if tuner is None:
            absent.append(name)
            continue
        candidates = {json.dumps(describe(config), sort_keys=True, default=str): config for config in tuner.configs}
        for key, config in entries:
            match = candidates.get(json.dumps(config, sort_keys=True, default=str))
            if match is None:
                stale.append(name)
                continue
            tuner.cache.setdefault(tuple(key), match)
            restored += 1
        if tuner.cache and not isinstance(tuner.cache, NearestChoices):
            tuner.cache = NearestChoices(tuner.cache, borrowed.setdefault(name, []))
    # `borrowed` fills while the run goes on: the run record, written at the end, lists those keys
    return {"restored": restored, "stale": sorted(set(stale)), "absent": sorted(absent), "borrowed": borrowed}


def table_path(device, requested: str | None = None) -> Path | None:
    requested = requested or os.environ.get(ENV, "table")
    if requested == "full":
        return None
    if requested == "table":
        path = TABLES / f"{gpu_model(device)}.json"
        return path if path.exists() else None
    path = Path(requested)
    if not path.is_file():
        raise ConfigError(f"{ENV}={requested}: no such file; give a results/train/autotune.json of a run on this "
                          "GPU model, 'table' (the shipped one, if any) or 'full'")
    return path


def apply(device, requested: str | None = None) -> dict:
    """Restore this GPU model's table into fla's autotuners; what the run record keeps. Call it before
    any of fla's kernels runs (the kernel checks are the first)."""
    record = {"requested": requested or os.environ.get(ENV, "table"), "table": None, "restored": 0}
    if device.type != "cuda" or importlib.util.find_spec("fla") is None:
        return record
    try:
        importlib.import_module("fla")  # defines every autotuner: its layers import all of its kernels
    except Exception as error:  # noqa: BLE001 - the kernel selection reports a broken fla, with its remedy
        record["error"] = f"fla does not import: {type(error).__name__}: {error}"
        return record
    path = table_path(device, requested)
    if path is None:
        return record
    try:
        table = json.loads(path.read_text())
        kernels = table["kernels"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"{path}: not an autotune table ({error}); remove it or set {ENV}=full") from None
    record.update(table=str(path), table_versions=table.get("versions"),
                  installed_versions=package_versions(PACKAGES),
                  **restore(kernels, autotuners()))
    return record


def summary(record: dict) -> str:
    """One log line for what :func:`apply` did, so that a first run's log says whether it will autotune."""
    if record.get("error"):
        return f"autotune: {record['error']}"
    if record["table"] is None:
        return f"autotune: no table restored ({ENV}={record['requested']}); fla's kernels autotune on first use"
    line = f"autotune: {record['restored']} choices restored from {record['table']}"
    if record.get("stale"):
        line += f"; the installed kernels no longer offer the choices for {', '.join(record['stale'])}"
    return line


def save(path: Path, gpu: str, command: str = "", prefix: str = "fla") -> int:
    """Write this process's autotuning choices as a table for the GPU model ``gpu`` (:func:`gpu_model`);
    the number of kernels."""
    kernels = choices(autotuners(prefix))
    if kernels:
        Path(path).write_text(json.dumps({"version": VERSION, "gpu": gpu, "versions": package_versions(PACKAGES),
                                    "written_by": command, "kernels": kernels}, indent=1, default=str) + "\n")
    return len(kernels)


def save_when_stopped(path: Path, gpu: str, command: str = "", prefix: str = "fla") -> None:
    """Also :func:`save` when the process is stopped (SIGTERM: a deadline, Slurm's time limit,
    scancel): a first run stopped while autotuning still leaves the choices it made to the next."""
    previous = signal.getsignal(signal.SIGTERM)

    def stopped(signum, frame):
        try:
            save(path, gpu, command, prefix)
        finally:  # the stop goes on, saved or not
            if callable(previous):
                previous(signum, frame)
            else:  # the default (or ignored) disposition, as if this handler had never been there
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
                os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, stopped)
