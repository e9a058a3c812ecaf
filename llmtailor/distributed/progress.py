"""This process's progress at long work, as a count the commit coordinator's beats read
(``coordinator.StoreCoordinator.working``): the store's read, copy and write loops call
``advance``. Imports nothing, so that the store's torch-free paths (a weights-only merge) stay
free of torch."""

from __future__ import annotations

_ticks = 0
"""Pieces of work this process did (``advance``)."""


def advance() -> None:
    """This process did a piece of long work (read a part of a file, copied a piece into a live
    tensor, received an item): a rank inside ``Coordinator.working`` shows the others it is not
    stuck. Called from the loops that read and copy; costs an increment."""
    global _ticks
    _ticks += 1


def ticks() -> int:
    """The pieces of work this process did so far (``advance``)."""
    return _ticks


__all__ = ["advance", "ticks"]
