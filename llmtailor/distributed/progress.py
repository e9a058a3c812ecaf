"""Progress at long work, counted per block of work (``Scope``), as the commit coordinator's
beats read it (``coordinator.StoreCoordinator.working``): the store's read, copy and write loops
call ``advance``, which counts for the blocks the calling thread works for: those it entered, and
those of the thread that handed it the work (``carried``). So one block stuck (a node's uploader
hung in one request) shows no progress while another block of the process goes on (the training
thread's next saves). A wait on the system for a block (``waiting``: an fsync, which on a
slow disk may outlast the timeout) shows it live too, for a bounded time. Imports nothing but the
standard library's ``threading`` and ``time``, so that the store's torch-free paths (a
weights-only merge) stay free of torch."""

from __future__ import annotations

import threading
import time

_on = threading.local()
"""The calling thread's blocks of work (``scopes``: a tuple of ``Scope``)."""


class Scope:
    """One block of long work (``Coordinator.working``): the pieces of work done for it
    (``ticks``), on the thread that entered it and on those it handed work to (``carried``)."""

    __slots__ = ("ticks", "waits")

    def __init__(self) -> None:
        self.ticks = 0
        self.waits: dict[waiting, float] = {}
        """The waits on the system under way for it (``waiting``), each with when it began."""

    def waited_since(self) -> float | None:
        """When the oldest wait under way for this block began (``time.monotonic``), or None."""
        return min(tuple(self.waits.values()), default=None)


def _scopes() -> tuple[Scope, ...]:
    return getattr(_on, "scopes", ())


def advance() -> None:
    """The calling thread did a piece of long work (read a part of a file, copied a piece into a
    live tensor, received an item) for the blocks it works for: a rank inside
    ``Coordinator.working`` shows the others that this block is not stuck. Called from the loops
    that read and copy; costs an increment per block (none outside one)."""
    for scope in _scopes():
        scope.ticks += 1


class within:  # noqa: N801 - used as a statement, as contextlib's are
    """``with within(*scopes):`` the calling thread works for ``scopes`` too (``advance``)."""

    def __init__(self, *scopes: Scope) -> None:
        self._scopes = scopes

    def __enter__(self) -> None:
        self._before = _scopes()
        _on.scopes = self._before + tuple(scope for scope in self._scopes if scope not in self._before)

    def __exit__(self, *exc: object) -> None:
        _on.scopes = self._before


class waiting:  # noqa: N801 - used as a statement, as contextlib's are
    """``with waiting():`` the calling thread waits on the system (an fsync: the disk) for the
    blocks it works for: no piece of work ends meanwhile, yet the block is not stuck in its own
    code. ``Coordinator.working`` shows such a block live for a bounded time (a hung disk is
    silence in the end)."""

    def __enter__(self) -> None:
        self._scopes, since = _scopes(), time.monotonic()
        for scope in self._scopes:
            scope.waits[self] = since

    def __exit__(self, *exc: object) -> None:
        for scope in self._scopes:
            scope.waits.pop(self, None)


def carried(fn):  # type: ignore[no-untyped-def]
    """``fn`` to run on another thread (a pool's) on behalf of the blocks the calling thread works
    for: what it does there (``advance``) counts for them."""
    scopes = _scopes()
    if not scopes:
        return fn

    def on_behalf(*args, **kwargs):  # type: ignore[no-untyped-def]
        with within(*scopes):
            return fn(*args, **kwargs)

    return on_behalf


__all__ = ["Scope", "advance", "carried", "waiting", "within"]
