"""The base model's checkpoint: its keys mapped onto the model's parameters from safetensors
headers alone, and its weights loaded into the model and verified against the file.

A checkpoint written by one transformers release (or layout: Qwen2.5-VL's ``model.layers.*`` and
``visual.*``, Qwen3-VL / Qwen3.5's ``model.language_model.*`` and ``model.visual.*``; each family's
``checkpoint`` record in :mod:`videosft.models.families`) is mapped onto the parameter names of the
model this transformers builds, with transformers' own conversion rules, so both always agree on
what a key means (:func:`read_checkpoint`, :func:`map_checkpoint`).
The probe writes the map; the loader here (:func:`load_checkpoint`, used by the trainer) reads it,
so the two can never disagree, and then compares every loaded element with the file
(:func:`verify_loaded`; under ZeRO-3 each rank its own partition); :func:`read_tensors` reads tensors as
stored (the export copies the ones the model does not hold). :func:`model_class` and
:func:`build_meta_model` say which transformers class every stage builds; :func:`tokenizer_agreement`
checks that the tokenizer, processor and config the checkpoint ships with agree.
"""

from __future__ import annotations

import json
import struct
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from .families import family_of

SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(UserError, ValueError):
    """The checkpoint cannot be loaded into the model; the message says what and where."""


@dataclass
class TensorInfo:
    key: str
    shard: str
    dtype: str
    shape: list[int]
    nbytes: int = 0


def read_header(path: Path) -> dict[str, dict]:
    """The JSON header of a safetensors file, checked against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors header (truncated download?)")
        (length,) = struct.unpack("<Q", raw)
        if 8 + length > size:
            raise CheckpointError(f"{path}: header of {length} bytes runs past the file end ({size} bytes); re-download it")
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    data_size = size - 8 - length
    for key, entry in header.items():
        begin, end = entry["data_offsets"]
        if end > data_size:
            raise CheckpointError(
                f"{path}: tensor {key} ends at byte {end} of the data but the file holds {data_size}; "
                "the file is truncated, re-download it"
            )
    return header


def read_checkpoint(model_dir: Path) -> dict[str, TensorInfo]:
    """Every tensor of a single-file or sharded checkpoint, from headers only."""
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_NAME
    if index_path.exists():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (model_dir / s).exists()]
        if missing:
            raise CheckpointError(f"{index_path} names shards that are missing: {missing}")
    elif (model_dir / SINGLE_NAME).exists():
        weight_map, shards = None, [SINGLE_NAME]
    else:
        raise CheckpointError(f"{model_dir} has neither {INDEX_NAME} nor {SINGLE_NAME}")
    tensors: dict[str, TensorInfo] = {}
    for shard in shards:
        for key, entry in read_header(model_dir / shard).items():
            if key in tensors:
                raise CheckpointError(f"key {key} is in two shards: {tensors[key].shard} and {shard}")
            dtype = SAFETENSORS_DTYPES.get(entry["dtype"], entry["dtype"])
            begin, end = entry["data_offsets"]
            tensors[key] = TensorInfo(key, shard, dtype, list(entry["shape"]), end - begin)
    if weight_map is not None:
        misplaced = [k for k, s in weight_map.items() if k in tensors and tensors[k].shard != s]
        absent = [k for k in weight_map if k not in tensors]
        if misplaced or absent:
            raise CheckpointError(
                f"{index_path} disagrees with the shard headers: {len(absent)} keys absent "
                f"(e.g. {absent[:3]}), {len(misplaced)} in another shard (e.g. {misplaced[:3]})"
            )
    return tensors


def model_class(config):
    """The class its family's record names for a config (:mod:`videosft.models.families`), imported now;
    a model of no known family is an error naming the known ones.

    Importing a modeling module inside ``deepspeed.zero.Init`` breaks (Init patches tensor
    constructors that torch.compile's decorators inspect at import), so callers resolve the class
    first and build inside the context afterwards.
    """
    return family_of(config).transformers_class()


def build_meta_model(model_dir: Path):
    """The model that ``model_dir``'s config describes, on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    cls = model_class(config)
    with torch.device("meta"):
        return cls._from_config(config)


def expected_tensors(model) -> dict[str, list[str]]:
    """Persistent state of the model, tied names grouped: canonical name -> all its names."""
    groups: dict[int, list[str]] = defaultdict(list)
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups[id(tensor)].append(name)
    return {names[0]: names for names in groups.values()}


def rename_key(key: str, renamings, converters, prefix: str | None, meta_names: dict) -> str:
    from transformers.core_model_loading import rename_source_key

    renamed, converter = rename_source_key(key, renamings, converters, prefix, meta_names)
    if converter is not None:
        raise CheckpointError(f"checkpoint key {key} needs a tensor conversion ({converter}); not supported here")
    return renamed


@dataclass
class Report:
    key_map: dict[str, str] = field(default_factory=dict)  # checkpoint key -> canonical model name
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)  # extras the model class declares ignorable: never loaded
    shape_mismatch: list[dict] = field(default_factory=list)
    dtype_mismatch: list[dict] = field(default_factory=list)
    renamed: int = 0

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.shape_mismatch or self.dtype_mismatch)

    def problems(self) -> str:
        lines = []
        for title, names in (("missing from the checkpoint", self.missing), ("unexpected in the checkpoint", self.unexpected)):
            if names:
                lines.append(f"{len(names)} parameters {title}:")
                lines.extend(f"  {prefix}: {len(group)} (e.g. {', '.join(group[:3])})"
                             for prefix, group in group_by_prefix(names).items())
        for entry in self.shape_mismatch:
            lines.append(f"shape of {entry['key']}: checkpoint {entry['checkpoint']} vs model {entry['model']}")
        for entry in self.dtype_mismatch:
            lines.append(f"dtype of {entry['key']}: checkpoint {entry['checkpoint']} vs config {entry['expected']}")
        return "\n".join(lines)


