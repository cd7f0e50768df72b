"""The one exception type for mistakes a user can make (bad file, bad key, bad flag).

The command line prints its message on one line and exits with code 2, without a traceback.
"""


class NmtError(Exception):
    """A user-facing error: the message names the input (file, line, key) and what to do."""

    exit_code = 2
