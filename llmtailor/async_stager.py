"""Async saves: the same staging and persisting as a synchronous save, run in the background.

A synchronous save stages references to the live tensors and persists them before returning.
An async save stages the same pieces, but ``BackgroundSave`` copies them into reusable host
buffers on a background thread while training goes on (forward and backward do not change
weights or optimizer state), then persists the copies on that thread with the very same
``persist`` (same files, same commit protocol, same cross-rank commit).

The fence: an optimizer step pre-hook installed on every optimizer whose step changes staged
tensors makes ``optimizer.step()`` wait until the copies are taken, so a snapshot never holds a
value from after the step; so do the ``train()`` / ``eval()`` of schedule-free optimizers, which
swap the weights in place (their documented pattern is ``eval()``, save, ``train()``). Pieces
that can change outside the optimizer step (a buffer updated in forward) are copied before
``save`` returns. Any other in-place change of staged state while a save is in flight must
wait for ``AsyncStager.wait_copied`` (``Tailor.fence()``). One that does not, made through the
tensor itself, bumps the tensor's version counter: compared once the copies are taken, it fails
that save rather than commit a mix of values. One made through ``.data``, or to an inference-mode
tensor, bumps no counter and is not caught: the snapshot may hold old values, new ones or a mix.
A tensor replaced (``param.data = new``) is harmless: the staged piece keeps the old one.

At most ``in_flight`` saves are in flight (``TailorConfig.async_in_flight``: 1, the default, or
2). With 2, a save is staged, copied, written and sent while the one before it still finishes its
commit; the save after waits for the older one to end (``settle``). What
the ranks must do in one order stays in order (``store.staged.InTurn``): the courier's exchanges,
and the commits, the newer one only once the older has committed; a save staged behind one that
fails is not committed either. A set of buffers per save in flight, each reused from save to save
(pinned where CUDA is available, so device-to-host copies run on a side stream): the extra memory
is that of the largest save, twice with two in flight (one set is used while saves do not
overlap). A failure on the
background thread is kept and raised once by the caller's next ``save`` (with two in flight:
the next but one), ``wait`` or ``close``, naming the save that failed and any lost with it
(``settle``); one the caller never
collects (a script that ends without ``close()``) is printed on stderr at exit. The background
threads are not daemons: a save in flight when a script ends is finished and committed before
the interpreter exits.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from llmtailor.constants import MOST_IN_FLIGHT
from llmtailor.distributed.coordinator import describe_error
from llmtailor.errors import BackgroundSaveError, TailorError
from llmtailor.store.staged import InTurn, PersistResult, Piece, StagedSnapshot, StagedUnit, version_of

_ALIGN = 64  # bytes: every staged view starts aligned for any dtype and for vector copies


class HostBuffers:
    """One flat host buffer, grown to the largest save seen and reused, carved into views."""

    def __init__(self) -> None:
        self._flat: torch.Tensor | None = None
        self._carved: tuple[list[tuple[torch.dtype, torch.Size]], list[torch.Tensor]] | None = None
        """The pieces' dtypes and shapes the views were last carved for, and those views."""

    @property
    def nbytes(self) -> int:
        return 0 if self._flat is None else self._flat.numel()

    def views(self, pieces: list[Piece]) -> list[torch.Tensor]:
        """An empty host tensor for each piece (its dtype and shape), inside the buffer: the
        views carved for the save before when its pieces had the same dtypes and shapes (a save
        at every step: the same pieces each time; ~20 us of the training thread per piece)."""
        wanted = [(piece.tensor.dtype, piece.tensor.shape) for piece in pieces]
        if self._carved is not None and self._carved[0] == wanted:
            return list(self._carved[1])
        offsets, total = [], 0
        for piece in pieces:
            offsets.append(total)
            total += -(-piece.tensor.numel() * piece.tensor.element_size() // _ALIGN) * _ALIGN
        if self._flat is None or self._flat.numel() < total:
            self._flat = self._carved = None  # free the old buffer (and its views) before taking a larger one
            pin = torch.cuda.is_available() and any(p.tensor.is_cuda for p in pieces)
            self._flat = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pin)
        views = []
        for piece, start in zip(pieces, offsets):
            size = piece.tensor.numel() * piece.tensor.element_size()
            views.append(self._flat[start : start + size].view(piece.tensor.dtype).view(piece.tensor.shape))
        self._carved = (wanted, list(views))
        return views