def group_by_prefix(names: list[str], depth: int = 3) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = defaultdict(list)
    for name in sorted(names):
        parts = [p for p in name.split(".") if not p.isdigit()]
        groups[".".join(parts[:depth])].append(name)
    return dict(groups)


def map_checkpoint(model, tensors: dict[str, TensorInfo], expected_dtype: str | None = None) -> Report:
    """Map every checkpoint key to a model tensor and compare shapes (and dtypes, when given)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    groups = expected_tensors(model)
    alias_to_canonical = {alias: canonical for canonical, aliases in groups.items() for alias in aliases}
    state = model.state_dict(keep_vars=True)
    report = Report()
    for key in sorted(tensors):
        target = rename_key(key, renamings, converters, model.base_model_prefix, state)
        report.renamed += target != key
        canonical = alias_to_canonical.get(target)
        if canonical is None:
            report.unexpected.append(key)
            continue
        if canonical in report.key_map.values():
            continue  # a tied alias saved twice: the first copy loads
        report.key_map[key] = canonical
        info, model_shape = tensors[key], list(state[canonical].shape)
        if info.shape != model_shape:
            report.shape_mismatch.append({"key": key, "checkpoint": info.shape, "model": model_shape})
        if expected_dtype and info.dtype != expected_dtype and info.dtype.startswith(("float", "bfloat")):
            report.dtype_mismatch.append({"key": key, "checkpoint": info.dtype, "expected": expected_dtype})
    mapped = set(report.key_map.values())
    report.missing = [name for name in groups if name not in mapped]
    report.ignored = declared_ignorable(model, report.unexpected)
    report.unexpected = [key for key in report.unexpected if key not in set(report.ignored)]
    return report


def declared_ignorable(model, keys: list[str]) -> list[str]:
    """The checkpoint keys that the model class declares it skips on load, by transformers' own
    rule (``_keys_to_ignore_on_load_unexpected`` of the class and its submodules, and the legacy
    buffers transformers drops): e.g. the multi-token-prediction ``mtp.*`` tensors of published
    Qwen3.5 checkpoints. Every other unexpected key stays an error."""
    from types import SimpleNamespace

    info = SimpleNamespace(missing_keys=set(), unexpected_keys=set(keys))
    model._adjust_missing_and_unexpected_keys(info)
    return sorted(set(keys) - info.unexpected_keys)


def extras_summary(keys: list[str], tensors: dict[str, TensorInfo]) -> dict:
    """Count, bytes and prefixes of checkpoint tensors the model does not use."""
    by_prefix = {prefix: {"count": len(group), "bytes": sum(tensors[key].nbytes for key in group)}
                 for prefix, group in group_by_prefix(keys, depth=1).items()}
    return {"count": len(keys), "bytes": sum(tensors[key].nbytes for key in keys), "by_prefix": by_prefix}


def config_dtype(model) -> str | None:
    """The dtype the model's config declares for its weights (``bfloat16``), or None."""
    dtype = getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None)
    return str(dtype).replace("torch.", "") if dtype is not None else None


