"""Configuration: the JSON schema with defaults, and the sections each stage reads.

Snakemake validates ``config.yaml`` against ``workflow/schemas/config.schema.yaml`` and passes
each stage only the sections it reads (``STAGE_SECTIONS``), as JSON on the command line. Run
by hand, a stage takes the path of a YAML file instead and gets the same defaults from here.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import yaml

from .errors import ConfigError

PROJECT_DIR = Path(__file__).resolve().parents[2]
SCHEMA_PATH = PROJECT_DIR / "workflow" / "schemas" / "config.schema.yaml"

# Which config sections each stage reads. Editing a section reruns exactly these stages
# (and, through their outputs, the stages after them).
STAGE_SECTIONS = {
    "demo": ["demo", "prompt:system"],  # the system line is also the pretraining's (demo.pretrain)
    "window": ["data", "window"],
    "preprocess": ["data", "model", "video", "prompt", "preprocess"],
    # the memory plan needs only what shapes the peak, so changing e.g. train.steps keeps the probe
    "probe": ["model", "lora", "memory", "train:precision,gradient_checkpointing,offload_activations,"
              "gather_whole_blocks,fused_kernels,deepspeed_config,micro_batch_size,pack_tokens"],
    "train": ["model", "lora", "train"],
    "verify": ["model", "verify"],
    "report": ["report"],  # and the other stages' outputs
    "predict": ["data", "model", "window", "video", "prompt", "predict"],
    "export": ["model", "export"],
}


def _fill_defaults(schema: dict, instance: dict) -> None:
    for key, subschema in schema.get("properties", {}).items():
        if key not in instance and "default" in subschema:
            instance[key] = json.loads(json.dumps(subschema["default"]))
        if isinstance(instance.get(key), dict) and subschema.get("type") == "object":
            _fill_defaults(subschema, instance[key])


def resolve(config: dict | None) -> dict:
    """Validate a config dict and fill every default from the schema."""
    schema = yaml.safe_load(SCHEMA_PATH.read_text())
    config = json.loads(json.dumps(config or {}))
    _fill_defaults(schema, config)
    try:
        jsonschema.validate(config, schema)
    except jsonschema.ValidationError as error:
        where = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        raise ConfigError(f"config key {where}: {error.message}; see {SCHEMA_PATH.relative_to(PROJECT_DIR)} for "
                          "every key, its meaning and default") from None
    return config


def stage_config(stage: str, config: dict) -> dict:
    """The sections (or, for ``section:key,key``, the keys of a section) that ``stage`` reads."""
    picked = {}
    for entry in STAGE_SECTIONS[stage]:
        section, _, keys = entry.partition(":")
        picked[section] = {k: config[section][k] for k in keys.split(",")} if keys else config[section]
    return picked


def load(argument: str, stage: str) -> dict:
    """A stage's ``--config``: inline JSON (from Snakemake) or the path of a YAML file."""
    if argument.lstrip().startswith("{"):
        config = json.loads(argument)
    else:
        path = Path(argument)
        if not path.exists():
            raise ConfigError(f"config file {path} not found; give the path of a YAML config file, or inline JSON")
        config = yaml.safe_load(path.read_text()) or {}
    return stage_config(stage, resolve(config))
