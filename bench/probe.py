"""Probe speed and memory on a 32B-class checkpoint made of sparse files (headers only, data as holes).

    python bench/probe.py

Baseline in the same run: a bare `import torch, transformers` (the floor any probe pays). Prints a
table and the line to put in bench/RESULTS.md.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "stages"))

from test_probe import SPARSE_PROBE, write_sparse_checkpoint  # noqa: E402

BASELINE = """
import json, resource, time
started = time.perf_counter()
import torch, transformers
print(json.dumps({"seconds": time.perf_counter() - started,
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def measure(code: str, *args: str, repeats: int = 5) -> dict:
    runs = [json.loads(subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                                      check=True).stdout.strip().splitlines()[-1]) for _ in range(repeats)]
    return {"seconds": statistics.median(r["seconds"] for r in runs), "rss_mib": max(r["rss_mib"] for r in runs)}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "qwen3-vl-32b"
        logical = write_sparse_checkpoint(ROOT / "bench" / "configs" / "Qwen3-VL-32B-Instruct.json", model_dir)
        probe = measure(SPARSE_PROBE, str(model_dir))
        base = measure(BASELINE)
    print(f"{'':28}{'seconds':>10}{'peak RSS MiB':>14}")
    print(f"{'import torch+transformers':28}{base['seconds']:>10.2f}{base['rss_mib']:>14.0f}")
    print(f"{'probe, Qwen3-VL-32B sparse':28}{probe['seconds']:>10.2f}{probe['rss_mib']:>14.0f}")
    print(f"checkpoint: {logical / 2**30:.1f} GiB logical; probe / import = {probe['seconds'] / base['seconds']:.2f}")


if __name__ == "__main__":
    main()
