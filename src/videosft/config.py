"""Configuration: the JSON schema with defaults, the sections each stage reads, and typed views of them.

Snakemake validates ``config.yaml`` against ``workflow/schemas/config.schema.yaml`` and passes
each stage only the sections it reads (``STAGE_SECTIONS``), as JSON on the command line. Run
by hand, a stage takes the path of a YAML file instead and gets the same defaults from here.

A stage reads its config through a view (:func:`load`): a frozen object whose attributes are
exactly the schema's keys (``cfg.train.micro_batch_size``), made from the schema itself, so the
defaults live in one place and a misspelt key fails where it is read instead of reading ``None``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path
from typing import Any, Optional

import jsonschema
import yaml

from .errors import ConfigError

PROJECT_DIR = Path(__file__).resolve().parents[2]
SCHEMA_PATH = PROJECT_DIR / "workflow" / "schemas" / "config.schema.yaml"

# The train keys that shape the memory peak: what the probe's plan reads (so that e.g. changing
# train.steps keeps the probe) and what the train stage's own prediction is made from.
MEMORY_PLAN_KEYS = ("precision", "gradient_checkpointing", "offload_activations", "uncheckpointed_layers",
                    "gather_whole_blocks", "fused_kernels", "deepspeed_config", "micro_batch_size", "pack_tokens",
                    "sequence_parallel", "zero3_on_one_rank")

# Which config sections each stage reads. Editing a section reruns exactly these stages
# (and, through their outputs, the stages after them).
STAGE_SECTIONS = {
    "demo": ["demo", "prompt:system"],  # the system line is also the pretraining's (demo.pretrain)
    "window": ["data", "window"],
    "preprocess": ["data", "model", "video", "prompt", "preprocess"],
    "probe": ["model", "lora", "memory", "train:" + ",".join(MEMORY_PLAN_KEYS)],
    "train": ["model", "lora", "train"],
    "verify": ["model", "verify"],
    "report": ["report"],  # and the other stages' outputs
    "predict": ["data", "model", "window", "video", "prompt", "predict"],
    "export": ["model", "export"],
}


@functools.cache
def schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def _fill_defaults(schema_: dict, instance: dict) -> None:
    for key, subschema in schema_.get("properties", {}).items():
        if key not in instance and "default" in subschema:
            instance[key] = json.loads(json.dumps(subschema["default"]))
        if isinstance(instance.get(key), dict) and subschema.get("type") == "object":
            _fill_defaults(subschema, instance[key])


# Snakemake reads a nested --config value with YAML's BaseLoader, which keeps every scalar a string:
# ``--config "predict={'render': True, 'batch_size': 8}"`` arrives as {'render': 'True', 'batch_size': '8'}.
# Such a string is read as the boolean, number or null it spells, but only where the schema allows no
# string: where it does (a query, a path), the text stays as given, even 'True' or 'null'.
_BOOLEANS = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}
_NULLS = {"null", "none", "~", ""}
_INTEGER = re.compile(r"[-+]?\d+")
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _kinds(subschema: dict) -> set[str]:
    kinds = subschema.get("type", ())
    return set(kinds if isinstance(kinds, list) else [kinds])


def _typed_scalar(text: str, kinds: set[str]):
    word = text.strip()
    if "boolean" in kinds and word.lower() in _BOOLEANS:
        return _BOOLEANS[word.lower()]
    if "null" in kinds and word.lower() in _NULLS:
        return None
    if "integer" in kinds and _INTEGER.fullmatch(word):
        return int(word)
    if "number" in kinds and _NUMBER.fullmatch(word):
        return float(word)
    return text  # not what the schema asks: validation names the key and what it must be


def typed_strings(value: Any, subschema: dict) -> Any:
    """``value`` with each string that stands where ``subschema`` asks for a boolean, integer, number or
    null (and allows no string) read as one, as Snakemake's --config parser leaves them strings."""
    if isinstance(value, dict):
        properties = subschema.get("properties", {})
        return {key: typed_strings(item, properties[key]) if key in properties else item
                for key, item in value.items()}
    if isinstance(value, list) and isinstance(subschema.get("items"), dict):
        return [typed_strings(item, subschema["items"]) for item in value]
    if isinstance(value, str) and "string" not in _kinds(subschema) and _kinds(subschema):
        return _typed_scalar(value, _kinds(subschema))
    return value


def resolve(config: dict | None) -> dict:
    """Validate a config dict and fill every default from the schema; every problem is named at once.
    Strings where the schema asks for another type are read as that type first (:func:`typed_strings`)."""
    config = typed_strings(json.loads(json.dumps(config or {})), schema())
    _fill_defaults(schema(), config)
    found = problems(config)
    if found:
        raise ConfigError("\n".join(found) + f"\n(every key, its meaning and default: "
                          f"{SCHEMA_PATH.relative_to(PROJECT_DIR)})")
    return config


# What a JSON-schema keyword asks of a value, in words.
_ASKED = {"minimum": "at least {}", "exclusiveMinimum": "more than {}", "maximum": "at most {}",
          "exclusiveMaximum": "less than {}", "minItems": "at least {} items", "enum": "one of {}",
          "type": "of type {}"}


