"""Worker threads that stop on Ctrl-C before the device they use is closed."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence


def run_threads(
    targets: Sequence[Callable[[], None]],
    stop: threading.Event,
    wake: Callable[[], None] | None = None,
    name: str = "worker",
) -> None:
    """Runs each of ``targets`` on a thread of its own (``name-0``, ``name-1``, ...) and
    returns once all have returned. On Ctrl-C (a KeyboardInterrupt in this thread) sets
    ``stop``, which the targets check, calls ``wake`` (to release targets that wait on
    something else), waits for them to return and re-raises: no thread outlives the
    command, so none sees the device closed under it.

    The wait is on a count the targets bring down, not on ``Thread.join``: a join that a
    KeyboardInterrupt interrupts can mark a running thread stopped (CPython 3.11), and
    joining it again would then return at once."""
    running = [0]
    finished = threading.Condition()

    def body(target: Callable[[], None]) -> None:
        try:
            target()
        finally:
            with finished:
                running[0] -= 1
                finished.notify_all()

    def wait() -> None:
        with finished:
            finished.wait_for(lambda: running[0] == 0)

    threads = [threading.Thread(target=body, args=(t,), name=f"{name}-{i}") for i, t in enumerate(targets)]
    try:
        for t in threads:
            with finished:
                running[0] += 1
            t.start()
        wait()
    except KeyboardInterrupt:
        stop.set()
        if wake is not None:
            wake()
        wait()
        raise
    finally:
        for t in threads:
            if t.ident is not None:
                t.join()  # each has returned (or is about to): a join that cannot hang
