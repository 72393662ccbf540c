"""DataError: the one exception type of titanax.data (its own module, so every reader and
writer can raise it without importing the others)."""

from __future__ import annotations

from titanax.config import ConfigError


class DataError(ConfigError):
    """A data file is missing or malformed; the message names the file and the fix."""