@dataclass(eq=False)
class BackgroundSave:
    """One async save: copying, then persisting, on its own thread."""

    step: int
    units: list[str]
    """The units the save writes (every rank's)."""
    composite: dict[str, int] = field(default_factory=dict)
    """The composite it commits: the writer's lineage once it has."""
    target: str = ""
    """Where it is saved (the run), for messages."""
    blocked_seconds: float = 0.0
    """How long ``save`` blocked the caller (choosing units, encoding global state, copying
    the pieces that must be copied at once, starting the thread)."""
    copied: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    buffers: int = 0
    """Which of the stager's buffer sets holds its copies."""
    outcome: PersistResult | None = None
    error: BaseException | None = None
    copy_seconds: float = 0.0
    persist_seconds: float = 0.0
    turn: InTurn | None = None
    """Its place behind the save before it (``StagedSnapshot.turn``)."""

    def done(self) -> bool:
        return self.finished.is_set()

    def result(self, timeout: float | None = None) -> PersistResult:
        """Wait until the snapshot is committed (durable) and return what persisting returned;
        raise the error the background thread met."""
        if not self.finished.wait(timeout):
            raise TimeoutError(f"the save of step {self.step} is still in flight after {timeout} s")
        _UNREPORTED.discard(self)
        if self.error is not None:
            raise self.error
        assert self.outcome is not None
        return self.outcome


_UNREPORTED: set[BackgroundSave] = set()
"""Failed saves whose error no caller has collected yet (``result``)."""


@atexit.register
def _report_uncollected() -> None:
    """At exit (after the interpreter waited for the save threads): a failure nobody collected
    must not vanish with the process."""
    for job in list(_UNREPORTED):
        print(
            f"llmtailor: ERROR: the async save of step {job.step} to {job.target} failed in the background and was "
            f"NOT saved (the script ended without tailor.wait() or close()): {type(job.error).__name__}: {job.error}",
            file=sys.stderr,
        )


