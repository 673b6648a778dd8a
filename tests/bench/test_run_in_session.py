"""bench/_shared.run_in_session: a bench's bounded run ends every process it started, with a grace to clean up."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from _shared import run_in_session  # noqa: E402

# Writes what it receives; on SIGTERM it cleans up (a line) and ends, as Snakemake does.
TIDY = """\
import signal, sys, time
def tidy(number, frame):
    print("cleaned up after", signal.Signals(number).name, flush=True)
    sys.exit(3)
signal.signal(signal.SIGTERM, tidy)
print("started", flush=True)
time.sleep(600)
"""


def test_a_finished_command_gives_its_exit_code_and_output(tmp_path):
    log = tmp_path / "log"
    with open(log, "w") as handle:
        assert run_in_session([sys.executable, "-c", "print('done'); raise SystemExit(4)"], handle, 60) == 4
    assert log.read_text() == "done\n"


def test_past_its_timeout_a_command_gets_its_grace_then_is_stopped(tmp_path):
    log = tmp_path / "log"
    started = time.monotonic()
    with open(log, "w") as handle:
        assert run_in_session([sys.executable, "-c", TIDY], handle, 3, grace_seconds=5) is None
    assert time.monotonic() - started < 30
    assert log.read_text().splitlines() == ["started", "cleaned up after SIGTERM"]
