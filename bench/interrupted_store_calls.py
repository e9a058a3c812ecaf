"""Threads that interrupted store calls leave behind: ``N`` calls of a ``StoreCoordinator`` on a
store whose ``check`` answers only once released, each caller interrupted (SIGUSR1 raising a
BaseException, as Ctrl-C's KeyboardInterrupt) while it waits, then the call released; the threads
that make the coordinator's store calls (``llmtailor-store-call``) still alive 2 s later.

    python bench/interrupted_store_calls.py   (PYTHONPATH: the tree measured)
"""

from __future__ import annotations

import signal
import threading
import time

from llmtailor.distributed.coordinator import StoreCoordinator


class Held:
    """A store whose ``check`` answers only once ``release`` is set."""

    def __init__(self) -> None:
        self.asked, self.release = threading.Event(), threading.Event()

    def check(self, keys: list[str]) -> bool:
        self.asked.set()
        self.release.wait(60)
        return False


class Interrupted(BaseException):
    """What the signal's handler raises in the main thread, as Ctrl-C's KeyboardInterrupt."""


def interrupt(*_: object) -> None:
    raise Interrupted


def main(n: int = 20) -> None:
    signal.signal(signal.SIGUSR1, interrupt)
    caller = threading.get_ident()
    for _ in range(n):
        held = Held()
        threading.Thread(target=lambda: held.asked.wait(60) and signal.pthread_kill(caller, signal.SIGUSR1),
                         daemon=True).start()
        try:
            StoreCoordinator.over(held, 1, 2, timeout=60).poll("r1/a")
        except Interrupted:
            pass
        held.release.set()
    time.sleep(2)  # the calls released return at once; their threads end then, where they do
    alive = sum(thread.name == "llmtailor-store-call" for thread in threading.enumerate())
    print(f"{n} interrupted store calls: {alive} store-call threads alive after their calls returned")


if __name__ == "__main__":
    main()