def tokenizer_agreement(model_dir: Path, model) -> list[str]:
    """Problems where tokenizer, processor and model config disagree."""
    from transformers import AutoProcessor

    problems = []
    processor = AutoProcessor.from_pretrained(model_dir)
    tokenizer = processor.tokenizer
    config = model.config
    embedding_rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > embedding_rows:
        problems.append(f"tokenizer has {len(tokenizer)} tokens but the embedding has {embedding_rows} rows")
    tokens = family_of(config).vision
    for attribute, token in (("video_token_id", tokens.pad), ("vision_start_token_id", tokens.start),
                             ("vision_end_token_id", tokens.end)):
        in_config = getattr(config, attribute, None)
        in_tokenizer = tokenizer.convert_tokens_to_ids(token)
        if in_config != in_tokenizer:
            problems.append(f"config {attribute}={in_config} but the tokenizer gives {token} id {in_tokenizer}")
    vision = config.vision_config
    video = processor.video_processor
    for attribute, ours in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                            ("spatial_merge_size", "merge_size")):
        if getattr(vision, attribute) != getattr(video, ours):
            problems.append(f"vision config {attribute}={getattr(vision, attribute)} but the video processor "
                            f"has {ours}={getattr(video, ours)}")
    return problems


# Every weight file name transformers saves or reads: the rest of a checkpoint directory is its config
# and its companions (tokenizer, processor, chat template, generation config)
WEIGHT_FILES = (SINGLE_NAME, INDEX_NAME, "pytorch_model.bin", "pytorch_model.bin.index.json")