def problems(config: dict) -> list[str]:
    """One line per problem of ``config`` against the schema: the key, its value, what is allowed, and
    for an unknown key the nearest known one. ``VIDEOSFT_DEBUG=1`` adds jsonschema's own account."""
    import difflib
    import os

    lines = []
    for error in sorted(jsonschema.Draft202012Validator(schema()).iter_errors(config), key=lambda e: list(e.path)):
        where = ".".join(str(part) for part in error.absolute_path)
        if error.validator == "additionalProperties":
            known = sorted(error.schema.get("properties", {}))
            for key in sorted(set(error.instance) - set(known)):
                name = f"{where}.{key}" if where else key
                near = difflib.get_close_matches(key, known, n=1)
                hint = f"did you mean {(where + '.') if where else ''}{near[0]}?" if near else \
                    f"known keys here: {', '.join(known)}"
                lines.append(f"config key {name}: not a key of the config; {hint}")
        else:
            value = error.validator_value
            value = " or ".join(map(str, value)) if isinstance(value, list) else value
            asked = _ASKED.get(error.validator, "").format(value) or error.message
            lines.append(f"config key {where or '(top level)'}: {json.dumps(error.instance)} is not allowed; "
                         f"it must be {asked}")
        if os.environ.get("VIDEOSFT_DEBUG") == "1":
            lines.append(f"  (jsonschema: {error})")
    return lines


def stage_config(stage: str, config: dict) -> dict:
    """The sections (or, for ``section:key,key``, the keys of a section) that ``stage`` reads."""
    picked = {}
    for entry in STAGE_SECTIONS[stage]:
        section, _, keys = entry.partition(":")
        picked[section] = {k: config[section][k] for k in keys.split(",")} if keys else config[section]
    return picked


# ---------------------------------------------------------------- views

_TYPES = {"integer": int, "number": float, "string": str, "boolean": bool, "array": list, "object": dict}


class View:
    """Base of the generated section views: read-only attributes, and the plain dict back for records."""

    def as_dict(self) -> dict:
        return {field.name: _plain(getattr(self, field.name)) for field in dataclasses.fields(self)}

    def replace(self, **changes) -> "View":
        """A copy with some keys changed, as given: not validated again (stages never change their config;
        tools and tests that vary one key do)."""
        return dataclasses.replace(self, **changes)


def _plain(value: Any) -> Any:
    return value.as_dict() if isinstance(value, View) else value


def _annotation(subschema: dict):
    kinds = subschema.get("type", "object")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    types = [_TYPES[kind] for kind in kinds if kind != "null"]
    annotation = types[0] if len(types) == 1 else Any
    return Optional[annotation] if "null" in kinds else annotation


@functools.cache
def _view_class(path: tuple[str, ...], keys: tuple[str, ...] | None = None) -> type:
    """The view class of the schema object at ``path`` (only ``keys`` of it, when given)."""
    node = schema()
    for name in path:
        node = node["properties"][name]
    names = keys or tuple(node["properties"])
    fields = [(name, _annotation(node["properties"][name])) for name in names]
    title = "".join(part.title().replace("_", "") for part in path) or "Config"
    return dataclasses.make_dataclass(f"{title}View", fields, bases=(View,), frozen=True)


def _view(path: tuple[str, ...], values: dict, keys: tuple[str, ...] | None = None) -> View:
    node = schema()
    for name in path:
        node = node["properties"][name]
    built = {}
    for name, value in values.items():
        child = node["properties"][name]
        built[name] = _view((*path, name), value) if child.get("type") == "object" and "properties" in child \
            else value
    return _view_class(path, keys)(**built)


def view(sections: dict) -> View:
    """A typed view of config sections as :func:`stage_config` picks them (defaults already filled)."""
    built = {}
    for name, values in sections.items():
        full = set(schema()["properties"][name]["properties"])
        keys = None if set(values) == full else tuple(values)
        built[name] = _view((name,), values, keys)
    return dataclasses.make_dataclass("StageConfig", [(name, View) for name in built], bases=(View,),
                                      frozen=True)(**built)


def section(name: str, overrides: dict | None = None) -> View:
    """One whole section's view, defaults filled and validated: for library calls outside a stage."""
    return _view((name,), resolve({name: overrides or {}})[name])


def for_stage(stage: str, overrides: dict | None = None) -> View:
    """The view ``stage`` gets from a config of ``overrides`` and the defaults."""
    return view(stage_config(stage, resolve(overrides)))


# The config keys that name an input file or directory, with the values that name none.
PATH_KEYS = {"data.annotations": (), "data.root": (), "model.path": (), "train.deepspeed_config": (),
             "predict.videos": ("val",)}


def missing_path(key: str, path: str) -> str:
    """What to say of a config path that does not exist (the workflow says it too, before anything runs)."""
    return (f"config {key}: {path} does not exist (working directory {Path.cwd()}). "
            f"Point {key} at an existing path in your config file or with --config.")


def check_paths(cfg: View) -> None:
    """Every input path among the sections a stage reads exists: a stage run alone stops here, naming the key."""
    for key, exempt in PATH_KEYS.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section, None), name, None)
        if value is not None and value not in exempt and not Path(value).exists():
            raise ConfigError(missing_path(key, value))


def load(argument: str, stage: str) -> View:
    """A stage's ``--config``: inline JSON (from Snakemake) or the path of a YAML file, as its view, its input
    paths checked."""
    if argument.lstrip().startswith("{"):
        config = json.loads(argument)
    else:
        path = Path(argument)
        if not path.exists():
            raise ConfigError(f"config file {path} not found; give the path of a YAML config file, or inline JSON")
        config = yaml.safe_load(path.read_text()) or {}
    cfg = for_stage(stage, config)
    check_paths(cfg)
    return cfg


def plain(config: Any) -> Any:
    """A view (or anything else) as plain JSON data: what run records store and hash."""
    return _plain(config)
