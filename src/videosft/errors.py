"""The errors a user fixes: bad config, data, checkpoint or environment, explained by their message.

A stage run from the command line ends on a :class:`UserError` with its message and a non-zero
exit, without a traceback (``VIDEOSFT_DEBUG=1`` shows it); any other exception is a bug and keeps
its traceback (:func:`videosft.provenance.exit_after`).
"""


class UserError(Exception):
    """A problem in what the user gave, with a message that names it and says what to do."""


class ConfigError(UserError, ValueError):
    """A config value or file that cannot be used."""


class InputError(UserError, ValueError):
    """A data, checkpoint or earlier stage's file that cannot be used as it is."""


# How a stage's own message starts on its log (provenance.exit_after prints it) and how much of a
# log's end shows when there is none (a bug's traceback, a killed process).
MESSAGE_START = "error: "
TAIL_LINES = 15


def stage_message(log_text: str) -> str:
    """What a failed stage said last: from its ``error:`` line to the end, else the log's last lines."""
    lines = log_text.rstrip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(MESSAGE_START)]
    return "\n".join(lines[starts[-1]:] if starts else lines[-TAIL_LINES:])


def failed_jobs(snakemake_log: str) -> list[tuple[str, str]]:
    """(rule, its log file) for each job Snakemake's log reports failed (its "Error in rule" blocks)."""
    import re

    jobs = []
    for block in snakemake_log.split("Error in rule ")[1:]:
        rule = block.split(":", 1)[0].strip()
        log = re.search(r"^\s*log: (\S+)", block, re.MULTILINE)
        if log and (rule, log.group(1)) not in jobs:
            jobs.append((rule, log.group(1)))
    return jobs
