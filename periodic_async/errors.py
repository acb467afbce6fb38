"""The errors a user can fix: a bad configuration value (ConfigError) or a bad file, path or value
the run was given (InputError).

`python -m periodic_async` prints either as one line and exits 2, on every rank:
a traceback would only bury the message, which names the key, file or line at fault. Errors in
the code itself stay ordinary exceptions, with their traceback.
"""
from __future__ import annotations

# The exit code of a config or input error (launch.py keeps it when it launches the ranks).
INPUT_ERROR_EXIT_CODE = 2


class ConfigError(ValueError):
    """A bad configuration value; the message names the dotted key and what is allowed. Raised by
    config/ (loading, validation) and by the checks of the sections' own values; importable as
    periodic_async.config.ConfigError too."""


class InputError(ValueError):
    """An expected user error; the message names the config key, file or line at fault."""
