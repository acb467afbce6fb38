"""The error a user can fix: a bad file, path or value the run was given.

`python -m periodic_async` prints it as one line and exits 2, like a config error, on every rank:
a traceback would only bury the message, which names the key, file or line at fault. Errors in
the code itself stay ordinary exceptions, with their traceback.
"""
from __future__ import annotations

# The exit code of a config or input error (launch.py keeps it when it launches the ranks).
INPUT_ERROR_EXIT_CODE = 2


class InputError(ValueError):
    """An expected user error; the message names the config key, file or line at fault."""
