"""Processes a test starts, and only those: their trees, stopped and killed, and a run bounded in time
(the benchmarks' bounded runs, bench/_shared.run_in_session, end their trees here too).

A test signals nothing it did not start. It finds what it started by walking down from its own child
(never by process group or command-line pattern): torchrun starts each rank in a session of its own,
and a pattern also matches other people's jobs on the machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil

# Every Python process a bounded run starts writes all its threads' stacks to stderr on SIGABRT: a run
# that hangs says where each process waits before it is killed.
FAULTHANDLER = {"PYTHONFAULTHANDLER": "1"}
STACKS_WAIT = 20  # seconds for the aborted processes to write their stacks


def stopped_tree(root: psutil.Process) -> list[psutil.Process]:
    """``root`` and every process below it, each stopped (SIGSTOP) before its children are listed, so
    that none starts another unseen: a fork with a signal pending is restarted after the signal."""
    found: dict[int, psutil.Process] = {}
    new = [root]
    while new:
        for process in new:
            found[process.pid] = process
            try:
                process.suspend()
            except psutil.NoSuchProcess:
                pass
        new = []
        for process in list(found.values()):
            try:
                new += [child for child in process.children(recursive=True) if child.pid not in found]
            except psutil.NoSuchProcess:
                pass
    return list(found.values())


def gone(process: psutil.Process) -> bool:
    """Ended (a zombie has ended; its parent, or init for an orphan, has yet to collect it)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _tree_of(root: subprocess.Popen | psutil.Process) -> list[psutil.Process]:
    try:
        return stopped_tree(psutil.Process(root.pid))
    except psutil.NoSuchProcess:  # it had ended already (a Popen's own child: collected by its wait)
        return []


def _wait_gone(tree: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while not all(gone(process) for process in tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [process for process in tree if not gone(process)]


def _kill(tree: list[psutil.Process], root: subprocess.Popen | psutil.Process) -> None:
    for process in tree:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    if isinstance(root, subprocess.Popen):
        root.wait()
    left = _wait_gone(tree, 60)
    assert not left, f"still running after SIGKILL: {left}"


def kill_tree(root: subprocess.Popen | psutil.Process) -> None:
    """SIGKILL a process the test started and every process below it, and wait until all have ended."""
    _kill(_tree_of(root), root)


def signal_tree(root: subprocess.Popen, number: signal.Signals, wait: float) -> None:
    """Send ``number`` to every process of the tree (ranks in sessions of their own included, which a
    process-group signal misses), give them ``wait`` seconds to act on it and end, then SIGKILL the rest."""
    tree = _tree_of(root)
    for process in tree:
        try:
            process.send_signal(number)
            process.resume()
        except psutil.NoSuchProcess:
            pass
    _wait_gone(tree, wait)
    _kill(tree, root)  # the tree as listed: a rank whose parent has died is no longer below the root


def abort_tree(root: subprocess.Popen) -> None:
    """SIGABRT every process of the tree (each Python process of a bounded run writes its stacks), then
    SIGKILL whatever has not ended after STACKS_WAIT seconds."""
    signal_tree(root, signal.SIGABRT, STACKS_WAIT)


def run_bounded(command: list[str], *, timeout: float, env: dict | None = None, merge_stderr: bool = True,
                **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` whose timeout ends the whole tree the command started, ranks in sessions of
    their own included (``subprocess.run`` kills only its child; orphaned ranks then hold the output
    pipe and the test waits on them forever). Past the timeout every Python process of the tree writes
    its stacks, and TimeoutExpired carries the output, stacks included."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, text=True,
                               env={**(env if env is not None else os.environ), **FAULTHANDLER}, **kwargs)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        abort_tree(process)
        stdout, stderr = process.communicate()
        output = stdout if merge_stderr else f"{stdout}\n--- stderr ---\n{stderr}"
        raise subprocess.TimeoutExpired(command, timeout, output=output) from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
