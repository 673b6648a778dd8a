"""Run records: what ran, with which interpreter, packages, code and config.

Every stage writes ``run_record.json`` beside its outputs through :func:`run_record`.
The same module tells Snakemake which source files each stage depends on
(:func:`stage_sources`), so the files hashed into the record are exactly the files
whose change reruns the stage.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import gc
import datetime as dt
import hashlib
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any, Iterable, Iterator

from .errors import UserError
from .stage_logs import MESSAGE_START


PACKAGE_DIR = Path(__file__).resolve().parent
PACKAGES = (
    "torch",
    "torchvision",
    "transformers",
    "peft",
    "deepspeed",
    "snakemake",
    "decord",
    "pandas",
    "pyarrow",
    "safetensors",
)
# Environment variables that change what a stage does.
ENV_EXACT = (
    "VIDEO_MIN_TOKEN_NUM",
    "VIDEO_MAX_TOKEN_NUM",
    "CUDA_VISIBLE_DEVICES",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
    "PYTHONPATH",
    "PYTORCH_CUDA_ALLOC_CONF",
    "TRITON_CACHE_DIR",
)
ENV_PREFIXES = ("SLURM_", "VIDEOSFT_")  # every VIDEOSFT_* switch, present and future


STAGES = "stages"  # the subpackage of stage entry points: videosft.stages.<stage>


def stage_module(stage: str) -> str:
    """The dotted module (inside videosft) that runs ``stage``."""
    return f"{STAGES}.{stage}"


def module_file(module: str) -> Path | None:
    """The source file of a dotted module inside videosft (a package's ``__init__.py``), or None."""
    base = PACKAGE_DIR.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def stage_sources(stage: str) -> list[Path]:
    """The stage module and every ``videosft`` module it imports, transitively, with the
    ``__init__.py`` of each package they live in (Python runs those on import too)."""
    seen: set[str] = set()
    todo = [stage_module(stage)]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        if module_file(name) is None:
            raise FileNotFoundError(f"no module videosft.{name} under {PACKAGE_DIR}")
        seen.add(name)
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # enclosing packages
        todo.extend(_local_imports(name))
    return sorted(module_file(name) for name in seen)


def imports(path: Path, package: list[str]) -> list[tuple[int, str, list[str]]]:
    """(line, dotted module inside videosft, names taken from it) for every videosft import of a file,
    at the top or inside a function; ``package``: the file's package inside videosft, for relative
    imports. ``from videosft.stages import train`` takes module ``stages.train`` whole (names ``["*"]``)."""
    found = []
    for node in ast.walk(ast.parse(Path(path).read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            elif node.module and (node.module == "videosft" or node.module.startswith("videosft.")):
                base = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:
                whole = ".".join([*base, alias.name])
                found.append((node.lineno, whole, ["*"]) if module_file(whole) is not None
                             else (node.lineno, ".".join(base), [alias.name]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, ".".join(alias.name.split(".")[1:]), ["*"]) for alias in node.names
                      if alias.name.startswith("videosft.")]
    return found


def _local_imports(module: str) -> set[str]:
    """The videosft modules (dotted, inside the package) that ``module`` imports, anywhere in its body."""
    path = module_file(module)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    return {name for _, name, _ in imports(path, package) if name and module_file(name) is not None}


class StaleCodeError(UserError, RuntimeError):
    pass


def check_code(stage: str, expected: list[str] | None) -> None:
    """Refuse to run if the videosft modules imported are not the files the workflow tracks.

    Snakemake passes the stage's source files (its rule inputs) as ``--code``; an older install
    of videosft elsewhere on the path, or a module list that changed, shows up here.
    """
    if not expected:
        return
    ours = {path.resolve() for path in stage_sources(stage)}
    theirs = {Path(path).resolve() for path in expected}
    if ours != theirs:
        raise StaleCodeError(
            f"videosft.{stage_module(stage)} was imported from {PACKAGE_DIR}, but the workflow tracks "
            f"{sorted(str(p) for p in theirs - ours)[:3]}. Another copy of videosft shadows the checkout: "
            f"run `pip install -e .` in the checkout you run snakemake from."
        )


class EnvironmentMismatch(UserError, RuntimeError):
    pass


# What must be the same in every stage of one run.
MUST_AGREE = ("interpreter", "python")
MUST_AGREE_PACKAGES = ("torch", "transformers", "peft", "deepspeed")
ALLOW_MIXED = "VIDEOSFT_ALLOW_MIXED_ENVIRONMENTS"


def check_environment(record: dict, upstream: list[str] | None) -> None:
    """Fail if this stage runs with another interpreter or core package than the run's earlier stages.

    A rerun of one stage from another environment (an old virtualenv, a different torch) is what
    the field notes lost a day to. Setting VIDEOSFT_ALLOW_MIXED_ENVIRONMENTS=1 allows it on purpose
    (an environment variable, not a config key, so that turning it on reruns nothing).
    """
    if os.environ.get(ALLOW_MIXED) == "1":
        return
    for path in upstream or []:
        theirs = json.loads(Path(path).read_text())
        differences = [(key, record[key], theirs.get(key)) for key in MUST_AGREE
                       if _same_file(record[key]) != _same_file(theirs.get(key))]
        differences += [(f"{name} version", record["packages"].get(name), theirs.get("packages", {}).get(name))
                        for name in MUST_AGREE_PACKAGES
                        if record["packages"].get(name) != theirs.get("packages", {}).get(name)]
        if differences:
            listing = "; ".join(f"{key}: {ours!r} here, {other!r} in {theirs.get('stage')}" for key, ours, other in differences)
            raise EnvironmentMismatch(
                f"stage {record['stage']} runs in another environment than {path}: {listing}. Run every stage "
                f"with the same interpreter and packages (rerun the earlier stages here), or set {ALLOW_MIXED}=1 "
                "to allow it on purpose."
            )


def _same_file(value):
    """Interpreter paths compare by the file they name (torchrun starts `python3.11` for `python`)."""
    return os.path.realpath(value) if isinstance(value, str) and os.path.isabs(value) else value


DEBUG = "VIDEOSFT_DEBUG"


def exit_after(main, hard: bool = False) -> None:
    """Run a stage's ``main`` as the process and exit with its code, skipping the interpreter's
    final garbage collection of the large import graph (torch, transformers): about 1.3 s of every
    stage process (bench/RESULTS.md). Only for `python -m videosft.<stage>`, never in-process.

    A :class:`~videosft.errors.UserError` ends the process with its message and exit code 1, no
    traceback: the message says what is wrong and what to do (the run record keeps the traceback).
    Every other exception is a bug and keeps its traceback; ``VIDEOSFT_DEBUG=1`` keeps it for all.

    ``hard`` ends the process without the interpreter's teardown once the stage's files are
    written (the train stage: a rank has rarely aborted in the teardown of torch.distributed's
    threads, "terminate called without an active exception", after all its work was done)."""
    try:
        code = main()
    except UserError as error:
        if os.environ.get(DEBUG) == "1":
            raise
        kept = getattr(error, "kept_record", None)
        # one write: torchrun starts its ranks unbuffered (python -u), and print's separate write of the
        # newline let another rank's message land inside this one's line
        sys.stderr.write(f"{MESSAGE_START}{error}" + (f"\n(the run record, with the traceback: {kept})" if kept else "")
                         + "\n")
        sys.stderr.flush()
        code = 1
    gc.freeze()
    if hard:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def plain_text(doc: str) -> str:
    """A docstring as a terminal shows it: reST roles and literals (:func:`x`, ``x``) as their text."""
    import re

    doc = re.sub(r":\w+:`~?([^`]+)`", r"\1", doc)
    return re.sub(r"``([^`]+)``", r"\1", doc)


def _program() -> str:
    """How the running stage is started (``python -m videosft.stages.train``), for its usage line."""
    script = Path(sys.argv[0])
    if script.suffix == ".py" and script.resolve().parent == PACKAGE_DIR / STAGES:
        return f"python -m videosft.{STAGES}.{script.stem}"
    return script.name


def stage_parser(doc: str | None) -> argparse.ArgumentParser:
    """The arguments every stage takes: ``--config``, ``--out``, and from Snakemake ``--code``,
    ``--after`` and ``--job``."""
    parser = argparse.ArgumentParser(prog=_program(), description=plain_text(doc or ""),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the config sections as inline JSON, or a YAML config file")
    parser.add_argument("--out", type=Path, required=True, help="output directory; run_record.json lands here")
    parser.add_argument("--code", nargs="*", help="source files the workflow tracks for this stage (set by Snakemake)")
    parser.add_argument("--after", nargs="*", help="run records of earlier stages of the same run: interpreter and "
                        "core package versions must agree with them")
    parser.add_argument("--job", help="the Snakemake job that runs this stage (recorded)")
    # not --log: torchrun, which passes the train stage its arguments, takes that for an ambiguous option of its own
    parser.add_argument("--stage-log", type=Path, help="the stage's log file (Snakemake's log:): a failed stage keeps "
                        "its run record and rejects beside it, since Snakemake removes a failed job's outputs")
    return parser


def existing_path(text: str) -> Path:
    """An input path argument: one that does not exist is a usage error naming it, not a traceback later."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text} does not exist (working directory {Path.cwd()}); give the path "
                                         "of the earlier stage's output")
    return path


def kept_path(args: argparse.Namespace | None, name: str) -> Path | None:
    """Where a stage keeps ``name`` (``run_record.json``, ``rejects.jsonl``) beside its ``--stage-log``
    (``logs/window/window.log`` -> ``logs/window/window.rejects.jsonl``); None without one."""
    log = getattr(args, "stage_log", None)
    return Path(log).with_suffix(f".{name}") if log else None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def path_fingerprint(path: str | Path) -> str:
    """A digest of the size and modification time of a file, or of every file under a directory
    (by relative path, following links, hidden names skipped): what the workflow watches in data
    and checkpoint directories, whose own modification time changes only when entries come or go."""
    root = Path(path)
    files = [root] if root.is_file() else sorted(
        file for file in root.rglob("*")
        if file.is_file() and not any(part.startswith(".") for part in file.relative_to(root).parts))
    digest = hashlib.sha256()
    for file in files:
        stat = file.stat()
        digest.update(f"{file.relative_to(root) if file != root else ''}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return f"{len(files)} files, sha256 {digest.hexdigest()[:16]}"


def source_hashes(stage: str) -> dict[str, str]:
    return {path.relative_to(PACKAGE_DIR).as_posix(): sha256_file(path) for path in stage_sources(stage)}


def config_hash(section: Any) -> str:
    return hashlib.sha256(json.dumps(section, sort_keys=True).encode()).hexdigest()


def package_versions(names: Iterable[str] = PACKAGES) -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def behaviour_env() -> dict[str, str]:
    return {
        key: value
        for key, value in sorted(os.environ.items())
        if key in ENV_EXACT or key.startswith(ENV_PREFIXES)
    }


def git_state() -> dict[str, Any]:
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(
                ["git", *args], cwd=PACKAGE_DIR, capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def devices() -> list[str]:
    if "torch" not in sys.modules:  # stages that never import torch need not pay for it
        return ["cpu"]
    import torch

    if torch.cuda.is_available():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return ["cpu"]


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def base_record(stage: str, config: Any) -> dict[str, Any]:
    config = config.as_dict() if hasattr(config, "as_dict") else config  # a typed view (videosft.config)
    return {
        "stage": stage,
        "status": "running",
        "argv": sys.argv,
        "interpreter": sys.executable,
        "python": platform.python_version(),
        "packages": package_versions(),
        "module_file": str(module_file(stage_module(stage))),
        "sources": source_hashes(stage),
        "config": config,
        "config_sha256": config_hash(config),
        "git": git_state(),
        "env": behaviour_env(),
        "host": socket.gethostname(),
        "started": _now(),
    }


def write_json(path: Path, payload: Any) -> None:
    """Write JSON atomically: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)


# Warnings a user of the pipeline cannot act on, silenced once at a stage's start and named in its run
# record: each was repeated on every step or window, burying the log's progress lines and real problems.
QUIETED_WARNINGS = (
    (FutureWarning, r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
     "torch's deprecation of the collectives DeepSpeed's ZeRO-3 calls (every step)"),
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated",
     "transformers' deprecation of a name DeepSpeed and peft read (every step)"),
)


def quiet_warnings() -> list[str]:
    """Silence :data:`QUIETED_WARNINGS`; what was silenced, for the run record."""
    import warnings

    for category, message, _ in QUIETED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    return [f"{category.__name__}: {why}" for category, _, why in QUIETED_WARNINGS]


@contextlib.contextmanager
def run_record(stage: str, out_dir: Path, config: Any, args: argparse.Namespace | None = None,
               enabled: bool = True) -> Iterator[dict[str, Any]]:
    """Write ``out_dir/run_record.json`` around a stage's work.

    The yielded dict's ``results`` entry is for the stage's own facts (counts, timings).
    The record is written with ``status: ok`` on success and ``status: failed`` plus the
    error on failure; ``enabled=False`` (non-zero ranks) yields a record but writes nothing.
    """
    check_code(stage, getattr(args, "code", None))
    record = base_record(stage, config)
    record["snakemake_job"] = getattr(args, "job", None)
    record["slurm"] = {key: os.environ.get(f"SLURM_{key.upper()}") for key in ("job_id", "job_nodelist")
                       if os.environ.get(f"SLURM_{key.upper()}")}
    check_environment(record, getattr(args, "after", None))
    record["quieted_warnings"] = quiet_warnings()
    record["results"] = {}
    path, kept = Path(out_dir) / "run_record.json", kept_path(args, "run_record.json")
    try:
        yield record
    except BaseException as error:
        record.update(status="failed", error=f"{type(error).__name__}: {error}")
        record["traceback"] = traceback.format_exc()
        if enabled and kept:
            error.kept_record = kept  # exit_after names it: the record in out_dir goes with the failed outputs
        raise
    else:
        record["status"] = "ok"
    finally:
        record["ended"] = _now()
        record["devices"] = devices()
        if enabled:
            write_json(path, record)
            if kept and record["status"] == "failed":
                write_json(kept, record)
            elif kept:
                kept.unlink(missing_ok=True)  # an earlier failure's record would mislead


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: value}


DIFF_FIELDS = ("stage", "interpreter", "python", "packages", "sources", "config", "env", "git", "host", "devices",
               "snakemake_job", "slurm", "status")


def diff(a: dict, b: dict) -> list[tuple[str, Any, Any]]:
    """What differs between two run records, field by field (results and timings left out)."""
    left = flatten({key: a.get(key) for key in DIFF_FIELDS})
    right = flatten({key: b.get(key) for key in DIFF_FIELDS})
    return [(key, left.get(key), right.get(key)) for key in sorted(set(left) | set(right))
            if left.get(key) != right.get(key)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run records. `diff A B` prints what differs between two of them: interpreter, package "
                    "versions, source hashes, config, environment, git state, host, devices.")
    commands = parser.add_subparsers(dest="command", required=True)
    compare = commands.add_parser("diff", help="what differs between two run records")
    compare.add_argument("a", type=Path)
    compare.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    records = [json.loads(path.read_text()) for path in (args.a, args.b)]
    differences = diff(*records)
    if not differences:
        print(f"{args.a} and {args.b} agree on {', '.join(DIFF_FIELDS)}")
        return 0
    width = max(len(key) for key, _, _ in differences)
    print(f"{'':{width}}  {args.a}\n{'':{width}}  {args.b}")
    for key, left, right in differences:
        print(f"{key:{width}}  {left!r}\n{'':{width}}  {right!r}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
