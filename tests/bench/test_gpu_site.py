"""bench/gpu_site.sh (the GPU machine's pack of packages) parses, and every package it packs has a pinned version."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_site.sh"
FLA = {"fla-core", "flash-linear-attention"}  # pinned by pyproject.toml's `gpu` extra instead


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_package_has_a_version_in_constraints():
    array = re.search(r"^PACKAGES=\((.*?)\)", SCRIPT.read_text(), re.S | re.M)
    assert array, "no PACKAGES=( ... ) array in bench/gpu_site.sh"
    packages = array.group(1).split()
    pinned = {line.split("==")[0].strip().lower()
              for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line}
    assert "deepspeed" in packages and FLA <= set(packages)
    assert [p for p in packages if p not in pinned and p not in FLA] == []
    assert '"flash-linear-attention==' in (ROOT / "pyproject.toml").read_text()