class AsyncStager:
    """Runs async saves (module docstring): host buffers, the fence, ``in_flight`` saves in flight."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], in_flight: int = 1):
        assert 1 <= in_flight <= MOST_IN_FLIGHT, in_flight  # TailorConfig checked it
        self.in_flight = in_flight
        self.sets = [HostBuffers() for _ in range(in_flight)]
        self.current: BackgroundSave | None = None
        """The newest save started (its copies are what the fence waits for)."""
        self.unsettled: list[BackgroundSave] = []
        """The saves started and not yet settled by the caller (``settle``), oldest first."""
        self.failed: list[BackgroundSave] = []
        """A failed save and those lost with it, settled and not yet raised (``raise_failure``)."""
        self.fence_seconds = 0.0
        """Total time optimizer steps waited at the fence."""
        self._hooks = [opt.register_step_pre_hook(self._fence) for opt in optimizers]
        self._swaps = [(opt, name) for opt in optimizers for name in _weight_swaps(opt)]
        for opt, name in self._swaps:
            setattr(opt, name, self._fenced(getattr(opt, name)))

    @property
    def buffers(self) -> HostBuffers:
        """The first set of buffers (the only one used while saves do not overlap)."""
        return self.sets[0]

    def start(
        self,
        staged: StagedSnapshot,
        units: list[StagedUnit],
        persist: Callable[[StagedSnapshot], PersistResult],
        after: Callable[[PersistResult], Any] | None = None,
        target: str = "",
        chosen: list[str] | None = None,
    ) -> BackgroundSave:
        """Begin a save of ``units`` (live references, this rank's pieces; ``chosen``: every
        rank's units): take the copies and persist in the background, behind the save still in
        flight, if any (``staged.turn``). The caller has settled all but one earlier save."""
        assert len(self.unsettled) < self.in_flight, f"at most {self.in_flight} saves in flight"
        busy = {job.buffers for job in self.unsettled if not job.done()}
        job = BackgroundSave(step=staged.step, units=list(chosen if chosen is not None else [u.unit for u in units]),
                             composite=dict(staged.composite), target=target,
                             buffers=min(set(range(self.in_flight)) - busy))
        staged.turn.step = staged.step
        staged.turn.before = self.unsettled[-1].turn if self.unsettled else None
        job.turn = staged.turn
        pieces = [piece for unit in units for piece in unit.pieces]
        views = self.sets[job.buffers].views(pieces)
        for piece, view in zip(pieces, views):
            if not piece.stable:  # may change before the next optimizer step: copy it now
                view.copy_(piece.tensor)
        versions = [version_of(p.tensor) for p in pieces]
        # Device tensors: the copies wait for what the training streams have queued so far, on
        # each device that holds pieces (a rank's model on cuda:1 while its current device is 0).
        ready = {device: _recorded(torch.cuda.current_stream(device))
                 for device in sorted({p.tensor.device.index for p in pieces if p.tensor.is_cuda})} or None
        self.current = job
        self.unsettled.append(job)
        thread = threading.Thread(
            target=self._run, args=(job, staged, units, views, versions, ready, persist, after),
            name=f"llmtailor-save-{staged.step}",
        )
        thread.start()
        return job

    def settle(self, keep: int = 0) -> tuple[list[BackgroundSave], bool]:
        """Wait for the saves in flight but the newest ``keep``, oldest first; return those that
        committed, in order (the caller extends its lineage with them), and whether a save
        failed uncommitted (the caller then goes back to the last one committed). A save that
        failed ends the settling: every save after it was staged behind it and fails with it
        (waited for too); they are kept in ``failed`` for ``raise_failure``. A save committed
        whose follow-up (retention, promotions) failed is returned, and its failure kept as well."""
        committed: list[BackgroundSave] = []
        while len(self.unsettled) > keep:
            job = self.unsettled.pop(0)
            job.finished.wait()
            if job.outcome is not None:
                committed.append(job)
                if job.error is not None:
                    self.failed.append(job)
                continue
            lost, self.unsettled = self.unsettled, []
            for later in lost:
                later.finished.wait()
            self.failed += [job, *lost]
            return committed, True
        return committed, False

    def raise_failure(self, refused: int | None = None, newest: int | None = None, unconfirmed: list[str] = ()) -> None:
        """Raise what ``settle`` kept, once, as a BackgroundSaveError saying what was not saved
        (``refused``: the step of a save refused because of it; ``newest``: the composite still
        in force), and what the saves committed before it could not confirm (``unconfirmed``:
        their ``PersistResult.unconfirmed``, said with it)."""
        if not self.failed:
            return
        first, lost = self.failed[0], [job.step for job in self.failed[1:] if job.outcome is None]
        for job in self.failed:
            _UNREPORTED.discard(job)
        self.failed = []
        if first.outcome is not None:
            failed = (f"the async save of step {first.step} was committed, but what follows its commit failed in the "
                      f"background ({describe_error(first.error)})")
        else:
            behind = f", nor of the save of {' and '.join(f'step {step}' for step in lost)}, staged behind it," if lost else ""
            failed = (f"the async save of step {first.step} failed in the background ({describe_error(first.error)}); "
                      f"nothing of it was committed{behind} and the run's newest composite is still "
                      + ("no composite" if newest is None else f"step {newest}"))
        if refused is not None:
            failed = f"step {refused} was not saved: {failed}. Call save({refused}) again to save this step"
        if unconfirmed:
            failed = f"{failed}; and before it, {unconfirmed_text(unconfirmed)}"
        raise BackgroundSaveError(failed) from first.error

    def wait_copied(self) -> None:
        """Block until the saves in flight (if any) have taken their copies: after this, the
        live weights and optimizer state may change in place."""
        for job in [*self.unsettled, *([self.current] if self.current is not None else [])]:
            if not job.copied.is_set():
                start = time.perf_counter()
                job.copied.wait()
                self.fence_seconds += time.perf_counter() - start

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for opt, name in self._swaps:
            if name in vars(opt):
                delattr(opt, name)  # the class's own method shows through again
        self._swaps = []

    def _fenced(self, method: Callable[[], Any]) -> Callable[[], Any]:
        def fenced(*args: Any, **kwargs: Any) -> Any:
            self.wait_copied()
            return method(*args, **kwargs)

        return fenced

    def _run(self, job, staged, units, views, versions, ready, persist, after) -> None:
        try:
            start = time.perf_counter()
            try:
                copies = iter(views)
                # A side stream on each device that holds pieces, made current there: a copy runs
                # on its source device's current stream, and this thread's current device is 0
                # whatever the training thread's (a stream of device 0 alone let the copies of a
                # rank on cuda:1 run on that device's default stream, not waited for).
                streams = {device: torch.cuda.Stream(device) for device in ready or {}}
                with ExitStack() as current:
                    for device, stream in streams.items():
                        current.enter_context(torch.cuda.stream(stream))
                        stream.wait_event(ready[device])
                    # replace(): the copy differs from the live unit by its pieces alone; every
                    # other field (the frozen tensors it keeps, from a snapshot or the base) carries over.
                    staged_units = [replace(u, pieces=[_copied(p, next(copies)) for p in u.pieces]) for u in units]
                for stream in streams.values():  # waited for asleep: a stream's synchronize spins, a CPU busy meanwhile
                    _recorded(stream, blocking=True).synchronize()
                pieces = [piece for unit in units for piece in unit.pieces]
                for piece, before in zip(pieces, versions):
                    if piece.stable and version_of(piece.tensor) != before:
                        raise TailorError(
                            f"the async save of step {staged.step} was abandoned: {piece.key} was changed in place "
                            "after save() returned and before its copy was taken; change weights or optimizer state "
                            "outside optimizer.step() only after tailor.fence() (or save with blocking=True)"
                        )
            finally:
                job.copy_seconds = time.perf_counter() - start
                job.copied.set()  # released on failure too: a failed save must not stall training
            start = time.perf_counter()
            job.outcome = persist(replace(staged, units=staged_units))
            job.persist_seconds = time.perf_counter() - start
            if after is not None:
                after(job.outcome)
        except BaseException as err:  # kept for the caller's next save, wait or close
            _let_go_of_frames(err)
            job.error = err
            _UNREPORTED.add(job)
        finally:
            staged.turn.end(committed=job.outcome is not None)  # the save behind it may commit, or fails
            job.finished.set()

    def _fence(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.wait_copied()


def unconfirmed_text(unconfirmed: list[str]) -> str:
    """What saves committed could not confirm (each one's ``PersistResult.unconfirmed``, oldest
    first), said in one message: each of them ('' for none)."""
    return "; and ".join(unconfirmed)


def _weight_swaps(optimizer: torch.optim.Optimizer) -> list[str]:
    """The methods of ``optimizer`` that change the weights in place outside ``step``: the
    ``train()`` / ``eval()`` of schedule-free optimizers (a torch optimizer defines neither)."""
    return [name for name in ("train", "eval") if callable(getattr(optimizer, name, None))]


def _let_go_of_frames(err: BaseException) -> None:
    """Clear the locals of the finished frames in ``err``'s tracebacks (its chain's too): a
    failure kept until the caller's next call would otherwise keep everything the failed write
    held (staged files' mappings, buffers) alive until then. The traceback still prints."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        traceback.clear_frames(err.__traceback__)
        err = err.__cause__ or err.__context__


def _recorded(stream: torch.cuda.Stream, blocking: bool = False) -> torch.cuda.Event:
    """An event recorded on ``stream``, after the work queued on it so far."""
    event = torch.cuda.Event(blocking=blocking)
    event.record(stream)
    return event


def _copied(piece: Piece, view: torch.Tensor) -> Piece:
    if piece.stable:
        view.copy_(piece.tensor, non_blocking=view.is_pinned())
    return replace(piece, tensor=view)


