"""Errors llmtailor raises for a user's mistake or a damaged checkpoint.

Every message names the file, key or value at fault and what was expected; the CLI prints
the message without a traceback and exits non-zero.
"""


class TailorError(Exception):
    """Base class: a problem the user can act on."""


class ConfigError(TailorError):
    """A policy, plan or option is invalid."""


class SnapshotNotFoundError(TailorError):
    """The run directory holds no committed snapshot (at the requested step)."""


class IntegrityError(TailorError):
    """A file is missing, truncated, or its checksum differs from the manifest's."""


class IncompatibleModelError(TailorError):
    """The live model or optimizer does not match what the snapshot holds."""


class UnsupportedStateError(TailorError):
    """Some state cannot be stored without pickle (e.g. a callable in a scheduler)."""
