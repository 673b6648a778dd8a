"""Reading the JSON records stages write (:func:`videosft.provenance.write_json`), and the numbers
in them: a value that is not a number (absent, None where nothing counts, or anything else) reads
as not recorded."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def number(value: Any) -> int | float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def numbers(mapping: Mapping, keys: Iterable[str]) -> dict[str, int | float]:
    """The keys of ``mapping`` that hold numbers, in the order of ``keys``."""
    return {key: mapping[key] for key in keys if number(mapping.get(key)) is not None}