def companion_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files other than its weights and its config (the files ``save_pretrained`` of the
    model does not write)."""
    return sorted(path for path in Path(model_dir).iterdir()
                  if path.is_file() and not path.name.startswith(".")
                  and path.name not in (*WEIGHT_FILES, "config.json")
                  and not path.name.endswith(".safetensors") and not path.name.endswith(".bin"))


def logical_shape(parameter) -> list[int]:
    """A ZeRO-3 parameter shows shape [0] on each rank; its real shape is ds_shape."""
    return list(getattr(parameter, "ds_shape", parameter.shape))


def load_checkpoint(model, model_dir: Path, key_map: dict) -> dict:
    """Copy each checkpoint tensor into the model's existing parameters, then check every element
    against the file (:func:`verify_loaded`).

    Under ZeRO-3 each rank writes only what it holds (:func:`local_parts`): its partition of each
    parameter, straight from the file, with no gather or broadcast, reading only those rows.
    ``state_dict(keep_vars=True)`` gives the Parameters themselves, never copies.
    """
    import torch
    from safetensors import safe_open

    state = model.state_dict(keep_vars=True)
    started = time.perf_counter()
    for shard, entries in _by_shard(key_map):
        with safe_open(model_dir / shard, framework="pt") as handle:
            for key, name in entries:
                target = state[name]
                shape = list(handle.get_slice(key).get_shape())
                if shape != logical_shape(target):
                    raise ValueError(f"{key}: checkpoint shape {shape} vs model {logical_shape(target)}")
                with torch.no_grad():
                    for part, source in local_parts(target, handle, key):
                        part.copy_(source.to(part.dtype))
    load_seconds = time.perf_counter() - started
    return {"load_seconds": load_seconds, **verify_loaded(model, model_dir, key_map)}


def _by_shard(key_map: dict) -> list[tuple[str, list[tuple[str, str]]]]:
    by_shard: dict[str, list[tuple[str, str]]] = {}
    for key, entry in sorted(key_map.items()):
        by_shard.setdefault(entry["shard"], []).append((key, entry["parameter"]))
    return sorted(by_shard.items())


def local_parts(target, handle, key: str) -> list[tuple[object, object]]:
    """(what this rank holds of a parameter, the matching elements of checkpoint tensor ``key``,
    read from the open safetensors ``handle``).

    A ZeRO-3 parameter's partition on rank ``r`` holds elements ``[r * n, (r + 1) * n)`` of the
    flattened tensor, ``n`` the partition size (DeepSpeed's layout; the last partition is padded),
    so that together the ranks cover every element once, each on its own device (or in host
    memory under offload_param), each reading only the rows its elements lie in. A parameter that
    is whole on this rank (not ZeRO-3, persistent, or gathered now) is also its whole tensor.
    """
    import torch.distributed as dist

    parts = []
    if not hasattr(target, "ds_id") or target.data.numel() == target.ds_numel:
        parts.append((target.data, handle.get_tensor(key)))
    partition = getattr(target, "ds_tensor", None)
    if partition is not None and partition.numel():
        size = partition.ds_numel
        start = size * dist.get_rank(group=target.ds_process_group)
        expected = read_elements(handle, key, start, min(start + size, target.ds_numel))
        parts.append((partition.data.view(-1)[: expected.numel()], expected))
    return parts


def read_tensors(model_dir: Path, tensors: dict[str, TensorInfo], keys: list[str]) -> dict:
    """The named tensors of a checkpoint (``tensors``: its :func:`read_checkpoint`), as stored: their
    dtype and bytes unchanged."""
    from safetensors import safe_open

    by_shard: dict[str, list[str]] = defaultdict(list)
    for key in keys:
        by_shard[tensors[key].shard].append(key)
    read = {}
    for shard, names in sorted(by_shard.items()):
        with safe_open(Path(model_dir) / shard, framework="pt") as handle:
            read.update({name: handle.get_tensor(name) for name in names})
    return read


def read_elements(handle, key: str, start: int, stop: int):
    """Elements ``[start, stop)`` of the flattened tensor ``key``, reading only the rows they lie in."""
    import math

    tensor = handle.get_slice(key)
    shape = tensor.get_shape()
    if len(shape) < 2 or stop <= start:
        return handle.get_tensor(key).reshape(-1)[start:stop]
    row = math.prod(shape[1:])
    first, last = start // row, max(start // row, -(-stop // row))
    return tensor[first:last].reshape(-1)[start - first * row: stop - first * row]


def matches_file(target, handle, key: str) -> bool:
    """Whether what this rank holds of a parameter equals checkpoint tensor ``key``, element for element.

    Compared on this rank's GPU when it has one, also for partitions kept in host memory under
    offload_param (comparing those on the host took 3.6-4.8 s for Qwen3.5-4B, bench/RESULTS.md)."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    return all(torch.equal(part.to(device or part.device), expected.to(device or part.device, part.dtype))
               for part, expected in local_parts(target, handle, key))


def verify_loaded(model, model_dir: Path, key_map: dict) -> dict:
    """Every entry of the checkpoint compared element-wise with the model (cast to the parameter's
    dtype); under ZeRO-3 each rank checks its own partitions and the ranks agree on the outcome.
    Raises ValueError naming the entries that differ."""
    import torch.distributed as dist
    from safetensors import safe_open

    state = model.state_dict(keep_vars=True)
    started = time.perf_counter()
    mismatched = []
    for shard, entries in _by_shard(key_map):
        with safe_open(model_dir / shard, framework="pt") as handle:
            for key, name in entries:
                if not matches_file(state[name], handle, key):
                    mismatched.append(key)
    if dist.is_available() and dist.is_initialized():
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mismatched)
        mismatched = sorted({key for keys in everyone for key in keys})
    verify_seconds = time.perf_counter() - started
    if mismatched:
        raise ValueError(f"after loading, {len(mismatched)} of {len(key_map)} entries differ from the checkpoint: "
                         f"{mismatched[:5]}")
    matched = len(key_map)
    return {"entries": len(key_map), "matched": matched, "verify_seconds": verify_seconds,
            "summary": f"{matched} of {len(key_map)} entries matched"}


def pad_token_id(model_dir: Path) -> int:
    """The checkpoint tokenizer's padding id (0 when it names none: padded positions are masked anyway)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
