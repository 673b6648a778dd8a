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
