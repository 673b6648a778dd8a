"""What the terminal shows of a stage's log. Under Snakemake a stage's output goes to its log file
(``logs/<stage>/...``), so after a run the workflow prints what the user must read there: for a failed
stage its message and what to do (:func:`stage_message`), for a finished one its warnings and its last
line of its own, what it made (:func:`stage_summary`). A stage writes its message as ``error: ...``
(:func:`videosft.provenance.exit_after`), a warning as ``WARNING: ...`` and what it made as
``<stage>: ...`` (a preprocess shard: ``preprocess shard i/n: ...``).
"""

import re

# How a stage's own message starts on its log (provenance.exit_after prints it) and how much of a
# log's end shows when there is none (a bug's traceback, a killed process).
MESSAGE_START = "error: "
WARNING_START = "WARNING: "  # a warning of the stage's own, which the terminal shows after the run
TAIL_LINES = 15
# What torchrun (the train stage's launcher) writes when a rank fails: its log lines ("E1203 11:55:21.453000
# 10433 .../api.py:1002] failed (exitcode: 1) ..."), then its own traceback ending in ChildFailedError and a
# summary box. They say only that a rank failed, and they came after the rank's message.
LAUNCHER_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ")
LAUNCHER_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
TRACEBACK = "Traceback (most recent call last):"


def own_lines(lines: list[str]) -> list[str]:
    """A stage log's lines without what its launcher (torchrun) reported about a failed rank."""
    failed = [i for i, line in enumerate(lines) if LAUNCHER_FAILED in line]
    if failed:
        lines = lines[:max((i for i in range(failed[-1]) if lines[i].startswith(TRACEBACK)), default=failed[-1])]
    return [line for line in lines if not LAUNCHER_LOG.match(line)]


def stage_message(log_text: str) -> str:
    """What a failed stage said last: its ``error:`` message to the end of the log, once even where each
    rank said it, else the log's last lines (a bug's traceback); never what torchrun adds after a failed
    rank."""
    lines = own_lines(log_text.rstrip().splitlines())
    starts = [i for i, line in enumerate(lines) if line.startswith(MESSAGE_START)]
    if not starts:
        return "\n".join(lines[-TAIL_LINES:])
    last = lines[starts[-1]]
    # each rank that failed so said it; one rank's copy may lack the record line another's has
    copies = [lines[start:end] for start, end in zip(starts, [*starts[1:], len(lines)]) if lines[start] == last]
    return "\n".join(max(copies, key=len))


def failed_jobs(snakemake_log: str) -> list[tuple[str, str]]:
    """(rule, its log file) for each job Snakemake's log reports failed (its "Error in rule" blocks)."""
    jobs = []
    for block in snakemake_log.split("Error in rule ")[1:]:
        rule = block.split(":", 1)[0].strip()
        log = re.search(r"^\s*log: (\S+)", block, re.MULTILINE)
        if log and (rule, log.group(1)) not in jobs:
            jobs.append((rule, log.group(1)))
    return jobs


# How Snakemake's log announces a job, with a rule's message (its `message:` names its log, see
# workflow/rules/common.smk's announce) or, under --verbose, with the job's details, and its end.
ANNOUNCED = re.compile(r"^Job (\d+): .*\(log: (\S+)\)$")
DETAIL = re.compile(r"^(jobid|log): (\S+)")
FINISHED = re.compile(r"^Finished jobid: (\d+)\b")


def finished_logs(snakemake_log: str) -> list[str]:
    """The log file of each job Snakemake's log reports finished, in the order they finished."""
    announced, finished, details = {}, [], {}
    for line in map(str.strip, snakemake_log.splitlines()):
        if match := ANNOUNCED.match(line):
            announced[match.group(1)] = match.group(2)
        elif match := DETAIL.match(line):  # a job's details: its log, then its id
            details[match.group(1)] = match.group(2)
            if "jobid" in details and "log" in details:
                announced[details.pop("jobid")] = details.pop("log")
        elif (match := FINISHED.match(line)) and match.group(1) in announced:
            if announced[match.group(1)] not in finished:
                finished.append(announced[match.group(1)])
        if line.startswith("["):  # a new entry: a job without a log leaves no detail behind
            details.clear()
    return finished


def stage_summary(log_text: str, stage: str, main_log: bool = True) -> list[str]:
    """What a finished stage's log holds for the terminal: its warnings, each once however many ranks
    wrote it, and, in the stage's main log (not a preprocess shard's), its last line of its own
    (``<stage>: ...``, what it made)."""
    lines = own_lines(log_text.splitlines())
    shown = list(dict.fromkeys(line for line in lines if line.startswith(WARNING_START)))
    last = [line for line in lines if line.startswith(f"{stage}: ")][-1:] if main_log else []
    return shown + last
