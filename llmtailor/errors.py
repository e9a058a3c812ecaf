"""Errors llmtailor raises for a user's mistake or a damaged checkpoint.

Every message names the file, key or value at fault and what was expected; the CLI prints
the message without a traceback and exits non-zero.
"""


from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


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


class UnsupportedLayoutError(TailorError):
    """The ranks of a job hold different layouts (pipeline stages, each holding some of the
    layers; models built differently): refused on every rank when the ``Tailor`` is built."""


class BackgroundSaveError(TailorError):
    """An async save failed in the background; nothing of it was committed. The original error
    is its ``__cause__``."""


class PromotionError(TailorError):
    """Copying a composite to a slower tier failed after its retries (``store/promote.py``);
    both tiers are as they were, and the composite stays in the faster one."""


class UnsupportedStateError(TailorError):
    """Some state cannot be stored without pickle (e.g. a callable in a scheduler)."""


def describe_validation(error: "ValidationError", limit: int = 10) -> str:
    """Every problem of a pydantic ValidationError in one line, each naming its key."""
    problems = []
    for item in error.errors()[:limit]:
        key = ".".join(str(part) for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            problems.append(f"unknown key {key!r}")
        else:
            problems.append(f"key {key!r}: {message}" if key else message)
    more = len(error.errors()) - limit
    return "; ".join(problems) + (f"; ... ({more} more)" if more > 0 else "")
