"""Errors a user can fix. The CLI prints them as one line and exits non-zero, no traceback."""


class OutriderError(Exception):
    """A problem with the user's input or setup; the message says how to fix it."""


class ModelFileError(OutriderError):
    """A model file is missing, truncated or not something we can run."""


class ConfigError(OutriderError):
    """A setting, plugin name or plugin option is wrong."""
